"""Decode-step GEMMs (M = 64-256 rows): cuBLAS against a plain Triton tile GEMM (GPU).

A decode step at batch B multiplies B rows by every projection. At B = 256
and the 1B preset, q/k/v (N = 3,072), o_proj and down (N = 2,048) give cuBLAS
few output tiles: at 128 x 128 that is 2 x 16 = 32 CTAs for 132 SMs. This
measures, per projection shape and M, cuBLAS (`F.linear`) and a Triton GEMM
(`_mm` below: one (BLOCK_M, BLOCK_N) tile a program, K walked in BLOCK_K
steps, tensor-core dots) at every tile of a small grid, against the floor
max(bytes / 4.28 TB/s, FLOPs / 791 TFLOP/s), bytes = W + x + y once. Each
case is timed as the engine runs it: a CUDA graph of L calls over L copies of
W (more than L2 holds), time per call = graph time / L.

It answers whether a Triton GEMM for decode batches is worth building into
ops/; nothing in the engine uses `_mm`.

    PYTHONPATH=src python3 scripts/bench_skinny_gemm.py [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch
import triton
import triton.language as tl
from graph_timing import replay_us

from pagedllm.ops import triton_interpret_fix  # noqa: F401  (for a CPU check of _mm)

COPY, MMA = 4.28e12, 791e12
SHAPES = [  # name, N, K, the Ms to time
    ("1B qkv", 3072, 2048, (64, 256)),
    ("1B o_proj", 2048, 2048, (64, 256)),
    ("1B gate_up", 16384, 2048, (64, 256)),
    ("1B down", 2048, 8192, (64, 256)),
    ("8B qkv", 6144, 4096, (256,)),
    ("8B o_proj", 4096, 4096, (256,)),
    ("8B gate_up", 28672, 4096, (256,)),
    ("8B down", 4096, 14336, (256,)),
]
GRID = list(itertools.product((64, 128), (32, 64, 128), (64, 128), (3, 4)))  # BM, BN, BK, stages


@triton.jit
def _mm(x_ptr, w_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y (M, N) = x (M, K) @ w (N, K).T; K % BK == 0. The M tiles of one N tile are
    neighbours in the grid, so W's tile is read from memory once, then from L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    pm, pn = pid % tiles_m, pid // tiles_m
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    x = x_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
    w = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        a = tl.load(x, mask=(rm < M)[:, None], other=0.0)
        b = tl.load(w, mask=(rn < N)[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        x += BK
        w += BK
    y = y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def mm(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int, int]) -> torch.Tensor:
    bm, bn, bk, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _mm[grid](x, w, y, m, n, k, BM=bm, BN=bn, BK=bk, num_warps=4, num_stages=stages)
    return y


def in_graph_us(fn, weights: list[torch.Tensor]) -> float:
    us, _ = replay_us(lambda: [fn(w) for w in weights], 20)
    return us / len(weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    print(f"{'shape':<12}{'M':>5}{'floor us':>10}{'cuBLAS us':>11}{'Triton us':>11}  best tile")
    for name, n, k, ms in SHAPES:
        nbytes = n * k * 2
        copies = max(4, -(-400_000_000 // nbytes))  # > 400 MB in all: never in L2
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5]
        weights += [weights[0].clone() for _ in range(copies - 1)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = torch.nn.functional.linear(x, weights[0]).float()
            floor = max((nbytes + 2 * m * (k + n)) / COPY, 2 * m * n * k / MMA) * 1e6
            cublas = in_graph_us(partial(torch.nn.functional.linear, x), weights)
            timed = []
            for cfg in GRID:
                try:
                    t = in_graph_us(lambda w, cfg=cfg, x=x: mm(x, w, cfg), weights)
                except Exception as e:  # a tile that does not fit (shared memory)
                    print(f"  {cfg}: {type(e).__name__}")
                    continue
                timed.append((t, cfg))
            t, cfg = min(timed)
            err = ((mm(x, weights[0], cfg).float() - want).norm() / want.norm()).item()
            row = dict(shape=name, m=m, n=n, k=k, floor_us=round(floor, 2))
            row.update(cublas_us=round(cublas, 2), triton_us=round(t, 2), tile=list(cfg))
            row.update(rel_err=err, top3=[[round(a, 2), list(c)] for a, c in sorted(timed)[:3]])
            rows.append(row)
            print(f"{name:<12}{m:>5}{floor:>10.2f}{cublas:>11.2f}{t:>11.2f}  {cfg} err {err:.1e}")
        del weights
        torch.cuda.empty_cache()
    for m in (64, 256):
        mine = [r for r in rows if r["m"] == m and r["shape"].startswith("1B")]
        c, t = (
            sum(r["cublas_us"] for r in mine),
            sum(min(r["cublas_us"], r["triton_us"]) for r in mine),
        )
        print(f"1B layer at M={m}: cuBLAS {c:.1f} us, best of both {t:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    print(json.dumps({"skinny_gemm": rows}))


if __name__ == "__main__":
    main()
