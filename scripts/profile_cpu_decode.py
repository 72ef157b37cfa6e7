"""Where does a batch-1 CPU decode step's time go, against its floors? (CPU, no GPU needed.)

Loads the default model (SmolLM2-135M-Instruct, float32 on the CPU), prefills a
128-token prompt, then times decode steps and splits each into:

- the engine step (schedule, runner, sampling, update: everything);
- the model's forward + LM head, inside it;
- the projections (every `Linear`: QKV, O, gate/up, down, LM head), inside that;
- the rest of the forward (norms, RoPE, K/V store, attention, adds): op dispatch;

and prints the floors beside them: the weight bytes over the memory bandwidth
measured here (a large read-only reduction and a large copy), and the op count
of one step (aten ops recorded by torch.profiler, numpy's matmuls added) times
the measured cost of one tiny op.

    .venv/bin/python scripts/profile_cpu_decode.py [--threads 1] [--steps 64]
    /tmp/llamacpp-venv/bin/python scripts/profile_cpu_decode.py --llamacpp GGUF --threads 2

With --threads 2 a decode step runs torch on 1 thread and numpy's OpenBLAS on 2
(`cpu_threads.threads_for_step`). `--llamacpp GGUF`: llama.cpp's prefill time
and decode tokens/s of the same workload instead (128-token prompt, 512 greedy
tokens: `--prompt-len`, `--new-tokens`), under a venv with llama-cpp-python
(scripts/llamacpp_reference.py says how to make one). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter

import numpy as np


def llamacpp_decode(model: str, threads: int, prompt_len: int, new_tokens: int) -> dict:
    """llama.cpp's batch-1 figures for the same workload (run this script under
    the venv that has llama-cpp-python, with --llamacpp MODEL): prompt ids
    100..100+prompt_len, greedy, EOS never sampled (its logit masked)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=model,
        n_ctx=prompt_len + new_tokens + 8,
        n_batch=prompt_len + new_tokens + 8,  # llm.scores holds n_batch rows
        n_threads=threads,
        verbose=False,
    )
    eos = llm.token_eos()
    ids = list(range(100, 100 + prompt_len))
    t0 = time.perf_counter()
    llm.eval(ids)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        scores = llm.scores[llm.n_tokens - 1]
        scores[eos] = -np.inf
        llm.eval([int(np.argmax(scores))])
    decode = time.perf_counter() - t0
    return {
        "engine": "llama.cpp",
        "version": llama_cpp.__version__,
        "threads": threads,
        "load": os.getloadavg()[0],
        "prefill_ms": round(ttft * 1e3, 1),
        "decode_tok_s": round(new_tokens / decode, 1),
    }


def bandwidth_gbps(mib: int = 512, reps: int = 5) -> dict[str, float]:
    """Best of `reps`: a read-only pass (numpy dot with a ones vector: one read of
    each byte) and a copy (read + write) of `mib` MiB of float32."""
    n = mib * (1 << 20) // 4
    a = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    b = np.empty_like(a)
    rows = a.reshape(-1, 4096)
    ones = np.ones(4096, dtype=np.float32)
    best_read = best_copy = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        rows @ ones
        best_read = min(best_read, time.perf_counter() - t)
        t = time.perf_counter()
        np.copyto(b, a)
        best_copy = min(best_copy, time.perf_counter() - t)
    return {"read_gbps": a.nbytes / best_read / 1e9, "copy_gbps": 2 * a.nbytes / best_copy / 1e9}


def tiny_op_us(reps: int = 20000) -> float:
    """The cost of one tiny aten op (an add of two 8-element tensors), microseconds."""
    import torch

    x = torch.ones(8)
    with torch.inference_mode():
        for _ in range(1000):
            x + x
        t = time.perf_counter()
        for _ in range(reps):
            x + x
    return (time.perf_counter() - t) / reps * 1e6


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def memory_growth(dtype: str | None, llamacpp: str | None) -> dict:
    """The resident set (MiB) after the imports and after loading the default model
    with no K/V pool (`load_model`), against the GGUF file's size. With `llamacpp`
    (under its venv): llama.cpp's `Llama(model)` instead (its default context)."""
    from pathlib import Path

    if llamacpp:
        import llama_cpp

        before = rss_mb()
        llm = llama_cpp.Llama(llamacpp, n_ctx=2048, verbose=False)
        after = rss_mb()
        del llm
        path = Path(llamacpp)
    else:
        from pagedllm.model.loader import load_model, resolve_model_path

        before = rss_mb()
        model = load_model(None, "cpu", dtype)
        after = rss_mb()
        path = resolve_model_path(None)
        del model
    size = path.stat().st_size / 2**20
    return {
        "engine": "llama.cpp" if llamacpp else "pagedllm",
        "dtype": dtype,
        "file_mib": round(size, 1),
        "rss_before_mib": round(before, 1),
        "rss_after_mib": round(after, 1),
        "growth_mib": round(after - before, 1),
        "growth_over_file": round((after - before) / size, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument(
        "--dtype", default=None, help="float32: the dequantized path (default: packed weights)"
    )
    ap.add_argument(
        "--memory",
        action="store_true",
        help="only the resident set: after imports, then after loading the model",
    )
    ap.add_argument("--llamacpp", metavar="GGUF", help="time llama.cpp instead (its own venv)")
    ap.add_argument("--new-tokens", type=int, default=512, help="with --llamacpp")
    args = ap.parse_args()
    if args.memory:
        print(json.dumps(memory_growth(args.dtype, args.llamacpp)))
        return
    if args.llamacpp:
        row = llamacpp_decode(args.llamacpp, args.threads or 1, args.prompt_len, args.new_tokens)
        print(json.dumps(row))
        return

    import torch

    from pagedllm import LLM, SamplingParams, cpu_threads
    from pagedllm.cpu_threads import apply_thread_policy
    from pagedllm.model import cpu_blas, cpu_packed
    from pagedllm.model import linear as linear_mod

    threads = apply_thread_policy(args.threads)
    # The read bandwidth with as many OpenBLAS threads as a decode step gets.
    cpu_blas.numpy_matmul_ok()
    cpu_blas.set_blas_threads(threads)
    bw = bandwidth_gbps()
    op_us = tiny_op_us()
    llm = LLM(device="cpu", threads=threads, dtype=args.dtype)
    eng = llm.engine
    model = eng.runner.model
    weight_bytes = (
        sum(
            t.nbytes
            for layer in model.layers
            for t in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        )
        + model.lm_head.nbytes
    )
    norm_bytes = sum(layer.input_norm.nbytes + layer.post_norm.nbytes for layer in model.layers)

    sp = SamplingParams(max_tokens=args.steps * 3 + 64, temperature=0, ignore_eos=True)
    eng.add_request(list(range(100, 100 + args.prompt_len)), sp)
    eng.step()  # prefill
    for _ in range(8):
        eng.step()

    # Time the parts by wrapping them (a wrapper costs ~0.3 us a call: negligible).
    spent: Counter[str] = Counter()
    matrix_types = (linear_mod.Linear, cpu_packed.PackedLinear, cpu_packed.Fp16Table)
    originals = {cls: cls.__call__ for cls in matrix_types}

    def patch(make) -> None:
        for cls, call in originals.items():
            cls.__call__ = make(call)

    def unpatch() -> None:
        for cls, call in originals.items():
            cls.__call__ = call

    orig_forward = model.forward

    def timed(call):
        def timed_linear(self, *a, **k):
            t = time.perf_counter()
            out = call(self, *a, **k)
            spent["projections"] += time.perf_counter() - t
            return out

        return timed_linear

    def timed_forward(*a, **k):
        t = time.perf_counter()
        out = orig_forward(*a, **k)
        spent["forward"] += time.perf_counter() - t
        return out

    patch(timed)
    model.forward = timed_forward
    orig_logits = model.compute_logits

    def timed_logits(*a, **k):
        t = time.perf_counter()
        out = orig_logits(*a, **k)
        spent["lm_head"] += time.perf_counter() - t
        return out

    model.compute_logits = timed_logits
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    unpatch()
    model.forward, model.compute_logits = orig_forward, orig_logits
    per = {k: v / args.steps * 1e3 for k, v in spent.items()}

    # The op count of one step: aten ops under the profiler, numpy matmuls counted apart.
    matmuls = 0

    def counting(call):
        def counting_linear(self, *a, **k):
            nonlocal matmuls
            matmuls += 1
            return call(self, *a, **k)

        return counting_linear

    patch(counting)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        eng.step()
    unpatch()
    # Top-level ops only (an aten op's own children are part of its dispatch).
    events = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    top_ops = len(events)

    forward_ms = per["forward"] + per["lm_head"]
    projections_ms = per["projections"]
    other_forward_ms = forward_ms - projections_ms
    engine_ms = step_ms - forward_ms
    floor_ms = weight_bytes / (bw["read_gbps"] * 1e9) * 1e3
    row = {
        "threads": threads,
        "weights": "packed" if model.packed else "float32",
        "torch_openblas_threads_in_decode": list(cpu_threads.threads_for_step(not model.packed)),
        "nproc": os.cpu_count(),
        "load": os.getloadavg()[0],
        "read_gbps": round(bw["read_gbps"], 1),
        "copy_gbps": round(bw["copy_gbps"], 1),
        "weight_mb": round(weight_bytes / 1e6, 1),
        "norm_kb": round(norm_bytes / 1e3, 1),
        "bandwidth_floor_ms": round(floor_ms, 2),
        "tiny_op_us": round(op_us, 2),
        "aten_ops_per_step": top_ops,
        "matmuls_per_step": matmuls,
        "dispatch_floor_ms": round((top_ops + matmuls) * op_us / 1e3, 2),
        "step_ms": round(step_ms, 2),
        "engine_outside_forward_ms": round(engine_ms, 2),
        "forward_ms": round(forward_ms, 2),
        "projections_ms": round(projections_ms, 2),
        "projections_gbps": round(weight_bytes / (projections_ms / 1e3) / 1e9, 1),
        "other_forward_ms": round(other_forward_ms, 2),
    }
    print(f"CPU decode step, batch 1, {threads} thread(s), load {row['load']:.2f}:")
    for k, v in row.items():
        print(f"  {k:<28}{v}")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
