"""FP8 projections on the GPU: our FP8 GEMV / GEMM against bf16 and `torch._scaled_mm`.

For each projection of Llama-3.1-8B (q/k/v, o_proj, gate/up with SwiGLU after
it, down; `--model 70b` for Llama-3.1-70B's) and each row count T, times:

- `bf16`: what the bf16 engine runs (ops/triton_gemv.py: the GEMV at T = 1,
  cuBLAS otherwise; gate/up then SwiGLU, or SwiGLU in the GEMV's epilogue);
- `fp8`: `triton_fp8.fp8_linear` as dispatched (the weight-only GEMV at T <=
  `W8A16_MAX_ROWS`, the FP8 tensor-core GEMV for T <= 16, x's quantization
  kernel + `torch._scaled_mm` row-wise beyond);
- `tc_gemv`: the tensor-core GEMV (x quantized per chunk) at every T <= 16;
- `scaled_mm`: x's quantization + `torch._scaled_mm` at every T (at T <= 16 too,
  against the GEMV), then SwiGLU for gate/up (FP8 fast accumulation as
  `SCALED_MM_FAST_ACCUM` says); `smm_exact`: the same without fast
  accumulation (T > 16);
- `tri_gemm`: the Triton FP8 GEMM, per channel (T > 16);
- `blk`: 128 x 128 block scales as dispatched (the GEMV, or the Triton GEMM);
- `blk_smm`: torch's block-wise `scaled_mm` (1 x 128 x, 128 x 128 W; needs
  cuBLASLt 12.9+ on sm_90: "n/a" where it does not run).

Each is timed as the engine runs it: a CUDA graph of L calls over L copies of
the weight (more than L2 holds), time per call = graph time / L. The floor of
each row is max(W bytes / 4.8 TB/s, FLOPs / 1,979 TFLOP/s) for FP8 and
max(W bytes / 4.8 TB/s, FLOPs / 989 TFLOP/s) for bf16; `eff` is the FP8 floor
over `fp8`'s time. A last table adds the four projections up per T (one layer)
and times the layer count: the projections' share of a decode step or a
prefill. `rel` is the FP8 result's error against the float32 reference
(x not quantized): ~3 % is the activations' e4m3 rounding.

`--w8-sweep` times the weight-only GEMV (ops/triton_gemv.py reading float8 W)
over a grid of (BLOCK_N, BLOCK_K, warps) at T = 1 and prints the best per
shape as `W8A16_CONFIGS` entries; with `--e2e PRESET ...` it installs them
and runs `pagedllm bench latency --quantization fp8` in this process on each
preset (random weights), the tensor-core GEMV at one row (W8A16_MAX_ROWS = 0)
and the weight-only one, alternating (`--e2e-workloads ttft latency
throughput` for more than batch-1). `--load-configs PATH ...` takes the winners
from earlier runs' `--json` instead of sweeping (`--rows` with no value
then skips the kernel table). `--sweep` also times the GEMV over a grid of (BLOCK_N, BLOCK_K, warps, stages,
SPLIT_K) at T = 1 and 16 and prints the best per shape as `GEMV_CONFIGS`
entries for ops/triton_fp8.py; `--gemm-sweep` does the same for the Triton
GEMM's tiles at T = 1,024. `--act-quant` times SwiGLU and the down projection's
quantization of its output, as two kernels and fused (`act_and_mul_quantize`).

    PYTHONPATH=src python3 scripts/bench_fp8.py [--model 8b|70b] [--rows 1 4 16 64 1024]
        [--only down gate_up] [--sweep] [--w8-sweep [--e2e llama-3.1-8b]] [--gemm-sweep]
        [--json PATH]

The last line printed is one JSON object (the rows, the per-layer sums, the
sweeps' winners).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from functools import partial

import torch
from graph_timing import replay_us

from pagedllm.ops import reference as ref
from pagedllm.ops import triton_fp8 as tf
from pagedllm.ops import triton_gemv as gemv_bf16
from pagedllm.ops import triton_impl as tri
from pagedllm.ops.triton_act import silu_and_mul

HBM, FP8_MMA, BF16_MMA = 4.8e12, 1979e12, 989e12
MODELS = {  # name, N, K, act; layers
    "8b": (
        [
            ("qkv", 6144, 4096, False),
            ("o_proj", 4096, 4096, False),
            ("gate_up", 28672, 4096, True),
            ("down", 4096, 14336, False),
        ],
        32,
    ),
    "70b": (
        [
            ("qkv", 10240, 8192, False),
            ("o_proj", 8192, 8192, False),
            ("gate_up", 57344, 8192, True),
            ("down", 8192, 28672, False),
        ],
        80,
    ),
}
ROWS = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096)
METHODS = ("bf16", "fp8", "tc_gemv", "scaled_mm", "smm_exact", "tri_gemm", "blk", "blk_smm")


def copies_for(nbytes: int) -> int:
    return max(4, -(-400_000_000 // nbytes))  # > 400 MB in all: never in L2


def in_graph_us(fn, weights, replays: int = 10) -> float:
    us, _ = replay_us(lambda: [fn(*w) for w in weights], replays)
    return us / len(weights)


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.float(), expected.float()
    return ((out - expected).norm() / expected.norm()).item()


def bf16_call(x, w, act):
    return tri.linear_silu_and_mul(x, w) if act else tri.linear(x, w)


def fp8_call(x, w, s, act, block_size=None):
    if act:
        return tf.fp8_linear_act_and_mul(x, w, s, "silu", block_size=block_size)
    return tf.fp8_linear(x, w, s, block_size=block_size)


def scaled_mm_call(x, w, s, act, fast=None):
    y = tf.scaled_mm(x, w, s, use_fast_accum=fast)
    return silu_and_mul(y) if act else y


def tri_gemm_call(x, w, s, act, config=None):
    y = tf.gemm(x, w, s, config=config)
    return silu_and_mul(y) if act else y


def blk_smm_call(x, w, s, act):
    y = tf.scaled_mm_blockwise(x, w, s)
    return silu_and_mul(y) if act else y


def gemv_call(x, w, s, act, config):
    s = ref.check_fp8_weight(w, s, None)
    return tf.gemv(x, w, s, act="silu" if act else None, config=config)


def w8_call(x, w, s, act, config):
    return gemv_bf16.gemv(x, w, glu=bool(act), scale=s, config=config)


def time_or_none(fn, weights) -> float | None:
    try:
        return in_graph_us(fn, weights)
    except Exception as e:  # a path this torch or shape cannot take
        print(f"    ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
        return None


def measure(shapes, rows_list, layers) -> tuple[list[dict], dict]:
    rows = []
    head = f"{'shape':<9}{'T':>6}{'floor':>8}" + "".join(f"{m:>10}" for m in METHODS)
    print(head + f"{'eff':>6}{'x bf16':>7}{'rel':>8}   (us; eff = FP8 floor / fp8)")
    for name, n, k, act in shapes:
        w32 = torch.randn(n, k, device="cuda") * k**-0.5
        wb = w32.to(torch.bfloat16)
        wq, s = ref.quantize_fp8(w32)
        bq, bs = ref.quantize_fp8(w32, (128, 128))
        del w32
        fp8 = [(wq, s)] + [(wq.clone(), s.clone()) for _ in range(copies_for(wq.nbytes) - 1)]
        blk = [(bq, bs)] + [(bq.clone(), bs.clone()) for _ in range(copies_for(bq.nbytes) - 1)]
        bf16 = [(wb,)] + [(wb.clone(),) for _ in range(copies_for(wb.nbytes) - 1)]
        for t in rows_list:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            flops = 2 * t * n * k
            floor8 = max(n * k / HBM, flops / FP8_MMA) * 1e6
            floor16 = max(2 * n * k / HBM, flops / BF16_MMA) * 1e6
            us = {
                "bf16": time_or_none(partial(bf16_call, x, act=act), bf16),
                "fp8": time_or_none(partial(fp8_call, x, act=act), fp8),
                "tc_gemv": None,
                "scaled_mm": time_or_none(partial(scaled_mm_call, x, act=act), fp8),
                "smm_exact": None,
                "tri_gemm": None,
                "blk": time_or_none(partial(fp8_call, x, act=act, block_size=(128, 128)), blk),
                "blk_smm": None,
            }
            if t <= tf.GEMV_MAX_ROWS:
                us["tc_gemv"] = time_or_none(partial(gemv_call, x, act=act, config=None), fp8)
            if t > tf.GEMV_MAX_ROWS:
                us["smm_exact"] = time_or_none(partial(scaled_mm_call, x, act=act, fast=False), fp8)
                us["tri_gemm"] = time_or_none(partial(tri_gemm_call, x, act=act), fp8)
                us["blk_smm"] = time_or_none(partial(blk_smm_call, x, act=act), blk)
            want = (ref.linear_silu_and_mul if act else ref.linear)(
                x.float(), ref.dequantize_fp8(wq, s)
            )
            err = rel_err(fp8_call(x, wq, s, act), want)
            row = {
                "shape": name, "n": n, "k": k, "rows": t, "floor8_us": floor8,
                "floor16_us": floor16, "us": us, "rel_err": err,
            }  # fmt: skip
            rows.append(row)
            eff = floor8 / us["fp8"] if us["fp8"] else float("nan")
            vs = us["bf16"] / us["fp8"] if us["bf16"] and us["fp8"] else float("nan")
            cells = "".join(f"{us[m]:>10.1f}" if us[m] else f"{'n/a':>10}" for m in METHODS)
            print(f"{name:<9}{t:>6}{floor8:>8.1f}{cells}{eff:>6.2f}{vs:>7.2f}{err:>8.1e}")
        del fp8, blk, bf16
        torch.cuda.empty_cache()
    # One layer's projections per T, and the model's.
    per_t = {}
    print(f"\nall four projections, x {layers} layers, ms")
    print(f"{'T':>6}{'floor8':>8}{'floor16':>8}" + "".join(f"{m:>10}" for m in METHODS))
    for t in rows_list:
        mine = [r for r in rows if r["rows"] == t]
        if len(mine) != len(shapes):
            continue
        tot = {"floor8": sum(r["floor8_us"] for r in mine) * layers / 1e3}
        tot["floor16"] = sum(r["floor16_us"] for r in mine) * layers / 1e3
        for m in METHODS:
            vals = [r["us"][m] for r in mine]
            tot[m] = sum(vals) * layers / 1e3 if all(v is not None for v in vals) else None
        per_t[t] = tot
        cells = "".join(f"{tot[m]:>10.3f}" if tot[m] else f"{'n/a':>10}" for m in METHODS)
        print(f"{t:>6}{tot['floor8']:>8.3f}{tot['floor16']:>8.3f}{cells}")
    return rows, per_t


def gemv_grid(n: int, k: int, act: bool) -> list[tuple[int, int, int, int, int]]:
    rows = n // 2 if act else n
    grid = []
    for block_n, block_k, warps, stages in (
        (64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3),
        (128, 128, 8, 4), (128, 128, 4, 4),
    ):  # fmt: skip
        auto = tf.gemv_split(-(-rows // block_n), k, block_k, 132)
        for split in sorted({1, auto, 2 * auto}):
            grid.append((block_n, block_k, warps, stages, split))
    return grid


def fp8_copies(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A random (n, k) FP8 weight with per-channel scales, and enough copies of it
    to miss L2 (`copies_for`)."""
    wq, s = ref.quantize_fp8(torch.randn(n, k, device="cuda") * k**-0.5)
    return [(wq, s)] + [(wq.clone(), s.clone()) for _ in range(copies_for(wq.nbytes) - 1)]


def sweep_gemv(shapes) -> dict:
    best = {}
    print("\nGEMV sweep: us at T = 1 and 16 (the best of T = 1 first)")
    for name, n, k, act in shapes:
        fp8 = fp8_copies(n, k)
        x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        timed = []
        for cfg in gemv_grid(n, k, act):
            t1 = time_or_none(partial(gemv_call, x1, act=act, config=cfg), fp8)
            t16 = time_or_none(partial(gemv_call, x16, act=act, config=cfg), fp8)
            if t1 and t16:
                timed.append((t1, t16, cfg))
        timed.sort()
        for t1, t16, cfg in timed[:5]:
            gbps = n * k / t1 / 1e3
            print(f"  {name:<9}{str(cfg):<26}T=1 {t1:7.1f} us ({gbps:5.0f} GB/s)  T=16 {t16:7.1f}")
        t1, t16, cfg = timed[0]
        best[f"{n}x{k}"] = {"config": list(cfg), "t1_us": t1, "t16_us": t16}
        del fp8
        torch.cuda.empty_cache()
    print("GEMV_CONFIGS entries:", {tuple(map(int, key.split("x"))): tuple(v["config"])
                                   for key, v in best.items()})  # fmt: skip
    return best


def sweep_w8(shapes) -> dict:
    best = {}
    print("\nweight-only GEMV sweep: us at T = 1")
    for name, n, k, act in shapes:
        fp8 = fp8_copies(n, k)
        x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        timed = []
        grid = [tf.W8A16_CONFIGS.get((n, k), tf.W8A16_DEFAULT_CONFIG)]  # installed first
        for block_n in (2, 4, 8, 16):
            for block_k in (512, 1024, 2048):
                for warps in (4, 8):
                    if 16 * 32 * warps <= block_n * block_k <= 64 * 32 * warps:
                        grid.append((block_n, block_k, warps))  # 16-64 sums a thread
        for cfg in dict.fromkeys(tuple(c) for c in grid):
            t1 = time_or_none(partial(w8_call, x1, act=act, config=cfg), fp8)
            if t1:
                timed.append((t1, cfg))
        installed = dict((c, t) for t, c in timed).get(tuple(grid[0]))
        print(f"  {name:<9}installed {tuple(grid[0])}: {installed or 0:.1f} us")
        timed.sort()
        for t1, cfg in timed[:4]:
            print(f"  {name:<9}{str(cfg):<18}T=1 {t1:7.1f} us ({n * k / t1 / 1e3:5.0f} GB/s)")
        t1, cfg = timed[0]
        best[f"{n}x{k}"] = {"config": list(cfg), "t1_us": t1}
        del fp8
        torch.cuda.empty_cache()
    print("W8A16_CONFIGS entries:", {tuple(map(int, key.split("x"))): tuple(v["config"])
                                    for key, v in best.items()})  # fmt: skip
    return best


def e2e(presets: list[str], workloads: list[str], alternate: bool) -> list[dict]:
    """`pagedllm bench W --quantization fp8` per preset and workload, in this
    process (so with the configs installed here); with `alternate`, the
    weight-only GEMV off then on, twice."""
    from pagedllm.bench.cli import bench_main

    out = []
    tuned = tf.W8A16_MAX_ROWS
    for preset in presets:
        for w in workloads:
            for round_, rows in enumerate((0, tuned, 0, tuned) if alternate else (tuned,)):
                tf.W8A16_MAX_ROWS = rows
                path = f"/tmp/fp8_e2e_{preset}_{w}_{round_}.json"
                argv = [w, "--preset", preset, "--load-format", "dummy", "--device", "cuda"]
                argv += ["--dtype", "bfloat16", "--quantization", "fp8", "--peer", "none"]
                with contextlib.redirect_stdout(io.StringIO()):
                    rc = bench_main(argv + ["--json", path])
                r = json.load(open(path)) if rc == 0 else {}
                label = "weight-only" if rows else "tensor-core"
                print(
                    f"{preset:<14} {w:<11} {label:<12} tok/s {r.get('tokens_per_s') or 0:9.1f}"
                    f"  ttft {r.get('ttft_ms') or 0:7.2f} ms"
                )
                out.append({"preset": preset, "workload": w, "w8a16_max_rows": rows, **r})
                torch.cuda.empty_cache()
    tf.W8A16_MAX_ROWS = tuned
    return out


def bench_act_quant(model: str) -> dict:
    """act(gate) * up then the per-row quantization of the down projection's x: two
    kernels (`silu_and_mul`, `quantize_activations`) against the fused one, held
    whole in registers (one pass) or in two passes, us per call in a CUDA graph
    over inputs that miss L2."""
    inter = {"8b": 14336, "70b": 28672}[model]
    out = {}
    print(f"\nSwiGLU + per-row quantization, I = {inter}: us per call")
    for t in (256, 1024, 4096):
        ys = [(torch.randn(t, 2 * inter, device="cuda", dtype=torch.bfloat16),)
              for _ in range(copies_for(t * inter * 4))]  # fmt: skip
        want = tf.quantize_activations(silu_and_mul(ys[0][0]), None)
        r = {}
        for name, fn in (
            ("two kernels", lambda y: tf.quantize_activations(silu_and_mul(y), None)),
            ("fused, one pass", lambda y: tf.act_and_mul_quantize(y, "silu", one_pass=1 << 30)),
            ("fused, two passes", lambda y: tf.act_and_mul_quantize(y, "silu", one_pass=0)),
        ):
            got = fn(ys[0][0])
            same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
            same = same and torch.equal(got[1], want[1])
            r[name] = time_or_none(fn, ys)
            print(f"  T={t:<5} {name:<18} {r[name] or 0:8.1f} us  same bits: {same}")
        out[str(t)] = r
        del ys
        torch.cuda.empty_cache()
    return out


def sweep_gemm(shapes) -> dict:
    best = {}
    print("\nTriton GEMM sweep at T = 1,024: per channel, then 128 x 128 blocks")
    grid = [
        (128, 128, 8, 3, 8), (128, 128, 8, 4, 8), (128, 256, 8, 3, 8), (64, 128, 4, 3, 8),
        (64, 128, 4, 4, 8), (128, 64, 4, 4, 8), (64, 256, 8, 3, 8),
    ]  # fmt: skip
    for name, n, k, _act in shapes:
        x = torch.randn(1024, k, device="cuda", dtype=torch.bfloat16)
        w32 = torch.randn(n, k, device="cuda") * k**-0.5
        for mode, block in (("channel", None), ("block", (128, 128))):
            wq, s = ref.quantize_fp8(w32, block)
            s = ref.check_fp8_weight(wq, s, block)
            timed = []
            for cfg in grid:
                t = time_or_none(partial(tf.gemm, x, block_size=block, config=cfg), [(wq, s)])
                if t:
                    timed.append((t, cfg))
            timed.sort()
            t, cfg = timed[0]
            tflops = 2 * 1024 * n * k / t / 1e6
            print(f"  {name:<9}{mode:<8}{str(cfg):<24}{t:8.1f} us  {tflops:6.0f} TFLOP/s")
            best[f"{name} {mode}"] = {"config": list(cfg), "us": t, "tflops": tflops}
        del w32
        torch.cuda.empty_cache()
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="8b")
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    ap.add_argument("--only", nargs="*", default=[], help="shapes whose name has a word")
    ap.add_argument("--sweep", action="store_true", help="the GEMV's configs at T = 1, 16")
    ap.add_argument("--w8-sweep", action="store_true", help="the weight-only GEMV at T = 1")
    ap.add_argument("--e2e", nargs="*", default=[], help="presets: bench after --w8-sweep")
    ap.add_argument("--e2e-workloads", nargs="*", default=["latency"])
    ap.add_argument("--load-configs", nargs="*", help="take --w8-sweep's winners from these")
    ap.add_argument("--gemm-sweep", action="store_true", help="the GEMM's tiles at T = 1,024")
    ap.add_argument("--act-quant", action="store_true", help="SwiGLU + quantization, fused")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    shapes, layers = MODELS[args.model]
    shapes = [s for s in shapes if not args.only or any(w in s[0] for w in args.only)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, model {args.model}")
    rows, per_t = measure(shapes, args.rows, layers)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    record.update(model=args.model, rows=rows, per_layer_ms={str(t): v for t, v in per_t.items()})
    if args.load_configs:  # earlier runs' --json: their w8_sweep's winners
        record["w8_sweep"] = {}
        for path in args.load_configs:
            with open(path) as f:
                record["w8_sweep"].update(json.load(f)["w8_sweep"])
    elif args.w8_sweep:
        record["w8_sweep"] = sweep_w8(shapes)
    for key, v in record.get("w8_sweep", {}).items():
        tf.W8A16_CONFIGS[tuple(map(int, key.split("x")))] = tuple(v["config"])
    if args.e2e:
        record["e2e"] = e2e(args.e2e, args.e2e_workloads, alternate=not args.load_configs)
    if args.sweep:
        record["gemv_sweep"] = sweep_gemv(shapes)
    if args.gemm_sweep:
        record["gemm_sweep"] = sweep_gemm(shapes)
    if args.act_quant:
        record["act_quant"] = bench_act_quant(args.model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
