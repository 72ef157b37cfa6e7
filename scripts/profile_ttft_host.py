"""Where a time-to-first-token run's wall time goes on the host (GPU machine).

Runs the TTFT workload's shape (one prompt of 1,024 tokens, max_tokens 1,
greedy; each run a new first id, so nothing comes from the prefix cache) on
a preset with random bf16 weights, with a timer around each host stage of
the step: `add_request`, `schedule`, the runner's `launch` (inside it:
`prepare`, the prefill graph's `run` and its `replay`, the sampler), `collect`
(which waits for the device) and the scheduler's `update`. Prints the median
and the fastest of each over the runs, and how long after `add_request`
began the graph replay began (the host time before the GPU starts).

The timers cost a few microseconds each, so the TTFT printed here sits a
little above `pagedllm bench ttft`'s.

    PYTHONPATH=src python3 scripts/profile_ttft_host.py [--preset llama-3.1-8b] [--runs 25]
    PYTHONPATH=src python3 scripts/profile_ttft_host.py --tiny   # CPU smoke test (transformers)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.workloads import random_prompt
from pagedllm.model_source import ModelSpec, load_model


def tiny_model() -> Any:
    """A random 2-layer model on the CPU, from the tests' helper."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from pagedllm.model import load_model as load_dir
    from tiny_models import make_tiny_llama_dir

    path, _ = make_tiny_llama_dir(Path(tempfile.mkdtemp()) / "m", max_position_embeddings=4096)
    return load_dir(path, device="cpu", dtype="float32")


class Timers:
    """(label, start, end) of every timed call, in the order they ended."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float, float]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.marks.append((label, t0, time.perf_counter()))

        setattr(owner, name, timed)

    def total_ms(self, label: str) -> float | None:
        spans = [(b - a) for name, a, b in self.marks if name == label]
        return 1e3 * sum(spans) if spans else None

    def first_start(self, label: str) -> float | None:
        return next((a for name, a, _ in self.marks if name == label), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=25)
    ap.add_argument("--tiny", action="store_true", help="a tiny random model on the CPU")
    ap.add_argument(
        "--bench-prompt",
        action="store_true",
        help="`bench ttft`'s random prompt (default: a fixed pattern)",
    )
    args = ap.parse_args()
    if args.tiny:
        model = tiny_model()
    else:
        model = load_model(ModelSpec(None, args.preset, "dummy"), "cuda", "bfloat16")
    cuda = model.device.type == "cuda"
    llm = LLM(model=model)
    eng, runner = llm.engine, llm.engine.runner
    timers = Timers()
    stages = [
        (eng, "add_request", "add_request"),
        (eng.scheduler, "schedule", "schedule"),
        (runner, "launch", "launch"),
        (runner, "prepare", "  prepare"),
        (runner, "sampler", "  sampler"),
        (runner, "collect", "collect (waits)"),
        (eng.scheduler, "update", "update"),
    ]
    if runner.prefill_graphs is not None:
        stages.append((runner.prefill_graphs, "run", "  prefill graph run"))
        stages += [(g, "replay", "    replay") for g in runner.prefill_graphs.graphs.values()]
    for owner, name, label in stages:
        timers.wrap(owner, name, label)

    vocab = model.config.vocab_size
    base = random_prompt(args.prompt_len, vocab)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows: list[dict[str, float]] = []
    for run in range(args.runs + 3):  # the first three warm up
        if args.bench_prompt:
            ids = [(base[0] + run + 1) % vocab, *base[1:]]  # as bench ttft moves it
        else:
            ids = [(run * 131 + 7) % vocab] + [
                (i * 7919) % vocab for i in range(1, args.prompt_len)
            ]
        if cuda:
            torch.cuda.synchronize()
        timers.marks.clear()
        out = llm.generate([ids], params, use_tqdm=False)[0]
        if run < 3:
            continue
        row = {label: timers.total_ms(label) for _, _, label in stages}
        added, replayed = timers.first_start("add_request"), timers.first_start("    replay")
        if added is not None and replayed is not None:
            row["add_request -> replay"] = 1e3 * (replayed - added)
        row["time to first token"] = 1e3 * out.time_to_first_token
        rows.append({k: v for k, v in row.items() if v is not None})

    where = f"{args.preset} on {torch.cuda.get_device_name()}" if cuda else "tiny model, CPU"
    print(f"== host stages of a {args.prompt_len}-token first step, {where}, {len(rows)} runs")
    print(f"{'stage':<26}{'median ms':>10}{'min ms':>10}")
    for label in rows[0]:
        values = [r[label] for r in rows if label in r]
        print(f"{label:<26}{statistics.median(values):>10.3f}{min(values):>10.3f}")


if __name__ == "__main__":
    main()
