"""`pagedllm bench throughput | latency | ttft | prefix | pages | serve`: the workloads.

    pagedllm bench latency --peer hf                          # SmolLM2 on this CPU
    pagedllm bench throughput --preset llama-3.2-1b --load-format dummy --peer hf
    pagedllm bench throughput --num-requests 16 --max-prompt-len 128 --max-output-len 64
    pagedllm bench prefix --num-requests 16 --prefix-len 256 --max-num-batched-tokens 512
    pagedllm bench pages --plot pages.png                     # page sizes x admission
    pagedllm bench throughput --num-requests 16 --plot out/   # the run's timeline and pages
    pagedllm bench serve --request-rate 1,4,inf               # a running server, over HTTP

`prefix` and `pages` compare pagedllm with itself: the same workload on a
fresh LLM per setting (prefix caching on/off; page size x admission policy),
the model loaded once. Every other engine setting comes from the flags
(`engine_args.py`: one flag per `EngineConfig` field). `serve` loads no model:
it is an HTTP client with its own options (`serve_bench.py`).

Order of a run: check the options -> set the CPU threads -> load our model ->
build the LLM -> warm-up request -> measure -> free our engine (its KV pages)
-> build the peer from the same weights -> warm-up -> measure -> print a
table, then one JSON line (last line of stdout). Logs go to stderr, so
`... | tail -1` is the JSON record. The workloads and how each figure is
measured: docs/benchmarks.md; the GPU protocol and vLLM's figures: docs/gpu.md.

Errors, as every `pagedllm` command (`pagedllm/cli_errors.py`): a bad option is a usage
error (exit 2, argparse's message), found before anything is loaded; a run
that fails (a model that cannot be loaded) is one line
`pagedllm bench: error: MESSAGE`, exit 1.

Owns: options, their defaults and the order above. Does not own: the engine's
flags (`engine_args.py`), timing (`ours.py`, `hf_peer.py`), formatting
(`report.py`) or the figure (`plot.py`).
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import time
from typing import Any

from pagedllm import cpu_threads
from pagedllm.bench import workloads  # stdlib only: the defaults below
from pagedllm.cli_errors import error  # the one-line error style of every pagedllm command
from pagedllm.engine_args import (
    add_engine_arguments,
    engine_config_from_args,
    engine_kwargs,
    positive_int,
    power_of_two,
)
from pagedllm.engine_config import ADMISSION_POLICIES, EngineConfig
from pagedllm.model_source import (
    ModelSpec,
    add_model_source_arguments,
    engine_model,
    load_model,
    model_spec_from_args,
)
from pagedllm.utils import plural

PROG = "pagedllm bench"
WORKLOADS = ("throughput", "latency", "ttft", "prefix", "pages")
SERVE = "serve"  # an HTTP client with its own options: bench_main hands it on (serve_bench.py)
DEFAULTS = {  # per workload: (prompt_len, output_len, runs); docs/gpu.md's shapes
    "latency": (128, 512, 1),
    "ttft": (1024, 1, 5),
}
NUM_REQUESTS = {"throughput": 256, "prefix": 256, "pages": 16}
# pages on a CPU: 16 requests of the throughput draw, scaled to prompt and output
# <= 128 (943 output tokens), in 24 MiB of pages: with SmolLM2-135M in float32
# (45 KiB of K+V per token) about a quarter of what they need at once, so both
# policies wait or preempt, and the longest request (192 tokens) fits at every size.
PAGES_MAX_LEN, PAGES_KV_CACHE_MIB = 128, 24.0
PAGE_SIZES = (8, 16, 32, 64)

EPILOG = f"""\
workloads:
  throughput  {NUM_REQUESTS["throughput"]} requests drawn as docs/gpu.md says, all at once
  latency     one request: 128-token prompt, 512 new tokens (batch-1 decode)
  ttft        one 1024-token prompt, one new token (median of 5)
  prefix      requests sharing one long prefix, each with its own suffix (defaults: 256
              requests, 1024-token prefix, 100-token suffix, 128 new tokens), run with
              prefix caching on and then off. A prompt's pages are shared once written:
              prompts prefilled in the same step as the first reuse nothing, so keep a
              step smaller than the workload. CPU: --num-requests 16 --prefix-len 256
              --suffix-len 32 --output-len 16 --max-num-batched-tokens 512
  pages       the throughput draw under every page size of --page-sizes and both
              admission policies, in a tight page pool. Defaults are for a CPU:
              {NUM_REQUESTS["pages"]} requests scaled to prompt and output <= {PAGES_MAX_LEN}, \
--kv-cache-mib {PAGES_KV_CACHE_MIB:g}
              (SmolLM2-135M, float32). On a GPU (Llama-3.2-1B, bf16): --num-requests 256
              --max-prompt-len 1024 --max-output-len 1024 --kv-cache-mib 1024
  serve       the same draw sent to a running OpenAI-compatible server over HTTP, at
              one or more request rates: `pagedllm bench serve --help`

Every request is greedy with EOS ignored. docs/benchmarks.md: how each figure is measured.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Run one of the workloads below (docs/benchmarks.md, docs/gpu.md);\n"
        "print a table, then one JSON line.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("workload", choices=(*WORKLOADS, SERVE))  # --help lists every one
    groups = add_engine_arguments(p)  # --model, --device, --dtype; --kv-cache-mib, ...
    add_model_source_arguments(groups["model"])  # --preset, --load-format
    w = p.add_argument_group("workload")
    w.add_argument(
        "--num-requests",
        type=positive_int,
        metavar="N",
        help="throughput, prefix: requests (default 256); pages: 16",
    )
    w.add_argument(
        "--max-prompt-len",
        type=positive_int,
        metavar="N",
        help=f"throughput, pages: scale drawn prompt lengths to <= N (pages: {PAGES_MAX_LEN})",
    )
    w.add_argument(
        "--max-output-len",
        type=positive_int,
        metavar="N",
        help=f"throughput, pages: scale drawn output lengths to <= N (pages: {PAGES_MAX_LEN})",
    )
    w.add_argument(
        "--prompt-len",
        type=positive_int,
        metavar="N",
        help="latency: 128, ttft: 1024 by default; throughput: every prompt N tokens "
        "(with --output-len: fixed lengths, as a serving benchmark's random draw)",
    )
    w.add_argument(
        "--output-len",
        type=positive_int,
        metavar="N",
        help="new tokens: latency 512, prefix 128 by default; throughput: every request N",
    )
    w.add_argument(
        "--runs",
        type=positive_int,
        metavar="N",
        help="measured runs after warm-up (latency 1, ttft 5)",
    )
    w.add_argument(
        "--prefix-len",
        type=positive_int,
        metavar="N",
        default=workloads.PREFIX_LEN,
        help=f"prefix: tokens of the shared prefix (default {workloads.PREFIX_LEN})",
    )
    w.add_argument(
        "--suffix-len",
        type=positive_int,
        metavar="N",
        default=workloads.PREFIX_SUFFIX_LEN,
        help=f"prefix: each request's own tokens after it (default {workloads.PREFIX_SUFFIX_LEN})",
    )
    g = p.add_argument_group("pages")
    g.add_argument(
        "--page-sizes",
        type=_page_sizes,
        default=PAGE_SIZES,
        metavar="N,N,...",
        help="page sizes (tokens) to sweep, each under both admission policies "
        f"(default {','.join(map(str, PAGE_SIZES))}); the pool is --kv-cache-mib "
        f"(pages: default {PAGES_KV_CACHE_MIB:g}, see below)",
    )
    g.add_argument(
        "--plot",
        metavar="PATH",
        help="pages: PATH.png, the pages in use per step, one line per admission policy; "
        "throughput: a directory for pages.png, timeline.png and tokens.png of one more, "
        "untimed run of the workload (needs matplotlib: the `plot` extra)",
    )
    g.add_argument(
        "--plot-page-size",
        type=power_of_two,
        default=16,
        metavar="N",
        help="the page size of the --plot runs (default 16)",
    )
    o = p.add_argument_group("peer and output")
    o.add_argument(
        "--peer",
        choices=("none", "hf"),
        default="none",
        help="hf: transformers after ours (throughput, latency, ttft)",
    )
    o.add_argument(
        "--peer-num-blocks",
        type=positive_int,
        metavar="N",
        help="transformers CB cache blocks (default: its own sizing on CUDA; on CPU the tokens "
        "of our KV pool)",
    )
    o.add_argument(
        "--peer-max-batch-tokens",
        type=positive_int,
        metavar="N",
        help="transformers CB tokens per step (default: its own on CUDA, 512 on CPU)",
    )
    o.add_argument(
        "--json",
        metavar="PATH",
        help="also write the JSON line to PATH: a new file, or one that holds an earlier "
        "record (replaced); any other file is refused",
    )
    return p


def _page_sizes(text: str) -> tuple[int, ...]:
    """Parse "8,16,32" into (8, 16, 32): each a power of two, none twice."""
    sizes = tuple(power_of_two(part.strip()) for part in text.split(","))
    if len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"a page size appears twice in {text!r}")
    return sizes


def bench_main(argv: list[str]) -> int:
    if argv and argv[0] == SERVE:  # an HTTP client: none of the engine's flags apply
        from pagedllm.bench import serve_bench

        try:
            return serve_bench.main(argv[1:])
        except ValueError as e:  # --json refused after the run (its record is on stdout)
            return error(f"{PROG} serve", e)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        config = _check(parser, args, argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return int(e.code or 0)
    try:
        return _run(args, config, argv)
    except BrokenPipeError:
        raise  # an OSError, but the CLI's own exit (141), not a failed run
    except (ValueError, OSError) as e:  # a model that cannot be loaded or run
        return error(PROG, e)


# Flags a workload sets itself: giving them is a usage error, not a silent no-op.
SWEPT = {
    "prefix": {"prefix_caching": "prefix runs with prefix caching on, then off"},
    "pages": {
        "block_size": "pages runs every page size of --page-sizes",
        "admission": "pages runs both admission policies",
    },
}
ONLY_FOR = {  # flag dest -> the workload it belongs to
    "prefix_len": "prefix",
    "suffix_len": "prefix",
    "page_sizes": "pages",
    "plot": ("pages", "throughput"),
    "plot_page_size": "pages",
}


def _check(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]
) -> EngineConfig:
    """Options that are wrong together: usage errors (exit 2), before anything loads.

    Returns the engine settings the flags describe.
    """
    if args.workload == SERVE:  # options came before it: they would be the engine's
        parser.error(
            "serve is an HTTP client with options of its own: name it first, "
            "`pagedllm bench serve [options]` (see `pagedllm bench serve --help`)"
        )
    model_spec_from_args(parser, args)  # --model / --preset / --load-format contradictions
    if args.workload == "ttft" and args.output_len not in (None, 1):
        parser.error("ttft makes exactly one token; --output-len does not apply")
    given = _given(parser, argv)
    fixed = {"prompt_len", "output_len"} & given
    scaled = {"max_prompt_len", "max_output_len"} & given
    if args.workload == "throughput" and fixed and scaled:
        parser.error(
            "throughput: --prompt-len/--output-len fix every request's lengths; "
            "--max-prompt-len/--max-output-len scale the drawn ones: give one kind"
        )
    for dest, why in SWEPT.get(args.workload, {}).items():
        if dest in given:
            parser.error(f"{why}; drop --{dest.replace('_', '-')}")
    for dest, workload in ONLY_FOR.items():
        allowed = (workload,) if isinstance(workload, str) else workload
        if dest in given and args.workload not in allowed:
            parser.error(f"--{dest.replace('_', '-')} applies to {' and '.join(allowed)} only")
    if args.tensor_parallel_size > 1 and args.workload in SWEPT:
        parser.error(
            f"{args.workload} builds an engine per setting; with --tensor-parallel-size run "
            "throughput, latency or ttft"
        )
    if args.tensor_parallel_size > 1 and args.peer != "none":
        parser.error("--tensor-parallel-size: transformers runs on one device; add --peer none")
    if args.workload in SWEPT and args.peer != "none":
        parser.error(f"{args.workload} compares pagedllm with itself; --peer does not apply")
    if (  # pages writes one file there; throughput makes its directory
        args.plot
        and args.workload == "pages"
        and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot)))
    ):
        parser.error(f"--plot {args.plot}: no such directory")
    if args.json:
        from pagedllm.bench import report

        try:
            report.check_json_path(args.json)  # before the run: nothing is overwritten
        except ValueError as e:
            parser.error(str(e))
    if args.workload == "pages" and args.kv_cache_mib is None:
        args.kv_cache_mib = PAGES_KV_CACHE_MIB  # a tight pool is the point of the sweep
    return engine_config_from_args(args, parser)


def _given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the options written in `argv` (argparse's abbreviations included)."""
    options = parser._option_string_actions
    given = set()
    for token in argv:
        if token == "--":
            break
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        action = options.get(name)
        if action is None:  # an abbreviation: argparse took it, so it names one option
            matches = {a for s, a in options.items() if s.startswith(name)}
            action = matches.pop() if len(matches) == 1 else None
        if action is not None:
            given.add(action.dest)
    return given


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, config: EngineConfig, argv: list[str]) -> int:
    if args.plot:
        from pagedllm.bench import plot

        plot.require_matplotlib()  # before the load: a missing package costs no run
    threads = cpu_threads.apply_thread_policy(config.threads)  # before the load: it counts too
    import torch

    from pagedllm.bench import machine, ours

    # 1. Our model and the workload (ids folded into small vocabularies).
    spec = ModelSpec(config.model, args.preset, args.load_format)
    t0 = time.perf_counter()
    llm = None
    if config.tensor_parallel_size > 1:
        # Every rank loads its own slice, so the engine loads the model (rank 0's slice
        # is `model` below: its bytes per token over one GPU's bandwidth is the floor).
        source = None  # each engine built below loads it again, from `settings`
        settings = engine_kwargs(config.replace(**engine_model(spec)))
        llm = ours.build_llm(source, settings, _log)
        model = llm.engine.model
    else:
        model = source = load_model(
            spec, config.device, config.dtype, quantization=config.quantization
        )
        # The model is loaded: the engine gets it, not its path, device or dtype.
        settings = engine_kwargs(config, without=("model", "device", "dtype"))
    _log(f"loaded {spec.describe()} in {time.perf_counter() - t0:.1f} s on {model.device}")
    from pagedllm.model.loader import holds_fp8_weights

    vocab = model.config.vocab_size
    work, warmup = _workload(args, vocab), workloads.warmup_workload(vocab)
    context: dict[str, Any] = {
        "commit": machine.git_commit(),
        "device": machine.device_name(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        # a CPU GGUF's weights kept quantized (model/cpu_packed.py), FP8 projections
        # (a checkpoint's or --quantization fp8, on CUDA), else the dtype's
        "weights": "packed" if model.packed else "fp8" if holds_fp8_weights(model) else "dense",
        "threads": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "model": spec.describe(),
        "workload_description": work.description + ", greedy, EOS ignored",
        "command": "pagedllm bench " + " ".join(shlex.quote(a) for a in argv),
        "options": {k: v for k, v in vars(args).items() if v is not None},
    }
    if args.workload == "prefix":
        return _run_prefix(args, model, settings, work, warmup, context)
    if args.workload == "pages":
        return _run_pages(args, model, settings, work, warmup, context)
    if args.workload == "latency":
        _roofline(context, model, work, _kv_itemsize(settings, model))

    # 2. Ours.
    if llm is None:
        llm = ours.build_llm(source, settings, _log)
    kv_tokens = llm.engine.kv_spec.num_tokens
    _log(f"pagedllm: running {args.workload} ({work.description})")
    mine = _measure(ours, args, llm, work, warmup)
    _add_bandwidth(mine, context)
    _log(f"pagedllm: {_headline(args.workload, mine)}")
    if args.json and args.peer != "none":  # keep our figures even if the peer dies
        from pagedllm.bench import report

        partial = report.build_record(args.workload, mine, None, context)
        report.write_json(partial | {"peer_status": "not finished"}, args.json)
    llm.close()  # tensor-parallel workers, if any
    del llm  # frees our KV pages (and CUDA graphs) before the peer sizes its cache
    _free_memory(torch)
    if args.plot:  # throughput: the run's pictures, from an untimed run
        _plot_run(args, source, settings, work, context)
    if model.device.type == "cuda":
        _log(
            f"GPU memory held after freeing pagedllm: {torch.cuda.memory_allocated() / 2**30:.2f} GiB"
        )

    # 3. The peer, on the same weights.
    peer = None
    if args.peer == "hf":
        from pagedllm.bench import hf_peer

        t0 = time.perf_counter()
        hf = hf_peer.build_hf_model(model)
        del model
        _free_memory(torch)
        _log(
            f"transformers {hf_peer.transformers_version()}: built in {time.perf_counter() - t0:.1f} s"
        )
        cb_options = _peer_cb_options(args, hf.device, kv_tokens)
        peer = _measure(hf_peer, args, hf, work, warmup, cb_options)
        _add_bandwidth(peer, context)
        _log(f"transformers: {_headline(args.workload, peer)}")
        del hf
        _free_memory(torch)

    # 4. Table, then the JSON line.
    from pagedllm.bench import report

    record = report.build_record(args.workload, mine, peer, context)
    report.emit(record, report.format_table(args.workload, mine, peer, context), args.json)
    return 0


def _run_settings(model, settings: dict[str, Any], changes: dict[str, Any], work, warmup):
    """One throughput run of `work` on a fresh LLM with `changes` to the settings."""
    import torch

    from pagedllm.bench import ours

    what = ", ".join(f"{k}={v}" for k, v in changes.items())
    llm = ours.build_llm(model, settings | changes, _log)
    try:
        result = ours.run_throughput(llm, work, warmup)
    finally:
        del llm  # frees its KV pages before the next one is allocated
        _free_memory(torch)
    n = result.notes
    _log(
        f"pagedllm {what}: {_headline('throughput', result)}, prefix cache hit rate "
        f"{100 * n['prefix_cache_hit_rate']:.1f}%, {plural(n['admission_waits'], 'admission wait')}, "
        f"{plural(n['preemptions'], 'preemption')}, peak {n['pages_peak_used']} of "
        f"{plural(n['pages_total'], 'page')}"
    )
    return result


def _run_prefix(args, model, settings: dict[str, Any], work, warmup, context) -> int:
    """The shared-prefix workload with prefix caching on, then off; nothing else changes."""
    from pagedllm.bench import report

    _log(f"pagedllm: running prefix ({work.description})")
    runs = [
        (
            {"prefix_caching": on},
            _run_settings(model, settings, {"prefix_caching": on}, work, warmup),
        )
        for on in (True, False)
    ]
    on, off = runs[0][1], runs[1][1]
    share = workloads.reusable_prompt_share(work, args.prefix_len, settings["block_size"])
    context["reusable_share"] = share
    ratio = None if not off.tokens_per_s else on.tokens_per_s / off.tokens_per_s
    headline = {
        "prefix_cache_hit_rate": on.notes["prefix_cache_hit_rate"],
        "prefix_cache_reusable_share": round(share, 4),
        "ratio": None if ratio is None else round(ratio, 3),
        "ratio_of": "tokens_per_s prefix caching on/off",
    }
    record = report.build_runs_record("prefix", runs, context, headline)
    report.emit(record, report.format_prefix_table(on, off, context), args.json)
    return 0


def _run_pages(args, model, settings: dict[str, Any], work, warmup, context) -> int:
    """Every page size under both admission policies, in the same bytes of page pool."""
    from pagedllm.bench import report

    mib = settings["kv_cache_mib"]
    _check_pool_fits(model, mib, args.page_sizes, work, settings)
    context["kv_cache_mib"] = mib
    context["workload_description"] += f", page pool {mib:g} MiB"
    _log(f"pagedllm: running pages ({work.description}) in {mib:g} MiB of pages")
    runs = []
    for block_size in args.page_sizes:
        for admission in ADMISSION_POLICIES:
            setting = {"block_size": block_size, "admission": admission}
            runs.append((setting, _run_settings(model, settings, setting, work, warmup)))
    best_setting, best = max(runs, key=lambda sr: sr[1].tokens_per_s or 0.0)
    headline: dict[str, Any] = {
        "kv_cache_mib": mib,
        "page_sizes": list(args.page_sizes),
        "fastest": {**best_setting, "tokens_per_s": round(best.tokens_per_s, 4)},
        "plot": None,
    }
    if args.plot:
        _plot_pages(args, model, settings, work, warmup, context)
        headline |= {"plot": args.plot, "plot_page_size": args.plot_page_size}
        context["plot"] = args.plot
    record = report.build_runs_record("pages", runs, context, headline)
    report.emit(record, report.format_pages_table(runs, context), args.json)
    return 0


def _kv_itemsize(settings: dict[str, Any], model) -> int:
    """Bytes per cached K/V value: 1 with --kv-cache-dtype fp8, else the model's."""
    return 1 if settings.get("kv_cache_dtype") == "fp8" else model.dtype.itemsize


def _check_pool_fits(
    model, mib: float, page_sizes: tuple[int, ...], work, settings: dict[str, Any]
) -> None:
    """The reserve policy rejects a request whose pages exceed the pool: say so before running."""
    import math

    per_token = model.config.kv_bytes_per_token(_kv_itemsize(settings, model))
    longest = max(len(p) + m for p, m in zip(work.prompts, work.max_tokens))
    for bs in page_sizes:
        pages = int(mib * 2**20) // (per_token * bs)
        need = math.ceil((longest - 1) / bs)
        if pages < need:
            raise ValueError(
                f"--kv-cache-mib {mib:g} holds {plural(pages, 'page')} of {plural(bs, 'token')}, "
                f"but the longest request ({plural(longest, 'token')}) needs {need}: raise "
                "--kv-cache-mib, or shorten "
                "the requests (--max-prompt-len, --max-output-len)"
            )


def _plot_run(args, model, settings: dict[str, Any], work, context) -> None:
    """One more run of `work` on a fresh engine (a cold prefix cache, as measured),
    recorded step by step (untimed: recording costs host time), then drawn."""
    import torch

    from pagedllm.bench import ours
    from pagedllm.engine.timeline import StepRecorder
    from pagedllm.plots import plot_run

    llm = ours.build_llm(model, settings, _log)
    try:
        llm.engine.recorder = StepRecorder()
        ours._generate(llm, work, desc=f"pagedllm {args.workload} (untimed, for --plot)")
        pages = plural(llm.stats()["pages_total"], "page")
        title = f"{args.workload}: {plural(work.num_requests, 'request')}, {pages}"
        for path in plot_run(llm.engine.recorder, args.plot, title):
            _log(f"wrote {path}")
    finally:
        llm.close()
        del llm
        _free_memory(torch)
    context["plot"] = args.plot


def _plot_pages(args, model, settings: dict[str, Any], work, warmup, context) -> None:
    """Untimed runs at --plot-page-size that record the pages in use after every step."""
    import torch

    from pagedllm.bench import ours, plot

    traces: dict[str, list[int]] = {}
    for admission in ADMISSION_POLICIES:
        changes = {"block_size": args.plot_page_size, "admission": admission}
        llm = ours.build_llm(model, settings | changes, _log)
        try:
            traces[admission] = ours.trace_pages(llm, work, warmup)
            stats = llm.stats()
        finally:
            del llm
            _free_memory(torch)
    plot.plot_pages_in_use(
        args.plot,
        traces,
        block_size=args.plot_page_size,
        pages_total=stats["pages_total"],
        page_mib=stats["pages_total_mib"] / stats["pages_total"],
        title=f"pagedllm bench pages: {context['model']} on {context['device']}, "
        f"{context['workload_description']}",
    )
    _log(f"wrote {args.plot}")


def _workload(args: argparse.Namespace, vocab: int) -> workloads.Workload:
    n = args.num_requests or NUM_REQUESTS.get(args.workload)
    if args.workload == "throughput" and (args.prompt_len or args.output_len):
        # Fixed lengths: the shape of a serving benchmark's draw (docs/benchmarks.md).
        prompt_len, output_len = args.prompt_len or 512, args.output_len or 128
        return workloads.fixed_throughput(n, prompt_len, output_len, vocab)
    if args.workload == "throughput":
        return workloads.draw_throughput(n, args.max_prompt_len, args.max_output_len, vocab)
    if args.workload == "pages":
        prompt_len = args.max_prompt_len or PAGES_MAX_LEN
        return workloads.draw_throughput(n, prompt_len, args.max_output_len or PAGES_MAX_LEN, vocab)
    if args.workload == "prefix":
        output_len = args.output_len or workloads.PREFIX_OUTPUT_LEN
        return workloads.prefix_workload(n, args.prefix_len, args.suffix_len, output_len, vocab)
    prompt_len, output_len, _ = DEFAULTS[args.workload]
    prompt_len = args.prompt_len or prompt_len
    if args.workload == "latency":
        return workloads.latency_workload(prompt_len, args.output_len or output_len, vocab)
    return workloads.ttft_workload(prompt_len, vocab)


def _headline(workload: str, r) -> str:
    if workload == "ttft":
        return f"median time to first token {1e3 * r.ttft_s:.2f} ms"
    what = "decode tokens/s" if workload == "latency" else "output tokens/s"
    return f"{r.tokens_per_s:.1f} {what} ({r.seconds:.2f} s)"


def _runs(args: argparse.Namespace) -> int:
    return args.runs or DEFAULTS.get(args.workload, (0, 0, 1))[2]


def _measure(runner, args: argparse.Namespace, engine, work, warmup, cb_options=None):
    """The same call on either runner module (`ours` or `hf_peer`)."""
    if args.workload == "throughput":
        if cb_options is None:
            return runner.run_throughput(engine, work, warmup)
        return runner.run_throughput(engine, work, warmup, cb_options)
    if args.workload == "latency":
        return runner.run_latency(engine, work, warmup, _runs(args))
    return runner.run_ttft(engine, work, warmup, _runs(args))


def _roofline(context: dict[str, Any], model, work, kv_itemsize: int) -> None:
    """Batch-1 decode is bound by memory: bytes per token over the bandwidth is the floor."""
    from pagedllm.bench import machine

    bw, source = machine.memory_bandwidth_gbps(model.device)
    per_token = machine.decode_bytes_per_token(
        model, len(work.prompts[0]), work.max_tokens[0], kv_itemsize
    )
    context.update(
        bandwidth_gbps=round(bw, 1),
        bandwidth_source=source,
        bytes_per_token=int(per_token),
        floor_tokens_per_s=round(bw * 1e9 / per_token, 1),
    )


def _add_bandwidth(result, context: dict[str, Any]) -> None:
    if "bytes_per_token" in context and result.tpot_s:
        result.achieved_gbps = context["bytes_per_token"] / result.tpot_s / 1e9


def _peer_cb_options(args: argparse.Namespace, device, kv_tokens: int) -> dict[str, Any]:
    """transformers' continuous-batching cache: its own sizing on CUDA (as docs/gpu.md measured);
    on the CPU, as many tokens as our KV pool, and a modest step (its auto-sizing is for GPUs
    and takes minutes of warm-up on a CPU)."""
    opts: dict[str, Any] = {}
    page = 256  # transformers' default tokens per page
    if args.peer_num_blocks:
        opts["num_blocks"] = args.peer_num_blocks
    elif device.type == "cpu" or args.kv_cache_mib is not None:
        opts["num_blocks"] = max(1, -(-kv_tokens // page))
    if args.peer_max_batch_tokens:
        opts["max_batch_tokens"] = args.peer_max_batch_tokens
    elif device.type == "cpu":
        opts["max_batch_tokens"] = 512
    return opts


def _free_memory(torch) -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
