"""Per-kernel GPU time of one decode step (Llama-3.2-1B preset, dummy bf16 weights).

PYTHONPATH=src python3 scripts/profile_kernels.py [--batch 1]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.model import dummy_model
from pagedllm.presets import preset_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    cfg = ModelConfig.from_hf_dir(preset_dir("llama-3.2-1b"))
    model = dummy_model(cfg, "cuda", "bfloat16")
    llm = LLM(model=model, max_model_len=4096, max_num_seqs=max(8, args.batch), kv_cache_mib=8192)
    eng = llm.engine
    sp = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    for _ in range(args.batch):
        eng.add_request(list(range(100, 228)), sp)
    for _ in range(20):
        eng.step()
    graphs = eng.runner.graphs
    g = graphs.graphs[next(x for x in graphs.buckets if x >= args.batch)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    )


if __name__ == "__main__":
    main()
