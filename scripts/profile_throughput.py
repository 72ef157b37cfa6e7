"""Where the throughput workload's wall time goes, step by step (GPU machine).

Runs workload 1 (256 requests, docs/benchmarks.md) once on a preset with
random bf16 weights, as `pagedllm bench throughput` does, and records every
engine step: its wall time (from the end of one step's bookkeeping to the end
of the next's), how many requests it ran, their context and its prompt
tokens. Steps are grouped (steps with prompt tokens; all-decode steps by batch
size) and each group's time is set against its floor, summed step by step:

    prompt tokens: 2 x matmul params x tokens / 791 TFLOP/s (+ the decode rows)
    decode rows:   max(weight bytes / 4.28 TB/s, 2 x params x rows / 791 TFLOP/s)
                   + K/V bytes of every context / 4.28 TB/s

The last line also gives the whole run's floor (the sum) and, for comparison,
the floor with float8 K/V pages. Steps that took more than STALL_FACTOR times
their group's median are listed as stalls: one-off costs inside the run (a
kernel compiled mid-run, a full garbage-collector pass), not a steady rate.

    PYTHONPATH=src python3 scripts/profile_throughput.py --preset llama-3.1-8b \
        [--kv-cache-dtype fp8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.workloads import draw_throughput, warmup_workload
from pagedllm.presets import preset_dir

MATMUL_FLOPS = 791e12  # bf16 8192^3 matmul measured on the H200 (docs/gpu.md)
COPY_BYTES_PER_S = 4.28e12  # device-to-device copy, read + written
BUCKETS = [(192, 256), (128, 191), (64, 127), (32, 63), (16, 31), (1, 15)]
STALL_FACTOR = 4.0


class StepLog:
    """Duck-typed `LLMEngine.recorder`: one row per step, after its bookkeeping."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int, int, int]] = []

    def record(self, engine, plan) -> None:
        context = sum(plan.num_computed_tokens) + sum(plan.num_new_tokens)
        self.rows.append(
            (time.perf_counter(), len(plan.scheduled), context, plan.num_prefill_tokens)
        )


def model_sizes(cfg) -> tuple[float, float]:
    """(matmul parameters per token, LM head included; K/V values per token)."""
    e, d = cfg.hidden_size, cfg.head_dim
    attn = e * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    attn += cfg.num_attention_heads * d * e
    mlp = 3 * e * cfg.intermediate_size
    params = cfg.num_hidden_layers * (attn + mlp) + cfg.vocab_size * e
    kv_values = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * d
    return params, kv_values


def step_floor(params, kv_bytes, weight_bytes, rows, context, prompt_tokens) -> float:
    decode_rows = rows - (1 if prompt_tokens else 0)  # roughly: one row per sequence
    compute = 2 * params * (decode_rows + prompt_tokens) / MATMUL_FLOPS
    return max(weight_bytes / COPY_BYTES_PER_S, compute) + context * kv_bytes / COPY_BYTES_PER_S


def find_stalls(walls: dict[str, list[tuple[float, int]]]) -> list[tuple[float, int, str, float]]:
    """(wall, step index, group, the group's median) of every step that took more
    than STALL_FACTOR times its group's median, slowest first."""
    out = []
    for key, rows in walls.items():
        median = statistics.median(w for w, _ in rows)
        out += [(w, i, key, median) for w, i in rows if w > STALL_FACTOR * median]
    return sorted(out, reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--json", help="write the per-step rows here")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--scale", type=int, help="lengths scaled to <= N (cpu smoke tests)")
    args = ap.parse_args()
    llm = LLM(
        model=str(preset_dir(args.preset)),
        load_format="dummy",
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        kv_cache_dtype=args.kv_cache_dtype,
        log=lambda _m: None,
    )
    cfg = llm.engine.model.config
    params, kv_values = model_sizes(cfg)
    weight_bytes = 2 * params
    kv_item = 1 if args.kv_cache_dtype == "fp8" else 2

    def run(w):
        sp = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in w.max_tokens]
        sync()
        t0 = time.perf_counter()
        llm.generate(w.prompts, sp, use_tqdm=False)
        sync()
        return t0, time.perf_counter()

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    run(warmup_workload(cfg.vocab_size))
    log = StepLog()
    llm.engine.recorder = log
    work = draw_throughput(
        vocab_size=cfg.vocab_size, max_prompt_len=args.scale, max_output_len=args.scale
    )
    t0, t1 = run(work)
    out_tokens = sum(work.max_tokens)
    llm.engine.recorder = None

    groups: dict[str, list[float]] = {}
    floors = {8: 0.0, 16: 0.0}  # bits per K/V value -> the run's floor
    prev = t0
    per_step = []
    walls: dict[str, list[tuple[float, int]]] = {}  # group -> (wall, step index)
    for t, rows, context, prompt in log.rows:
        wall = t - prev
        prev = t
        floor = step_floor(params, kv_values * kv_item, weight_bytes, rows, context, prompt)
        for bits in floors:
            floors[bits] += step_floor(
                params, kv_values * bits / 8, weight_bytes, rows, context, prompt
            )
        if prompt:
            key = "steps with prompt tokens"
        else:
            lo, hi = next((lo, hi) for lo, hi in BUCKETS if lo <= rows <= hi)
            key = f"decode, batch {lo}-{hi}"
        g = groups.setdefault(key, [0, 0.0, 0.0])
        g[0] += 1
        g[1] += wall
        g[2] += floor
        per_step.append(
            dict(wall_ms=round(wall * 1e3, 3), rows=rows, context=context, prompt=prompt)
        )
        walls.setdefault(key, []).append((wall, len(per_step) - 1))
    total = t1 - t0
    print(
        f"== {args.preset}, K/V {args.kv_cache_dtype}: {total:.3f} s, {out_tokens / total:,.0f} tok/s"
    )
    print(f"{'steps':<28}{'n':>6}{'wall s':>9}{'ms/step':>9}{'floor s':>9}{'x floor':>9}")
    for key, (n, wall, floor) in groups.items():
        print(f"{key:<28}{n:>6}{wall:>9.3f}{1e3 * wall / n:>9.3f}{floor:>9.3f}{wall / floor:>9.2f}")
    print(
        f"whole run: {total:.3f} s against a floor of {floors[16]:.3f} s with bf16 K/V "
        f"({out_tokens / floors[16]:,.0f} tok/s), {floors[8]:.3f} s with float8 K/V "
        f"({out_tokens / floors[8]:,.0f} tok/s)"
    )
    stalls = find_stalls(walls)
    for wall, i, key, median in stalls:
        print(
            f"stall: step {i} ({key}) took {1e3 * wall:.1f} ms, its group's median {1e3 * median:.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(per_step, f)
    summary = {
        k: dict(steps=v[0], wall_s=round(v[1], 4), floor_s=round(v[2], 4))
        for k, v in groups.items()
    }
    print(
        json.dumps(
            dict(
                preset=args.preset,
                kv=args.kv_cache_dtype,
                seconds=round(total, 4),
                groups=summary,
                stalls=[dict(step=i, group=k, wall_s=round(w, 4)) for w, i, k, _ in stalls],
            )
        )
    )


if __name__ == "__main__":
    main()
