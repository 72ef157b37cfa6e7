"""`pagedllm bench throughput | latency | ttft`: the standard workloads, in one command.

    pagedllm bench latency --peer hf                          # SmolLM2 on this CPU
    pagedllm bench throughput --preset llama-3.2-1b --load-format dummy --peer hf
    pagedllm bench throughput --num-requests 16 --max-prompt-len 128 --max-output-len 64

Order of a run: check the options -> set the CPU threads -> load our model ->
build the LLM -> warm-up request -> measure -> free our engine (its KV pages)
-> build the peer from the same weights -> warm-up -> measure -> print a
table, then one JSON line (last line of stdout). Logs go to stderr, so
`... | tail -1` is the JSON record. The workloads and how each figure is
measured: docs/benchmarks.md; the GPU protocol and vLLM's figures: docs/gpu.md.

Errors, as every `pagedllm` command (`pagedllm/cli.py`): a bad option is a usage
error (exit 2, argparse's message), found before anything is loaded; a run
that fails (a model that cannot be loaded) is one line
`pagedllm bench: error: MESSAGE`, exit 1.

Owns: options, their defaults and the order above. Does not own: timing
(`ours.py`, `hf_peer.py`) or formatting (`report.py`).
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import time
from typing import Any

# The CLI's argument types and its one-line error style (see pagedllm/cli.py).
from pagedllm import cpu_threads
from pagedllm.cli import (
    device_name,
    dtype_name,
    error,
    model_len,
    positive_float,
    positive_int,
    power_of_two,
)

PROG = "pagedllm bench"
WORKLOADS = ("throughput", "latency", "ttft")
DEFAULTS = {  # per workload: (prompt_len, output_len, runs); docs/gpu.md's shapes
    "latency": (128, 512, 1),
    "ttft": (1024, 1, 5),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Run one of the standard workloads (docs/benchmarks.md, docs/gpu.md); "
        "print a table and one JSON line.",
    )
    p.add_argument("workload", choices=WORKLOADS)
    m = p.add_argument_group("model")
    m.add_argument("--model", help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    m.add_argument(
        "--preset", help="a shipped config (e.g. llama-3.2-1b); needs --load-format dummy"
    )
    m.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default="auto",
        help="dummy: random weights of the config's shape, made on the device (no file)",
    )
    m.add_argument("--device", type=device_name, help="cpu or cuda (default: cuda when available)")
    m.add_argument(
        "--dtype",
        type=dtype_name,
        help="float32, bfloat16 or float16 (default: fp32 on CPU, bf16 on CUDA)",
    )
    e = p.add_argument_group("engine")
    e.add_argument(
        "--kv-cache-mib", type=positive_float, help="KV page pool size (K+V, all layers)"
    )
    e.add_argument("--batching", choices=("continuous", "static"), default="continuous")
    e.add_argument("--block-size", type=power_of_two, default=16)
    e.add_argument("--max-num-seqs", type=positive_int, default=256)
    e.add_argument("--max-num-batched-tokens", type=positive_int, default=16384)
    e.add_argument("--max-model-len", type=model_len)
    w = p.add_argument_group("workload")
    w.add_argument(
        "--num-requests", type=positive_int, default=256, help="throughput: requests (default 256)"
    )
    w.add_argument(
        "--max-prompt-len", type=positive_int, help="throughput: scale drawn prompt lengths to <= N"
    )
    w.add_argument(
        "--max-output-len", type=positive_int, help="throughput: scale drawn output lengths to <= N"
    )
    w.add_argument("--prompt-len", type=positive_int, help="latency: 128, ttft: 1024 by default")
    w.add_argument("--output-len", type=positive_int, help="latency: new tokens (default 512)")
    w.add_argument(
        "--runs", type=positive_int, help="measured runs after warm-up (latency 1, ttft 5)"
    )
    w.add_argument(
        "--threads",
        type=positive_int,
        help=f"torch CPU threads (default: {cpu_threads.POLICY_SUMMARY})",
    )
    o = p.add_argument_group("peer and output")
    o.add_argument(
        "--peer", choices=("none", "hf"), default="none", help="hf: transformers after ours"
    )
    o.add_argument(
        "--peer-num-blocks",
        type=positive_int,
        help="transformers CB cache blocks (default: its own sizing on CUDA; on CPU the tokens "
        "of our KV pool)",
    )
    o.add_argument(
        "--peer-max-batch-tokens",
        type=positive_int,
        help="transformers CB tokens per step (default: its own on CUDA, 512 on CPU)",
    )
    o.add_argument("--json", metavar="PATH", help="also write the JSON line to PATH")
    return p


def bench_main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        _check(parser, args)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return int(e.code or 0)
    try:
        return _run(args, argv)
    except BrokenPipeError:
        raise  # an OSError, but the CLI's own exit (141), not a failed run
    except (ValueError, OSError) as e:  # a model that cannot be loaded or run
        return error(PROG, e)


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options that are wrong together: usage errors (exit 2), before anything loads."""
    if args.preset and args.model:
        parser.error("give --model or --preset, not both")
    if args.preset and args.load_format != "dummy":
        parser.error(f"preset {args.preset!r} ships a config, not weights: add --load-format dummy")
    if args.workload == "ttft" and args.output_len not in (None, 1):
        parser.error("ttft makes exactly one token; --output-len does not apply")


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    threads = cpu_threads.apply_thread_policy(args.threads)  # before the load: it counts too
    import torch

    from pagedllm.bench import machine, ours, workloads

    # 1. Our model and the workload (ids folded into small vocabularies).
    spec = ours.ModelSpec(args.model, args.preset, args.load_format)
    t0 = time.perf_counter()
    model = ours.load_model(spec, args.device, args.dtype)
    _log(f"loaded {spec.describe()} in {time.perf_counter() - t0:.1f} s on {model.device}")
    vocab = model.config.vocab_size
    work, warmup = _workload(args, vocab), workloads.warmup_workload(vocab)
    context: dict[str, Any] = {
        "commit": machine.git_commit(),
        "device": machine.device_name(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "threads": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "model": spec.describe(),
        "workload_description": work.description + ", greedy, EOS ignored",
        "command": "pagedllm bench " + " ".join(shlex.quote(a) for a in argv),
        "options": {k: v for k, v in vars(args).items() if v is not None},
    }
    if args.workload == "latency":
        _roofline(context, model, work)

    # 2. Ours.
    engine_kwargs = dict(
        kv_cache_mib=args.kv_cache_mib,
        block_size=args.block_size,
        batching=args.batching,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    llm = ours.build_llm(model, engine_kwargs, _log)
    kv_tokens = llm.engine.kv_spec.num_tokens
    _log(f"pagedllm: running {args.workload} ({work.description})")
    mine = _measure(ours, args, llm, work, warmup)
    _add_bandwidth(mine, context)
    _log(f"pagedllm: {_headline(args.workload, mine)}")
    if args.json and args.peer != "none":  # keep our figures even if the peer dies
        from pagedllm.bench import report

        partial = report.build_record(args.workload, mine, None, context)
        report.write_json(partial | {"peer_status": "not finished"}, args.json)
    del llm  # frees our KV pages (and CUDA graphs) before the peer sizes its cache
    _free_memory(torch)
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


def _workload(args: argparse.Namespace, vocab: int):
    from pagedllm.bench import workloads

    if args.workload == "throughput":
        return workloads.draw_throughput(
            args.num_requests, args.max_prompt_len, args.max_output_len, vocab
        )
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


def _roofline(context: dict[str, Any], model, work) -> None:
    """Batch-1 decode is bound by memory: bytes per token over the bandwidth is the floor."""
    from pagedllm.bench import machine

    bw, source = machine.memory_bandwidth_gbps(model.device)
    per_token = machine.decode_bytes_per_token(model, len(work.prompts[0]), work.max_tokens[0])
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
