"""The sampler alone: one call of `Sampler` on random logits, by batch size, at
temperature 1 (the exponential race), with top-p 0.9, and greedy, on the CPU
(and CUDA when there is one). The logits are a model's shape: Gaussian, with 40
ids per row raised by 8 to 14 (so that a nucleus holds tens of ids, not
thousands). Prints a table of the median time per call and a JSON line.

    PYTHONPATH=src python3 scripts/bench_sampler.py [--vocab 49152] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from pagedllm.sampling import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams


def time_call(fn, device: str, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    sampler = Sampler()
    rows = []
    for device in devices:
        for b in (int(x) for x in args.batches.split(",")):
            g = torch.Generator().manual_seed(b)
            logits = torch.randn(b, args.vocab, generator=g)
            head = torch.randint(0, args.vocab, (b, 40), generator=g)
            logits.scatter_add_(1, head, torch.rand(b, 40, generator=g) * 6 + 8)
            logits = logits.to(device)
            for name, kw in (
                ("temperature 1", dict(temperature=1.0)),
                ("top-p 0.9", dict(temperature=1.0, top_p=0.9)),
                ("greedy", dict(temperature=0.0)),
            ):
                params = [SamplingParams(**kw).resolved()] * b
                meta = SamplingMetadata.from_params(params, [[]] * b, [[0]] * b, args.vocab, device)
                call = lambda lg=logits, m=meta: sampler(lg, m)  # noqa: E731
                ms = 1e3 * time_call(call, device, args.repeats)
                rows.append({"device": device, "batch": b, "sampling": name, "ms": round(ms, 4)})
    print(f"{'device':<8}{'batch':>6}  {'sampling':<15}{'ms a call':>10}")
    for r in rows:
        print(f"{r['device']:<8}{r['batch']:>6}  {r['sampling']:<15}{r['ms']:>10.3f}")
    print(json.dumps({"bench": "sampler", "vocab": args.vocab, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
