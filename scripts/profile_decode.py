"""Where does a batch-1 decode step's time go? (GPU machine.)

Times, for the Llama-3.2-1B preset with dummy bf16 weights: the decode CUDA
graph replayed alone (GPU time per step), and a full engine step split into
its parts (schedule, execute, sample + sync, update, postprocess).

    PYTHONPATH=src python3 scripts/profile_decode.py [--batch 1] [--max-model-len 4096]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.model import dummy_model
from pagedllm.presets import preset_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=256)
    args = ap.parse_args()
    cfg = ModelConfig.from_hf_dir(preset_dir("llama-3.2-1b"))
    model = dummy_model(cfg, "cuda", "bfloat16")
    llm = LLM(
        model=model,
        max_model_len=args.max_model_len,
        max_num_seqs=max(8, args.batch),
        kv_cache_mib=8192,
    )
    eng = llm.engine
    prompts = [list(range(100, 228)) for _ in range(args.batch)]
    sp = SamplingParams(max_tokens=args.steps + 64, temperature=0, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, sp)
    eng.step()  # prefill
    for _ in range(16):
        eng.step()
    torch.cuda.synchronize()

    # 1. The graph alone.
    graphs = eng.runner.graphs
    bucket = next(x for x in graphs.buckets if x >= args.batch)
    g = graphs.graphs[bucket]
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    graph_ms = start.elapsed_time(end) / 100

    # 2. A full step, in parts.
    parts: dict[str, float] = defaultdict(float)
    sched, runner = eng.scheduler, eng.runner
    orig_schedule, orig_collect, orig_update = sched.schedule, runner.collect, sched.update

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            parts[name] += time.perf_counter() - t
            return r

        return wrapper

    sched.schedule = timed("schedule", orig_schedule)
    runner.collect = timed("collect (wait + copy)", orig_collect)
    sched.update = timed("update", orig_update)
    t0 = time.perf_counter()
    n = args.steps
    for _ in range(n):
        eng.step()
    torch.cuda.synchronize()
    total = (time.perf_counter() - t0) / n * 1e3
    rows = {k: v / n * 1e3 for k, v in parts.items()}
    rows["other (sample+sync+postprocess)"] = total - sum(rows.values())
    print(
        f"batch {args.batch}: graph replay alone {graph_ms:.3f} ms/step; full step {total:.3f} ms"
    )
    for k, v in rows.items():
        print(f"  {k:<34}{v:8.3f} ms")
    print(json.dumps({"batch": args.batch, "graph_ms": graph_ms, "step_ms": total, **rows}))


if __name__ == "__main__":
    main()
