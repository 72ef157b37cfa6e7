"""Sweep the prefill attention kernel's tiles on the GPU (GPU machine).

For the Llama-3.2-1B (head_dim 64) and Llama-3.1-8B (head_dim 128) attention
shapes (32 query heads, 8 KV heads), q/k/v laid out as the model lays them
out (views of one fused q/k/v projection), it times `prefill_attention` for
each (BLOCK_M, BLOCK_N, num_warps, num_stages) in the grid, replayed from a
CUDA graph, at one prompt of 1,024 tokens (a lone prompt's time to first
token) and 8 prompts of 1,024 (a throughput prefill step). Prints per shape
the default tile and the five fastest, and checks each output against the
default tile's (max abs difference). Last line: one JSON object.

    PYTHONPATH=src python3 scripts/bench_prefill_attention.py [--head-dims 64 128]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import triton
import triton.testing

from pagedllm.ops.triton_attention import _prefill_config, prefill_attention

H, HKV = 32, 8
BF16_TFLOPS = 791.0


def case(num_seqs: int, q_len: int, head_dim: int):
    tokens = num_seqs * q_len
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(
        tokens, (H + 2 * HKV) * head_dim, device="cuda", dtype=torch.bfloat16, generator=g
    )
    q = qkv[:, : H * head_dim].view(tokens, H, head_dim)
    k = qkv[:, H * head_dim : (H + HKV) * head_dim].view(tokens, HKV, head_dim)
    v = qkv[:, (H + HKV) * head_dim :].view(tokens, HKV, head_dim)
    cu = torch.arange(0, tokens + 1, q_len, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((num_seqs,), q_len, dtype=torch.int32, device="cuda")
    return q, k, v, cu, seq_lens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--shapes", nargs="+", default=["1x1024", "8x1024"])
    args = ap.parse_args()
    grid = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)))
    results = []
    for head_dim in args.head_dims:
        default = _prefill_config(torch.bfloat16, head_dim)
        for shape in args.shapes:
            num_seqs, q_len = map(int, shape.split("x"))
            q, k, v, cu, seq_lens = case(num_seqs, q_len, head_dim)
            flops = num_seqs * 2 * q_len * q_len * head_dim * H
            want = prefill_attention(q, k, v, cu, seq_lens, head_dim**-0.5, max_q_len=q_len)
            rows = []
            for cfg in [default] + [c for c in grid if c != default]:
                fn = functools.partial(
                    prefill_attention,
                    q,
                    k,
                    v,
                    cu,
                    seq_lens,
                    head_dim**-0.5,
                    max_q_len=q_len,
                    config=cfg,
                )
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    us = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
                except Exception as e:  # out of shared memory or registers
                    print(f"  D={head_dim} {shape} {cfg}: {type(e).__name__}")
                    continue
                diff = (out.float() - want.float()).abs().max().item()
                rows.append((us, cfg, diff))
            rows.sort()
            base = next(r for r in rows if r[1] == default)
            print(
                f"== D={head_dim} {shape}: default {default} {base[0]:.2f} us "
                f"({flops / base[0] / 1e6:.0f} TFLOP/s)"
            )
            for us, cfg, diff in rows[:5]:
                print(
                    f"   {cfg}: {us:.2f} us ({flops / us / 1e6:.0f} TFLOP/s, "
                    f"{100 * us / base[0]:.0f} % of default), max diff {diff:.2e}"
                )
            results.append(
                dict(
                    head_dim=head_dim,
                    shape=shape,
                    default=default,
                    default_us=base[0],
                    best=[(cfg, us) for us, cfg, _ in rows[:5]],
                )
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
