"""The `pagedllm` command line: the generate command, and dispatch to the subcommands.

    pagedllm "Explain the KV cache in two sentences." 128
    pagedllm --stats "Explain paging." 64 "Explain GQA." "Explain RoPE."
    echo "Explain paging." | pagedllm - 64            ("-" reads the prompt from stdin)
    pagedllm tokenize "Hello, world!"        pagedllm bench latency
    pagedllm serve                           pagedllm trace "Hi" --steps 3 --layer 0
    pagedllm -- tokenize                     (a prompt that is a subcommand's name)

Owns: the options of the generate command and their checks (all made before
the model is loaded, so a bad value fails in milliseconds), the pairing of
prompts with token counts, the CLI's sampling default (greedy), printing, and
the process's exit codes. Does not own: the engine's flags (`engine_args.py`,
one per `EngineConfig` field, shared with `pagedllm bench`), the sampling
flags (`sampling_args.py`, shared with `pagedllm trace`), the subcommands' own
options (`tokenizer/cli.py`, `bench/cli.py`) or anything the engine does.

One error style for every subcommand: `pagedllm[ SUB]: error: MESSAGE` on
stderr, on one line (`cli_errors.py`, which the subcommands import). Exit codes:

    0    done
    1    the run failed: a model that cannot be loaded, a prompt the model
         cannot take (with several prompts the others still print)
    2    a usage error: a bad option or argument (argparse's code)
    130  interrupted by Ctrl-C (no traceback; streaming text gets its newline)
    141  stdout was closed early (`pagedllm ... | head`), as a process killed
         by SIGPIPE reports it; nothing more is printed
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from pagedllm import __version__, cpu_threads

# The error style lives in cli_errors.py (the subcommands import it from there, not
# from here: this module imports them to dispatch). Re-exported for older imports.
from pagedllm.cli_errors import (  # noqa: F401
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    error,
    one_line,
)
from pagedllm.engine_args import (
    add_engine_arguments,
    engine_config_from_args,
    engine_kwargs,
    positive_int,
)
from pagedllm.engine_config import EngineConfig
from pagedllm.sampling_args import add_sampling_arguments, greedy_note, sampling_kwargs
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import plural

SUBCOMMANDS = ("tokenize", "detokenize", "bench", "serve", "trace", "inspect")
PROG = "pagedllm"
DEFAULT_MAX_NEW_TOKENS = 128


def main(argv: list[str] | None = None) -> int:
    """Run one command line; return its exit code (never raises SystemExit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in SUBCOMMANDS:
            return _subcommand(argv[0])(argv[1:])
        return generate_main(argv)
    except SystemExit as e:  # argparse: --help, --version (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_FAILED)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        silence_stdout()
        return EXIT_BROKEN_PIPE


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush cannot fail again.

    What Python's docs advise after a BrokenPipeError (the `signal` module,
    "Note on SIGPIPE"); without it Python prints an error at shutdown.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout replaced by a non-file (tests)
        pass


def _subcommand(name: str) -> Callable[[list[str]], int]:
    if name == "tokenize":
        from pagedllm.tokenizer.cli import tokenize_main

        return tokenize_main
    if name == "detokenize":
        from pagedllm.tokenizer.cli import detokenize_main

        return detokenize_main
    if name == "serve":
        from pagedllm.server.cli import serve_main

        return serve_main
    if name == "trace":
        from pagedllm.trace import trace_main

        return trace_main
    if name == "inspect":
        from pagedllm.inspect_model import inspect_main

        return inspect_main
    from pagedllm.bench.cli import bench_main

    return bench_main


# ------------------------------------------------------------------ argument types
# The engine's flags and their types live in engine_args.py, the sampling flags'
# in sampling_args.py (shared with `pagedllm trace`); this is the generate
# command's own. It raises argparse.ArgumentTypeError, which argparse turns into
# "pagedllm: error: argument --x: MESSAGE" and exit 2, before loading.
def stop_string(text: str) -> str:
    if text == "":
        raise argparse.ArgumentTypeError("must not be empty")
    return text


# ------------------------------------------------------------------ the parser
EPILOG = """\
prompts and token counts:
  An argument that looks like a number is the token count of the prompt just
  before it; every other argument is a prompt. "Looks like a number": an
  optional sign and digits, with perhaps a decimal point, an exponent, digit
  separators or a base prefix (128, +5, -3, 1.5, .5, 1e3, 1_000, 1,000, 0x10).
  A token count must be a plain whole number >= 1 (128); anything else that
  looks like a number is an error, never a prompt. To send a number as the
  prompt, put words around it ("What is 1.5 squared?"). Prompts without a
  count take --max-new-tokens. "-" as a prompt reads the prompt from stdin.

sampling:
  Greedy (always the most likely token) unless you set --temperature, or the
  model's own generation_config.json sets temperature or do_sample (then its
  defaults apply, as in transformers and vLLM). --top-p, --top-k, --min-p and
  --seed apply only when sampling. The Python API (LLM, SamplingParams) keeps
  vLLM's defaults instead (temperature 1.0).

exit codes:
  0 done, 1 the run failed (a model that cannot be loaded, a prompt the model
  cannot take), 2 a usage error, 130 Ctrl-C, 141 stdout closed early.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Generate text with a paged-KV-cache engine.\n"
        "Subcommands (as the first argument): " + ", ".join(SUBCOMMANDS) + ";\n"
        "`pagedllm SUB --help` for theirs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "items",
        nargs="*",
        metavar="PROMPT [MAX_NEW_TOKENS]",
        help='prompts, each optionally followed by its max new tokens ("-" reads stdin)',
    )
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    p.add_argument(
        "--max-new-tokens",
        metavar="N",
        type=positive_int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"for prompts without their own number (default {DEFAULT_MAX_NEW_TOKENS})",
    )
    p.add_argument(
        "--raw", action="store_true", help="send the text as is, without the chat template"
    )
    p.add_argument(
        "--stats",
        action="store_true",
        help="print batching, page, prefix-cache and timing figures at the end",
    )
    p.add_argument(
        "--plot",
        metavar="DIR",
        help="draw the run in DIR: pages.png (the page pool per step), timeline.png (each "
        "request's waiting, prefill, decode), tokens.png (needs matplotlib: the plot extra)",
    )
    s = p.add_argument_group("sampling (greedy unless --temperature, see below)")
    s.add_argument("--ignore-eos", action="store_true", help="generate until max new tokens")
    add_sampling_arguments(s)  # --temperature, --top-p, --top-k, --min-p, --seed
    s.add_argument(
        "--stop",
        type=stop_string,
        metavar="TEXT",
        action="append",
        help="a stop string (repeatable)",
    )
    add_engine_arguments(p)  # --model, --device, --dtype; --kv-cache-mib, --block-size, ...
    return p


# ------------------------------------------------------------------ prompts
# An optional sign, then a decimal numeral (digit separators "_" or ",", a point,
# an exponent) or a base-prefixed integer. Words such as "inf" or "nan" are text.
_NUMBER = re.compile(
    r"[+-]?(?:(?:\d[\d_,]*(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|0[xXoObB][0-9a-fA-F_]+)"
)
_COUNT = re.compile(r"[0-9]+")
_TEXT_HINT = 'to send it as a prompt, put words around it ("What is {item}?")'


def looks_like_number(item: str) -> bool:
    return _NUMBER.fullmatch(item.strip()) is not None


def parse_prompts(items: list[str], default_max: int) -> list[tuple[str, int]]:
    """Pair each prompt with the token count that follows it, if any.

    Raises ValueError for a number-looking item that is not a valid count, or
    that follows no prompt (see the --help epilog for the rule).
    """
    pairs: list[tuple[str, int | None]] = []
    for item in items:
        if not looks_like_number(item):
            pairs.append((item, None))
            continue
        hint = _TEXT_HINT.format(item=item.strip())
        if not pairs:
            raise ValueError(
                f"{item!r} looks like a token count, but no prompt comes before it; give the "
                f'prompt first (pagedllm "PROMPT" {item.strip()}), or {hint}'
            )
        text, count = pairs[-1]
        if count is not None:
            raise ValueError(
                f"{item!r} looks like a token count, but {_short(text)} already has one "
                f"({count}); {hint}"
            )
        if not _COUNT.fullmatch(item.strip()) or int(item) < 1:
            raise ValueError(
                f"the token count after {_short(text)} must be a whole number >= 1 such as "
                f"128, got {item!r}; {hint}"
            )
        pairs[-1] = (text, int(item))
    return [(text, default_max if n is None else n) for text, n in pairs]


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _value_options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions if a.nargs != 0 for s in a.option_strings}


def _check_negative_counts(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """A negative count such as -1e3 or -0x10 would reach argparse as an unknown option."""
    takes_value = _value_options(parser)
    for i, item in enumerate(argv):
        if item == "--":
            return
        if item.startswith("-") and looks_like_number(item):
            if i > 0 and argv[i - 1] in takes_value:
                continue  # the value of an option, e.g. --top-k -1: argparse checks it
            parser.error(
                f"a token count must be a whole number >= 1 such as 128, got {item!r}; "
                + _TEXT_HINT.format(item=item)
            )


def _read_stdin_prompt(parser: argparse.ArgumentParser, prompts: list[tuple[str, int]]):
    """Replace the prompt "-" with what stdin holds (one trailing newline dropped)."""
    if sum(text == "-" for text, _ in prompts) > 1:
        parser.error('"-" (the prompt from stdin) may be given only once')
    if not any(text == "-" for text, _ in prompts):
        return prompts
    if sys.stdin is None:
        parser.error('"-" reads the prompt from stdin, but there is no stdin')
    if sys.stdin.isatty():
        print("pagedllm: reading the prompt from stdin (end it with Ctrl-D)", file=sys.stderr)
    text = sys.stdin.read().removesuffix("\n").removesuffix("\r")
    if not text.strip():
        parser.error('"-" reads the prompt from stdin, but stdin was empty')
    return [(text if t == "-" else t, n) for t, n in prompts]


# ------------------------------------------------------------------ generate
class _Printer:
    """Writes streamed text to stdout and remembers whether a line is open."""

    def __init__(self) -> None:
        self.line_open = False

    def write(self, text: str) -> None:
        if text:
            # Noted first: a Ctrl-C that lands inside the write still gets its newline.
            self.line_open = not text.endswith("\n")
            sys.stdout.write(text)
            sys.stdout.flush()

    def end_line(self) -> None:
        if self.line_open:
            self.line_open = False
            try:
                sys.stdout.write("\n")
                sys.stdout.flush()
            except OSError:  # stdout is gone too: nothing left to tidy
                pass


def generate_main(argv: list[str]) -> int:
    # 1. Everything the command line says is checked before any loading.
    parser = build_parser()
    _check_negative_counts(parser, argv)
    args = parser.parse_intermixed_args(argv)
    if not args.items:
        parser.error('give at least one prompt, e.g. pagedllm "Explain the KV cache." 128')
    try:
        prompts = parse_prompts(args.items, args.max_new_tokens)
        params = [_sampling_params(args, n) for _, n in prompts]
    except ValueError as e:
        parser.error(one_line(e))
    config = engine_config_from_args(args, parser)  # flags wrong together: exit 2 here
    prompts = _read_stdin_prompt(parser, prompts)

    # 2. Load, then generate. A failure of the run is one line and exit 1.
    def log(msg: str) -> None:
        print(msg, file=sys.stderr)

    printer = _Printer()
    try:
        if args.plot:
            from pagedllm.bench.plot import require_matplotlib

            require_matplotlib()  # before the load: a missing package costs no run
        threads = cpu_threads.apply_thread_policy(config.threads)
        llm = _build_llm(config, log)
        if args.plot:
            from pagedllm.engine.timeline import StepRecorder

            llm.engine.recorder = StepRecorder()
        params = _cli_sampling_default(args, llm, params, log)
        outputs = _generate(args, llm, [t for t, _ in prompts], params, printer)
    except KeyboardInterrupt:
        printer.end_line()
        raise
    except BrokenPipeError:
        raise
    except (ValueError, OSError) as e:  # a bad model file, a prompt the model cannot take
        printer.end_line()
        return error(PROG, e)

    # 3. Print what is left, and the stats.
    failed = _report(prompts, outputs, printer)
    if args.stats:
        print_stats(llm.stats(), outputs, threads, prefix_caching=config.prefix_caching)
    if args.plot:
        from pagedllm.plots import plot_run

        try:
            title = (
                f"{plural(len(prompts), 'prompt')}, {plural(llm.stats()['pages_total'], 'page')}"
            )
            for path in plot_run(llm.engine.recorder, args.plot, title):
                log(f"wrote {path}")
        except (ValueError, OSError) as e:
            return error(PROG, e)
    return EXIT_FAILED if failed else 0


def _sampling_params(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=args.ignore_eos, stop=args.stop, **sampling_kwargs(args)
    )


def _build_llm(config: EngineConfig, log: Callable[[str], None]) -> Any:
    """The engine (the slow part: it reads the weights)."""
    from pagedllm import LLM

    return LLM(**engine_kwargs(config), log=log)


def sampling_is_greedy_by_default(args: argparse.Namespace, model_defaults: dict) -> bool:
    """The CLI's rule: greedy unless --temperature or the model's generation_config says."""
    return args.temperature is None and not {"temperature", "do_sample"} & model_defaults.keys()


def _cli_sampling_default(
    args: argparse.Namespace,
    llm: Any,
    params: list[SamplingParams],
    log: Callable[[str], None],
) -> list[SamplingParams]:
    model_defaults = dict(getattr(llm.engine, "generation_defaults", None) or {})
    if not sampling_is_greedy_by_default(args, model_defaults):
        return params
    log(greedy_note(args))
    return [dataclasses.replace(p, temperature=0.0) for p in params]


def _generate(args, llm, texts: list[str], params, printer: _Printer):
    stream = len(texts) == 1

    def on_step(step_outputs) -> None:
        for so in step_outputs:
            printer.write(so.new_text)

    run = llm.generate if args.raw else llm.chat
    inputs = texts if args.raw else [[{"role": "user", "content": t}] for t in texts]
    return run(inputs, params, use_tqdm=False, on_step=on_step if stream else None)


def _failed(out) -> bool:
    return out.finish_reason in ("rejected", "error")


def _report(prompts: list[tuple[str, int]], outputs, printer: _Printer) -> bool:
    """Print the outputs (one prompt: its newline; several: each under its header).

    A prompt the model could not take is one `pagedllm: error:` line on stderr
    (and `[rejected]` under its header); returns True when any failed.
    """
    if len(outputs) == 1:
        printer.end_line()  # the streamed text's last line
        if _failed(outputs[0]):
            error(PROG, outputs[0].error)
        return _failed(outputs[0])
    for i, ((text, _), out) in enumerate(zip(prompts, outputs), start=1):
        print(f"### {text}")
        if _failed(out):
            print(f"[{out.finish_reason}] {one_line(out.error)}\n")
            error(PROG, f"prompt {i} ({_short(text)}): {out.error}")
        else:
            print(out.text.strip() + "\n")
    return any(_failed(o) for o in outputs)


def _weights_row(s: dict) -> list[tuple[str, str]]:
    """The model's weights on the device (rank 0's slice under tensor parallelism)."""
    if s.get("weight_bytes") is None:
        return []
    from pagedllm.memory import size_text

    note = ""
    if s.get("weights_fp8"):
        note = " (FP8 projections)"
    elif s.get("weights_packed"):
        note = " (packed: int4/int8 projections, float16 head; --dtype float32 unpacks)"
    return [("model weights", f"{size_text(s['weight_bytes'])}{note}")]


def print_stats(
    s: dict, outputs, threads: int | None = None, *, prefix_caching: bool = True
) -> None:
    """`--stats`: the last call's figures, then the engine's totals since it was built."""
    call = s["last_call"]
    if prefix_caching:
        reused = (
            f"{100 * s['prefix_cache_hit_rate']:.1f}% of prompt tokens reused "
            f"({s['prefix_cache_hit_tokens']} of {s['prefix_cache_query_tokens']}), "
            f"{s.get('prefix_cache_evictions', 0)} cached pages evicted"
        )
    else:
        reused = "off (--no-prefix-caching)"
    dtype = s.get("kv_cache_dtype")
    rows = [
        ("requests (rejected)", f"{call['requests']} ({call['rejected']})"),
        ("prompt tokens", call["prompt_tokens"]),
        ("output tokens", call["output_tokens"]),
        ("wall time", f"{call['wall_time_s']:.3f} s"),
        ("output tokens/s", call["output_tokens_per_s"]),
        ("peak active requests", s["peak_active_requests"]),
        ("largest decode batch", s["max_decode_batch"]),
        ("admission waits", s["admission_waits"]),
        ("preemptions", s["preemptions"]),
        ("prefix cache", reused),
        *_weights_row(s),
        (
            "KV pages",
            f"{s['pages_total']} of {plural(s['block_size'], 'token')}, "
            f"{s['pages_total_mib']:.1f} MiB" + (f" of {dtype}" if dtype else ""),
        ),
        (
            "KV pages in use at the peak",
            f"{s['pages_peak_used']} ({s['pages_peak_used_mib']:.1f} MiB)",
        ),
        (
            "KV pages free after the run",
            f"{s['pages_free']} ({s.get('pages_cached', 0)} with a cached prefix)",
        ),
        ("prefill tokens", s["prefill_tokens"]),
        ("decode tokens", s["decode_tokens"]),
        ("engine steps (all-decode)", f"{s['steps']} ({s['decode_steps']})"),
        ("host time per step", f"{s['host_time_per_step_ms']:.3f} ms"),
        ("torch CPU threads", s.get("threads", threads)),
    ]
    print("--- stats ---")
    for name, value in rows:
        print(f"{name:<32}{value}")
    for i, o in enumerate(outputs):
        ttft = "-" if o.time_to_first_token is None else f"{1e3 * o.time_to_first_token:.1f} ms"
        label = f"time to first token [{i}]"
        print(f"{label:<32}{ttft}  ({plural(len(o.token_ids), 'token')}, {o.finish_reason})")


if __name__ == "__main__":
    raise SystemExit(main())
