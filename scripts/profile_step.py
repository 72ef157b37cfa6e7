"""Where one engine step's GPU time goes, against its floor (GPU machine).

For a preset with random bf16 weights: one prefill step (8 prompts of 1,024
tokens = 8,192 tokens, the default step budget) and one decode step at batch
256 with a context of about 800 tokens (the throughput workload's middle).
Each kernel is put in a category (GEMM, attention, norm, RoPE, SwiGLU, KV
store, embedding, sampling/other) from its name; the table gives GPU µs per
step per category, then the step's wall time (CUDA events; decode with and
without CUDA graphs) and its floor:

    prefill floor = FLOPs / 791 TFLOP/s   (2 x params x tokens + attention)
    decode floor  = max(FLOPs / 791 TFLOP/s, bytes / 4.28 TB/s)
                    (weights once + every request's K/V read)

    PYTHONPATH=src python3 scripts/profile_step.py --preset llama-3.1-8b [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine_config import EngineConfig
from pagedllm.model_source import ModelSpec, load_model

MATMUL_FLOPS = 791e12  # bf16 8192^3 matmul measured on the H200 (docs/gpu.md)
COPY_BYTES_PER_S = 4.28e12  # device-to-device copy, read + written

CATEGORIES = [  # (category, substrings of kernel names), first match wins
    ("attention", ("_decode_kernel", "_decode_reduce", "_prefill_kernel", "attention")),
    ("norm", ("rms_norm",)),
    ("rope", ("rope",)),
    ("swiglu", ("silu",)),
    ("kv store", ("store_kvcache",)),
    ("sampling/other", ("argmax",)),
    ("embedding", ("_embedding",)),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90", "xmma", "cublas", "splitk", "matmul")),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "sampling/other"


def kernel_table(prof, steps: int) -> dict[str, float]:
    """GPU µs per step by category, from the profiler's CUDA kernels."""
    per_cat: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) is not None and "CUDA" not in str(evt.device_type):
            continue
        t = getattr(evt, "self_device_time_total", None)
        if t is None:
            t = getattr(evt, "self_cuda_time_total", 0.0)
        if t <= 0:
            continue
        per_cat[category(evt.key)] += t / steps
    return dict(per_cat)


def top_kernels(prof, steps: int, n: int = 12) -> list[tuple[str, float, int]]:
    rows = []
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((evt.key[:80], t / steps, evt.count // steps))
    return sorted(rows, key=lambda r: -r[1])[:n]


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(0, 10000) for _ in range(n)]


def param_counts(model) -> tuple[int, int]:
    """(parameters every token multiplies with, bytes of all weights read per step)."""
    per_token = 0
    for layer in model.layers:
        for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            per_token += lin.weight.numel()
    lm = model.lm_head.weight.numel()
    weight_bytes = (per_token + lm) * model.dtype.itemsize
    return per_token, lm, weight_bytes


def timed_steps(engine, n: int) -> float:
    """Mean wall ms of n engine steps (each ends with the sampled ids on the host)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def profiled_steps(engine, n: int):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
    return prof


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=768, help="decode: prompt tokens per request")
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--kv-cache-mib", type=float, default=40960)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--skip-decode", action="store_true", help="profile the prefill step only")
    ap.add_argument("--json")
    args = ap.parse_args()
    spec = ModelSpec(None, args.preset, "dummy")
    model = load_model(spec, "cuda", "bfloat16")
    cfg = model.config
    per_token, lm_params, weight_bytes = param_counts(model)
    kv_itemsize = 1 if args.kv_cache_dtype == "fp8" else model.dtype.itemsize
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.kv_size * kv_itemsize
    rng = random.Random(0)
    record: dict = {
        "preset": args.preset,
        "kv_cache_dtype": args.kv_cache_dtype,
        "device": torch.cuda.get_device_name(),
    }

    def engine_for(graphs: bool) -> LLMEngine:
        config = EngineConfig(
            device="cuda",
            dtype="bfloat16",
            kv_cache_mib=args.kv_cache_mib,
            kv_cache_dtype=args.kv_cache_dtype,
            max_num_seqs=args.batch,
            max_model_len=4096,
            admission="optimistic",  # pages for what is written, not for max_tokens
            cuda_graphs=graphs,
        )
        return LLMEngine(config, model, log=lambda s: None)

    # ---------------------------------------------------------------- prefill
    engine = engine_for(graphs=False)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    n_p, l_p = args.prefill_prompts, args.prefill_len
    for round_ in range(3):  # fresh prompts each round: nothing comes from the prefix cache
        for _ in range(n_p):
            engine.add_request(rand_prompt(rng, l_p), one)
        if round_ < 2:
            ms = timed_steps(engine, 1)
        else:
            prof = profiled_steps(engine, 1)
        assert not engine.has_unfinished(), "the prefill did not fit one step"
    tokens = n_p * l_p
    attn_flops = 4 * cfg.num_hidden_layers * cfg.q_size * n_p * l_p * (l_p + 1) / 2
    flops = 2 * per_token * tokens + 2 * lm_params * n_p + attn_flops
    prefill = {
        "tokens": tokens,
        "wall_ms": ms,
        "floor_ms": flops / MATMUL_FLOPS * 1e3,
        "tflops": flops / (ms / 1e3) / 1e12,
        "kernels_us": kernel_table(prof, 1),
        "top": top_kernels(prof, 1),
    }
    record["prefill"] = prefill
    del engine
    torch.cuda.empty_cache()

    # ---------------------------------------------------------------- decode
    parts = [("prefill", prefill)]
    if not args.skip_decode:
        long = SamplingParams(max_tokens=4096 - args.context - 1, temperature=0, ignore_eos=True)
        decode = {"batch": args.batch, "context": args.context}
        for graphs in (False, True):
            engine = engine_for(graphs)
            for _ in range(args.batch):
                engine.add_request(rand_prompt(rng, args.context), long)
            while engine.scheduler.waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
            ):
                engine.step()
            for _ in range(3):
                engine.step()  # warm-up at batch B
            key = "graphs" if graphs else "eager"
            decode[f"wall_ms_{key}"] = timed_steps(engine, 10)
            if not graphs:
                prof = profiled_steps(engine, 5)
                decode["kernels_us"] = kernel_table(prof, 5)
                decode["top"] = top_kernels(prof, 5)
            for req in list(engine.scheduler.running):
                engine.abort(req, report=False)
            del engine
            torch.cuda.empty_cache()
        b = args.batch
        ctx = args.context + 20  # the steps above add a few tokens
        flops = 2 * (per_token + lm_params) * b + 4 * cfg.num_hidden_layers * cfg.q_size * b * ctx
        bytes_ = weight_bytes + b * ctx * kv_bytes_per_token
        decode["floor_ms"] = max(flops / MATMUL_FLOPS, bytes_ / COPY_BYTES_PER_S) * 1e3
        decode["floor_compute_ms"] = flops / MATMUL_FLOPS * 1e3
        decode["floor_bytes_ms"] = bytes_ / COPY_BYTES_PER_S * 1e3
        record["decode"] = decode
        parts.append(("decode", decode))

    # ---------------------------------------------------------------- report
    print(f"== {args.preset} on {record['device']}")
    for name, part in parts:
        total = sum(part["kernels_us"].values())
        wall = part.get("wall_ms") or part.get("wall_ms_graphs")
        print(
            f"-- {name}: wall {wall:.2f} ms, kernels {total / 1e3:.2f} ms, floor "
            f"{part['floor_ms']:.2f} ms ({part['floor_ms'] / wall:.0%} of wall)"
        )
        if name == "decode":
            print(
                f"   eager {part['wall_ms_eager']:.2f} ms, graphs {part['wall_ms_graphs']:.2f} ms; "
                f"floor compute {part['floor_compute_ms']:.2f} ms, bytes "
                f"{part['floor_bytes_ms']:.2f} ms"
            )
        for cat, us in sorted(part["kernels_us"].items(), key=lambda kv: -kv[1]):
            print(f"   {cat:<16}{us / 1e3:>8.3f} ms {us / total:>6.1%}")
        for kname, us, count in part["top"]:
            print(f"     {us / 1e3:>8.3f} ms x{count:<4} {kname}")
    line = json.dumps(record)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
