"""Time each Triton kernel on the GPU at Llama-3.2-1B shapes, against the H200's ceilings.

Usage (on the GPU machine): PYTHONPATH=src python3 scripts/bench_kernels.py [--json-out PATH]

For every case it prints the median time of the kernel replayed from a CUDA
graph (what the GPU spends, launch overhead excluded; decode runs that way in
the engine) and of eager calls (`triton.testing.do_bench`, Python launch
included), the bytes it must move over the graph time (GB/s), and for prefill
the FLOP rate. Ceilings: 4.28 TB/s device copy (bytes read + written), 791
TFLOP/s bf16 matmul, both measured on the lent H200. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess

import torch
import triton
import triton.testing

from pagedllm.ops import triton_impl as tri

COPY_GBPS = 4280.0
BF16_TFLOPS = 791.0
DT = torch.bfloat16
H, HKV, D, BS = 32, 8, 64, 16  # Llama-3.2-1B attention
E, INTER = 2048, 8192
ELT = 2  # bytes per bf16


def _time_us(fn) -> tuple[float, float]:
    """(graph median us, eager median us)."""
    fn()  # compile
    torch.cuda.synchronize()
    eager = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    try:
        graph = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    except Exception:  # not capturable: report the eager time
        graph = eager
    return graph, eager


def _paged(batch: int, ctx: int, head_dim: int = D):
    pages = triton.cdiv(ctx, BS)
    k_cache = torch.randn(batch * pages, BS, HKV, head_dim, device="cuda", dtype=DT)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(batch * pages, device="cuda", dtype=torch.int32).view(
        batch, pages
    )
    return k_cache, v_cache, block_tables


def bench_decode(batch: int, ctx: int) -> dict:
    k_cache, v_cache, block_tables = _paged(batch, ctx)
    q = torch.randn(batch, H, D, device="cuda", dtype=DT)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    fn = lambda: tri.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, D**-0.5)
    graph, eager = _time_us(fn)
    nbytes = 2 * batch * ctx * HKV * D * ELT + 2 * q.numel() * ELT
    return dict(
        kernel="decode_attention",
        shape=f"B={batch} ctx={ctx}",
        graph_us=graph,
        eager_us=eager,
        gbps=nbytes / graph / 1e3,
    )


def bench_prefill(num_seqs: int, q_len: int) -> dict:
    tokens = num_seqs * q_len
    q = torch.randn(tokens, H, D, device="cuda", dtype=DT)
    k = torch.randn(tokens, HKV, D, device="cuda", dtype=DT)
    v = torch.randn_like(k)
    cu = torch.arange(0, tokens + 1, q_len, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((num_seqs,), q_len, dtype=torch.int32, device="cuda")
    fn = lambda: tri.prefill_attention(q, k, v, cu, seq_lens, D**-0.5, max_q_len=q_len)
    graph, eager = _time_us(fn)
    flops = num_seqs * 2 * q_len * q_len * D * H  # causal: half of 4 * L^2 * D per head
    nbytes = (2 * q.numel() + 2 * k.numel()) * ELT
    return dict(
        kernel="prefill_attention",
        shape=f"{num_seqs}x{q_len}",
        graph_us=graph,
        eager_us=eager,
        gbps=nbytes / graph / 1e3,
        tflops=flops / graph / 1e6,
    )


def bench_rows(tokens: int) -> list[dict]:
    x = torch.randn(tokens, E, device="cuda", dtype=DT)
    res = torch.randn_like(x)
    w = torch.randn(E, device="cuda", dtype=DT)
    qkv = torch.randn(tokens, (H + 2 * HKV) * D, device="cuda", dtype=DT)
    q = qkv[:, : H * D].view(tokens, H, D)
    k = qkv[:, H * D : (H + HKV) * D].view(tokens, HKV, D)
    v = qkv[:, (H + HKV) * D :].view(tokens, HKV, D)
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    cos_sin = torch.randn(4096, D, device="cuda", dtype=torch.float32)
    gate_up = torch.randn(tokens, 2 * INTER, device="cuda", dtype=DT)
    k_cache = torch.empty(triton.cdiv(tokens, BS), BS, HKV, D, device="cuda", dtype=DT)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(tokens, device="cuda")
    ids = torch.randint(0, 128256, (tokens,), device="cuda")
    table = torch.randn(128256, E, device="cuda", dtype=DT)
    cases = [
        ("rms_norm", lambda: tri.rms_norm(x, w, 1e-5), 2 * x.numel() * ELT),
        (
            "fused_add_rms_norm",
            lambda: tri.fused_add_rms_norm(x, res, w, 1e-5),
            4 * x.numel() * ELT,
        ),
        (
            "apply_rope",
            lambda: tri.apply_rope(q, k, positions, cos_sin),
            2 * (q.numel() + k.numel()) * ELT + tokens * D * 4,
        ),
        ("silu_and_mul", lambda: tri.silu_and_mul(gate_up), 3 * tokens * INTER * ELT),
        (
            "store_kvcache",
            lambda: tri.store_kvcache(k, v, k_cache, v_cache, slots),
            4 * k.numel() * ELT,
        ),
        ("embedding", lambda: tri.embedding(ids, table), 2 * tokens * E * ELT),
    ]
    rows = []
    for name, fn, nbytes in cases:
        graph, eager = _time_us(fn)
        rows.append(
            dict(
                kernel=name,
                shape=f"T={tokens}",
                graph_us=graph,
                eager_us=eager,
                gbps=nbytes / graph / 1e3,
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args()
    torch.manual_seed(0)

    results = [bench_decode(b, c) for b in (1, 64, 256) for c in (512, 2048)]
    results += [bench_prefill(1, 1024), bench_prefill(8, 512)]
    for tokens in (256, 4096):
        results += bench_rows(tokens)

    print(
        f"{'kernel':20s} {'shape':16s} {'graph us':>9s} {'eager us':>9s} "
        f"{'GB/s':>8s} {'% copy':>7s} {'TFLOP/s':>8s} {'% bf16':>7s}"
    )
    for r in results:
        tf = r.get("tflops")
        tf_cols = f"{tf:8.1f} {100 * tf / BF16_TFLOPS:6.1f}%" if tf else f"{'':8s} {'':7s}"
        print(
            f"{r['kernel']:20s} {r['shape']:16s} {r['graph_us']:9.1f} {r['eager_us']:9.1f} "
            f"{r['gbps']:8.0f} {100 * r['gbps'] / COPY_GBPS:6.1f}% {tf_cols}"
        )

    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip()
            or None
        )
    except OSError:
        commit = None
    line = json.dumps(
        dict(
            engine="pagedllm",
            bench="kernels",
            commit=commit,
            device=torch.cuda.get_device_name(),
            triton=triton.__version__,
            torch=torch.__version__,
            ceilings=dict(copy_gbps=COPY_GBPS, bf16_tflops=BF16_TFLOPS),
            results=[
                {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}
                for r in results
            ],
        )
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
