"""The M = 1 projections of the Llama presets: our Triton GEMV against cuBLAS (GPU).

For each weight shape of Llama-3.2-1B and Llama-3.1-8B (q/k/v, o_proj,
gate/up with SwiGLU in its epilogue, down): cuBLAS (`F.linear`, plus the
SwiGLU kernel after gate/up) against the GEMV at every (BLOCK_N, BLOCK_K,
num_warps) of a small grid, one x row. Each candidate is timed as the engine
runs it: a CUDA graph of L calls over L different copies of the weight (more
than L2 holds, as a decode step's next layer never is in L2), replayed; time
per call = graph time / L. GB/s counts the weight once; the floor is the 4.28
TB/s copy rate.

With `--e2e PRESET ...`, the best configs are then installed and `pagedllm
bench latency` runs in this process on each preset (random bf16 weights),
with the GEMV and without it (GEMV_MAX_ROWS = 0), alternating.

    PYTHONPATH=src python3 scripts/bench_gemv.py [--json PATH] [--quick] \
        [--only down gate_up] [--e2e llama-3.2-1b llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
from functools import partial

import torch
from graph_timing import replay_us

from pagedllm.ops import reference as ref
from pagedllm.ops import triton_gemv
from pagedllm.ops.triton_act import silu_and_mul

COPY = 4.28e12
SHAPES = [  # name, N, K, glu (SwiGLU in the epilogue)
    ("1B qkv", 3072, 2048, False),
    ("1B o_proj", 2048, 2048, False),
    ("1B gate_up+act", 16384, 2048, True),
    ("1B down", 2048, 8192, False),
    ("8B qkv", 6144, 4096, False),
    ("8B o_proj", 4096, 4096, False),
    ("8B gate_up+act", 28672, 4096, True),
    ("8B down", 4096, 14336, False),
]


def cublas_once(x: torch.Tensor, w: torch.Tensor, glu: bool) -> torch.Tensor:
    y = torch.nn.functional.linear(x, w)
    return silu_and_mul(y) if glu else y


def in_graph_us(fn, weights: list[torch.Tensor], replays: int = 20) -> float:
    """Per-call device time of fn(w) for each w in weights, captured in one CUDA graph."""
    us, _ = replay_us(lambda: [fn(w) for w in weights], replays)
    return us / len(weights)


def sweep(grid, only: list[str]) -> list[dict]:
    rows = []
    print(
        f"{'shape':<14}{'cuBLAS us':>10}{'GB/s':>7}{'GEMV us':>9}{'GB/s':>7}{'x':>6}"
        "  best (BLOCK_N, BLOCK_K, warps)  rel err"
    )
    for name, n, k, glu in SHAPES:
        if only and not any(word in name for word in only):
            continue
        nbytes = n * k * 2
        copies = max(4, -(-400_000_000 // nbytes))  # > 400 MB in all: never in L2
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5]
        weights += [torch.empty_like(weights[0]).copy_(weights[0]) for _ in range(copies - 1)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        want = ref.linear_silu_and_mul(x, weights[0]) if glu else ref.linear(x, weights[0])
        cublas = in_graph_us(partial(cublas_once, x, glu=glu), weights)
        timed = []
        for cfg in grid:
            if glu and cfg[0] % 2:
                continue  # two rows of W (gate, up) per output column
            try:
                t = in_graph_us(partial(gemv_once, x, glu=glu, config=cfg), weights)
            except Exception as e:  # a config Triton cannot compile (registers)
                print(f"  {cfg}: {type(e).__name__}")
                continue
            timed.append((t, cfg))
        t, cfg = min(timed)
        got = triton_gemv.gemv(x, weights[0], glu=glu, config=cfg)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        row = {
            "shape": name,
            "n": n,
            "k": k,
            "glu": glu,
            "cublas_us": cublas,
            "gemv_us": t,
            "config": list(cfg),
            "rel_err": err,
            "cublas_gbps": nbytes / cublas / 1e3,
            "gemv_gbps": nbytes / t / 1e3,
            "top5": [[round(tt, 2), list(c)] for tt, c in sorted(timed)[:5]],
        }
        rows.append(row)
        print(
            f"{name:<14}{cublas:>10.2f}{row['cublas_gbps']:>7.0f}{t:>9.2f}"
            f"{row['gemv_gbps']:>7.0f}{cublas / t:>6.2f}  {cfg}  {err:.1e}"
        )
        del weights
        torch.cuda.empty_cache()
    total_c = sum(r["cublas_us"] for r in rows)
    total_g = sum(r["gemv_us"] for r in rows)
    floor = sum(r["n"] * r["k"] * 2 for r in rows) / COPY * 1e6
    print(f"all shapes: cuBLAS {total_c:.1f} us, GEMV {total_g:.1f} us, floor {floor:.1f} us")
    return rows


def gemv_once(x, w, glu, config):
    return triton_gemv.gemv(x, w, glu=glu, config=config)


def e2e(presets: list[str]) -> list[dict]:
    """bench latency per preset, GEMV off then on (twice), in this process."""
    from pagedllm.bench.cli import bench_main

    out = []
    tuned = triton_gemv.GEMV_MAX_ROWS
    for preset in presets:
        for round_, rows in enumerate((0, tuned, 0, tuned)):
            triton_gemv.GEMV_MAX_ROWS = rows
            path = f"/tmp/gemv_e2e_{preset}_{round_}.json"
            argv = ["latency", "--preset", preset, "--load-format", "dummy", "--device", "cuda"]
            argv += ["--dtype", "bfloat16", "--peer", "none", "--json", path]
            with contextlib.redirect_stdout(io.StringIO()):
                rc = bench_main(argv)
            r = json.load(open(path)) if rc == 0 else {}
            label = "GEMV" if rows else "cuBLAS"
            print(f"{preset:<14} {label:<7} tok/s {r.get('tokens_per_s', float('nan')):8.1f}")
            out.append(
                {"preset": preset, "gemv": bool(rows), "tokens_per_s": r.get("tokens_per_s")}
            )
            torch.cuda.empty_cache()
    triton_gemv.GEMV_MAX_ROWS = tuned
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="a smaller config grid")
    ap.add_argument("--only", nargs="*", default=[], help="shapes whose name has a word")
    ap.add_argument("--e2e", nargs="*", default=[], metavar="PRESET")
    args = ap.parse_args()
    torch.manual_seed(0)
    grid = list(
        itertools.product(
            (2, 4) if args.quick else (1, 2, 4, 8),
            (1024, 2048) if args.quick else (512, 1024, 2048, 4096),
            (2, 4) if args.quick else (1, 2, 4, 8),
        )
    )
    rows = sweep(grid, args.only)
    record = {"device": torch.cuda.get_device_name(), "rows": rows}
    for r in rows:  # install the winners for the end-to-end runs
        triton_gemv.CONFIGS[(r["n"], r["k"])] = tuple(r["config"])
    record["configs"] = {f"{r['n']}x{r['k']}": r["config"] for r in rows}
    print("CONFIGS =", {(r["n"], r["k"]): tuple(r["config"]) for r in rows})
    record["e2e"] = e2e(args.e2e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f)
    print(
        json.dumps(
            {
                "gemv_us": sum(r["gemv_us"] for r in rows),
                "cublas_us": sum(r["cublas_us"] for r in rows),
            }
        )
    )


if __name__ == "__main__":
    main()
