"""Paged decode attention over bf16 pages against float8 (e4m3) pages (GPU).

For the attention shapes of Llama-3.2-1B (32 heads, 8 KV heads, D 64) and
Llama-3.1-8B (32, 8, D 128), at the throughput workload's middle (batch 256,
~790 tokens of context), a long context (batch 64, 2,048) and batch 1 (640):
the bf16 and the float8 cache, each with the engine's tile and at each
(BLOCK_N, num_warps, num_stages) of a small grid. Each case is timed as the
engine runs it: a CUDA graph of one call per layer, each layer with its own
pages, replayed; time per call = graph time / layers. GB/s counts the K and V
bytes of every context once (what a call must read); the ceiling is the
4.28 TB/s copy rate. A tile is (KV heads per program, BLOCK_N, num_warps,
num_stages); a tile that does not fit is skipped. --long leaves out the
batch-1 cases. --heads times only the engine's tile rule at 1, 2 and 4 KV
heads per program. --ragged gives the sequences of a case lengths spread
evenly over context +- 450 tokens (as the throughput workload's prompts of
100-1,024 tokens spread them) and each sequence its own run of pages, as the
engine's steps have them, instead of one length and pages shuffled over the
whole cache. --pages sets the placement apart from the lengths; --order sets
the ragged lengths' order: shuffled, desc (longest first), asc, or indirect
(shuffled, with the kernel's `order` input starting the longest first, as
the engine does).

    PYTHONPATH=src python3 scripts/bench_decode_attention.py [--quick | --heads] [--long]
        [--ragged] [--pages runs|shuffled] [--order shuffled|desc|asc|indirect] [--json PATH]

Prints a table per case and one JSON line last. With --fused, instead: a
decode step's RoPE + K/V store + attention as two kernels (rope_and_store,
decode_attention) against one (rope_store_decode_attention), bf16 and float8
pages, with PDL off and on (inside `ops.kernel_chain()`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random

import torch
from graph_timing import replay_us

from pagedllm import ops
from pagedllm.ops import reference as ref
from pagedllm.ops import triton_attention as ta
from pagedllm.ops import triton_rope

COPY = 4.28e12
BS = 16
SHAPES = [("1B", 32, 8, 64, 16), ("8B", 32, 8, 128, 32)]  # name, H, Hkv, D, layers
# batch, context, the max_seq_len passed (which sets the split count). The engine's
# decode graphs pass max_model_len: at batch 1 that gives 33 splits (last case).
CASES = [(256, 790, 790), (64, 2048, 2048), (1, 640, 640), (1, 640, 8192)]
FP8 = torch.float8_e4m3fn


def make_layers(batch, ctx, hkv, d, layers, runs=False):
    """Random bf16 pages for each layer, and one block table for all: shuffled,
    or with runs=True each sequence's pages in a run of its own."""
    pages = -(-ctx // BS)
    caches = []
    for _ in range(layers):
        k = torch.randn(batch * pages, BS, hkv, d, device="cuda", dtype=torch.bfloat16)
        caches.append((k, torch.randn_like(k)))
    order = torch.arange if runs else torch.randperm
    tables = order(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
    return caches, tables


def context_lengths(batch: int, ctx: int, ragged: bool, order: str = "shuffled") -> list[int]:
    """ctx for every sequence, or (ragged) lengths spread evenly over ctx +- 450,
    in a shuffled order (a batch's requests are not sorted by length), or
    longest first (order="desc") or shortest first ("asc")."""
    if not ragged or batch == 1:
        return [ctx] * batch
    lo, hi = max(1, ctx - 450), ctx + 450
    lens = [lo + (hi - lo) * i // (batch - 1) for i in range(batch)]
    random.Random(0).shuffle(lens)
    if order in ("desc", "asc"):
        lens.sort(reverse=order == "desc")
    return lens


def graph_us(fn, layers: int, replays: int = 10) -> float:
    """Per-call time of fn(i) for every layer i, all captured in one graph."""
    us, _ = replay_us(lambda: [fn(i) for i in range(layers)], replays)
    return us / layers


def tile_grid() -> dict[torch.dtype, list[tuple[int, int, int, int]]]:
    """The tiles swept per page dtype: (heads per program, BLOCK_N, warps, stages)."""
    prod = itertools.product
    bf16 = [*prod((1, 2, 4), (16, 32, 64), (4,), (3,)), *prod((2, 4), (32, 64), (2, 8), (3,))]
    fp8 = [*prod((1, 2, 4), (32, 64, 128), (2, 4), (5,)), *prod((4,), (32, 64), (4,), (3,))]
    return {torch.bfloat16: bf16, FP8: fp8}


def run_case(shape, batch, ctx, bound, grid, ragged=False, runs=None, order="shuffled"):
    """Rows for one case; runs (pages of a sequence in a run) defaults to ragged."""
    name, h, hkv, d, layers = shape
    q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16)
    lens = context_lengths(batch, ctx, ragged, order)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    bound = max(bound, max(lens))
    runs = ragged if runs is None else runs
    # "indirect": shuffled lengths, the kernel told to take them longest first
    by_len = torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
    extra = {"order": by_len} if order == "indirect" else {}
    bf16_caches, tables = make_layers(batch, max(lens), hkv, d, layers, runs)
    want = ta.decode_attention(q, *bf16_caches[0], tables, seq_lens, d**-0.5, max_seq_len=bound)
    rows = []
    for dtype in (torch.bfloat16, FP8):
        caches = [(k.to(dtype), v.to(dtype)) for k, v in bf16_caches]
        nbytes = 2 * sum(lens) * hkv * d * dtype.itemsize
        for cfg in [None, *grid.get(dtype, [])]:
            names = ("heads_per_program", "block_n", "num_warps", "num_stages")
            kw = {} if cfg is None else dict(zip(names, cfg))

            def fn(i, kw=kw, caches=caches):
                return ta.decode_attention(
                    q, *caches[i], tables, seq_lens, d**-0.5, max_seq_len=bound, **kw, **extra
                )

            try:
                us = graph_us(fn, layers)
                out = fn(0)
            except Exception as e:  # a tile that does not fit: skip it
                print(f"  {name} {dtype} {cfg}: {type(e).__name__}")
                continue
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            rows.append(
                dict(
                    shape=name,
                    batch=batch,
                    ctx=ctx,
                    bound=bound,
                    dtype=str(dtype).removeprefix("torch."),
                    config="default" if cfg is None else list(cfg),
                    us=round(us, 2),
                    gbps=round(nbytes / us / 1e3, 1),
                    err_vs_bf16=round(err, 4),
                )
            )
        del caches
    del bf16_caches
    torch.cuda.empty_cache()
    return rows


def run_fused(shape, batch, ctx, bound) -> list[dict]:
    """Two kernels against one for a decode step's RoPE, store and attention."""
    name, h, hkv, d, layers = shape
    qkv = torch.randn(batch, (h + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : h * d].view(batch, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(batch, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(batch, hkv, d)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    positions = (seq_lens - 1).long()
    caches, tables = make_layers(batch, ctx, hkv, d, layers)
    slots = tables[:, (ctx - 1) // BS].long() * BS + (ctx - 1) % BS
    cos_sin = ref.rope_cos_sin_cache(d, 500000.0, None, ctx + 1, device="cuda")
    rows = []
    for dtype in (torch.bfloat16, FP8):
        cs = [(kc.to(dtype), vc.to(dtype)) for kc, vc in caches]

        def two(i, cs=cs):
            q2, _ = triton_rope.rope_and_store(q, k, v, positions, cos_sin, *cs[i], slots)
            return ta.decode_attention(q2, *cs[i], tables, seq_lens, d**-0.5, max_seq_len=bound)

        def one(i, cs=cs):
            return ta.rope_store_decode_attention(
                q, k, v, positions, cos_sin, *cs[i], slots, tables, seq_lens, d**-0.5, bound
            )

        row = dict(shape=name, batch=batch, ctx=ctx, bound=bound, dtype=str(dtype)[6:])
        for pdl in (False, True):
            for label, fn in (("two", two), ("one", one)):

                def chained(i, fn=fn, pdl=pdl):
                    with ops.kernel_chain(pdl):
                        return fn(i)

                row[f"{label}_pdl{int(pdl)}_us"] = round(graph_us(chained, layers), 2)
        print(
            f"{name} B={batch:<4} ctx={ctx:<5} bound={bound:<5} {row['dtype']:<13} "
            f"two kernels {row['two_pdl0_us']:7.2f} us (PDL {row['two_pdl1_us']:7.2f}) | "
            f"one {row['one_pdl0_us']:7.2f} us (PDL {row['one_pdl1_us']:7.2f})"
        )
        rows.append(row)
        del cs
    del caches
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the default tiles only")
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--long", action="store_true", help="leave out the batch-1 cases")
    ap.add_argument("--heads", action="store_true", help="the tile rule at 1, 2, 4 heads only")
    ap.add_argument("--ragged", action="store_true", help="ragged lengths, pages in runs")
    ap.add_argument(
        "--pages", choices=("shuffled", "runs"), help="page placement (default: runs if --ragged)"
    )
    ap.add_argument(
        "--order",
        choices=("shuffled", "desc", "asc", "indirect"),
        default="shuffled",
        help="--ragged: the sequences' order by length",
    )
    ap.add_argument("--fused", action="store_true", help="two kernels against one (see above)")
    args = ap.parse_args()
    if args.fused:
        rows = [r for shape in SHAPES for case in CASES for r in run_fused(shape, *case)]
        print(json.dumps({"rope_store_decode_attention": rows}))
        return
    grid = {} if args.quick else tile_grid()
    if args.heads:
        grid = {dt: [(hp, None, None, None) for hp in (1, 2, 4)] for dt in (torch.bfloat16, FP8)}
    rows, summary = [], []
    for shape in SHAPES:
        for batch, ctx, bound in CASES:
            if args.long and batch == 1:
                continue
            runs = None if args.pages is None else args.pages == "runs"
            case = run_case(shape, batch, ctx, bound, grid, args.ragged, runs, args.order)
            best = {}
            for dt in ("bfloat16", "float8_e4m3fn"):
                mine = [r for r in case if r["dtype"] == dt]
                best[dt] = (
                    next(r for r in mine if r["config"] == "default"),
                    min(mine, key=lambda r: r["us"]),
                )
            (b_dflt, b_best), (f_dflt, f_best) = best["bfloat16"], best["float8_e4m3fn"]
            print(
                f"{shape[0]} B={batch:<4} ctx={ctx:<5} bound={bound:<5} bf16 {b_dflt['us']:7.2f} us "
                f"({b_dflt['gbps']:6.0f} GB/s), best {b_best['us']:7.2f} {b_best['config']} | "
                f"fp8 {f_dflt['us']:7.2f} us ({f_dflt['gbps']:6.0f} GB/s), best "
                f"{f_best['us']:7.2f} {f_best['config']} | fp8 err {f_dflt['err_vs_bf16']}"
            )
            summary.append(
                dict(
                    shape=shape[0],
                    batch=batch,
                    ctx=ctx,
                    bound=bound,
                    bf16_us=b_dflt["us"],
                    bf16_best_us=b_best["us"],
                    bf16_best=b_best["config"],
                    fp8_us=f_dflt["us"],
                    fp8_best_us=f_best["us"],
                    fp8_best=f_best["config"],
                )
            )
            rows += case
        # The one tile per dtype that serves every case of this shape best (sum of times).
        for dt in ("bfloat16", "float8_e4m3fn"):
            totals: dict[str, float] = {}
            for r in rows:
                if r["shape"] == shape[0] and r["dtype"] == dt:
                    totals[str(r["config"])] = totals.get(str(r["config"]), 0.0) + r["us"]
            ranked = sorted(totals.items(), key=lambda kv: kv[1])[:4]
            print(
                f"{shape[0]} {dt} tiles, summed over the cases: "
                + ", ".join(f"{c} {t:.1f} us" for c, t in ranked)
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(json.dumps({"decode_attention": summary}))


if __name__ == "__main__":
    main()
