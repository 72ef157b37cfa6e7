"""Run the workloads on pagedllm through its public API (`LLM.generate`).

Owns: building the `LLM` the benchmark asks for (a model path, or a config
with random weights made on the device) and timing each workload the same
way the peer is timed. Does not own: the workloads' contents (`workloads.py`)
or the peer (`hf_peer.py`).

Every request is greedy with EOS ignored, so each makes exactly its
`max_tokens`; a run that does not is an error, never a figure.

While a measured run goes, a bar of its output tokens is drawn on stderr when
stderr is a terminal (`make bench`); in a log file (the GPU scripts) there is
none, and the engine is not touched: the figures of record are taken so.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

import pagedllm
from pagedllm import LLM, SamplingParams
from pagedllm.bench.result import BenchResult
from pagedllm.bench.workloads import Workload
from pagedllm.model import LlamaModel

ENGINE = "pagedllm"


def build_llm(
    model: LlamaModel | None, engine_kwargs: dict[str, Any], log: Callable[[str], None]
) -> LLM:
    """An LLM on `model`, or (None: tensor parallelism, every rank loads its own
    slice) on what `engine_kwargs` names (model path, load_format, device, dtype)."""
    if model is None:
        return LLM(log=log, **engine_kwargs)
    return LLM(model=model, log=log, **engine_kwargs)


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _sync(llm: LLM) -> None:
    if llm.engine.model.device.type == "cuda":
        torch.cuda.synchronize(llm.engine.model.device)


@contextmanager
def progress(llm: LLM, w: Workload, desc: str | None) -> Iterator[None]:
    """A bar of `w`'s output tokens on stderr while the block runs, when stderr is a
    terminal. Counted after each engine step (the engine's `step` is wrapped for the
    block: ~1 us a step); `LLM.generate`'s own bar counts finished requests, which
    says nothing for a batch-1 run. Elsewhere, or with no `desc`, nothing is done."""
    if desc is None or not sys.stderr.isatty():
        yield
        return
    from tqdm import tqdm

    engine = llm.engine
    own = vars(engine).get("step")  # an instance attribute already there, if any
    step = engine.step
    bar = tqdm(total=w.output_tokens, desc=desc, unit="tok", leave=False, file=sys.stderr)

    def counted():
        outs = step()
        bar.update(sum(len(o.new_token_ids) for o in outs))
        return outs

    engine.step = counted
    try:
        yield
    finally:
        if own is None:
            del engine.step  # the class's method again
        else:
            engine.step = own
        bar.close()


def _generate(
    llm: LLM,
    w: Workload,
    on_step: Callable[[Any], None] | None = None,
    desc: str | None = None,
) -> tuple[list[Any], float]:
    """Run a workload once; return the outputs and the wall seconds of the whole call.

    `desc`: the label of its progress bar (`progress`), None for none."""
    params = [_params(m) for m in w.max_tokens]
    _sync(llm)
    with progress(llm, w, desc):
        t0 = time.perf_counter()
        outs = llm.generate(w.prompts, params, use_tqdm=False, on_step=on_step)
        _sync(llm)
        wall = time.perf_counter() - t0
    for i, (o, m) in enumerate(zip(outs, w.max_tokens)):
        if len(o.token_ids) != m:
            raise RuntimeError(
                f"{w.name} request {i} made {len(o.token_ids)} tokens, not {m} "
                f"(finish_reason={o.finish_reason}, error={getattr(o, 'error', None)})"
            )
    return outs, wall


class _StepCounter:
    """Host time and steps of the runner between two points (the engine keeps totals)."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self.t0, self.n0 = self.runner.host_time_s, self.runner.num_steps
        self.engine = llm.engine
        self.d0 = getattr(llm.engine, "num_decode_steps", 0)

    def host_ms_per_step(self) -> float | None:
        steps = self.runner.num_steps - self.n0
        return None if steps == 0 else 1e3 * (self.runner.host_time_s - self.t0) / steps

    def steps(self) -> tuple[int, int]:
        return self.runner.num_steps - self.n0, getattr(
            self.engine, "num_decode_steps", 0
        ) - self.d0


def _result(**kw: Any) -> BenchResult:
    return BenchResult(engine=ENGINE, version=pagedllm.__version__, **kw)


# Engine counters (llm.stats(), totals since the LLM was built) whose change over
# the measured call is reported: the warm-up's share is left out.
_COUNTERS = (
    "admission_waits",
    "preemptions",
    "prefill_tokens",
    "prefix_cache_hit_tokens",
    "prefix_cache_query_tokens",
)


def run_throughput(llm: LLM, w: Workload, warmup: Workload) -> BenchResult:
    """Workload 1: all requests at once; throughput = sum(max_tokens) / wall (prefill included).

    Also how `prefix` and `pages` time each of their runs.
    """
    _generate(llm, warmup)
    counter = _StepCounter(llm)
    before = llm.stats()
    outs, wall = _generate(llm, w, desc=f"pagedllm {w.name}")
    steps, decode_steps = counter.steps()
    # Top level: the engine's totals since it was built (peaks include the warm-up,
    # which is smaller); "last_call": the measured call alone.
    stats = llm.stats()
    delta = {k: stats[k] - before[k] for k in _COUNTERS}
    call = stats["last_call"]
    ttfts = [o.time_to_first_token for o in outs if o.time_to_first_token is not None]
    tpots = [o.time_per_output_token for o in outs if o.time_per_output_token is not None]
    hit, query = delta["prefix_cache_hit_tokens"], delta["prefix_cache_query_tokens"]
    return _result(
        requests=w.num_requests,
        output_tokens=w.output_tokens,
        seconds=wall,
        tokens_per_s=w.output_tokens / wall,
        total_tokens_per_s=(w.prompt_tokens + w.output_tokens) / wall,
        ttft_s=statistics.median(ttfts) if ttfts else None,
        tpot_s=statistics.median(tpots) if tpots else None,
        host_time_per_step_ms=counter.host_ms_per_step(),
        notes={
            "prompt_tokens": w.prompt_tokens,
            "steps": steps,
            "decode_steps": decode_steps,
            "peak_active_requests": stats.get("peak_active_requests"),
            "max_decode_batch": stats.get("max_decode_batch"),
            **delta,  # admission waits, preemptions, prefill and prefix-cache tokens
            "prefix_cache_hit_rate": round(hit / query, 4) if query else 0.0,
            "rejected": call["rejected"],
            "engine_wall_time_s": call["wall_time_s"],
            "pages_total": stats.get("pages_total"),
            "pages_peak_used": stats.get("pages_peak_used"),
            "pages_total_mib": stats.get("pages_total_mib"),
            "pages_peak_used_mib": stats.get("pages_peak_used_mib"),
            "block_size": stats.get("block_size"),
            "ttft_is": "median over requests, from submission",
        },
    )


def trace_pages(llm: LLM, w: Workload, warmup: Workload) -> list[int]:
    """Pages in use after each step of one run of `w` (for `bench pages --plot`).

    Not a timed run: `on_step` turns on streaming (text decoded every step).
    Scheduling does not depend on timing, so the steps are those of a timed run.
    """
    _generate(llm, warmup)
    used: list[int] = []

    def on_step(_outputs: Any) -> None:
        used.append(llm.engine.block_manager.num_used_blocks)

    _generate(llm, w, on_step)
    return used


def _uncached(llm: LLM, w: Workload, run: int) -> Workload:
    """`w` with its first id moved by run + 1: the same work, but none of it is in the
    prefix cache from an earlier run (a page's hash chains over every id before it),
    so each repeated run prefills its whole prompt, as the first did."""
    prompt = w.prompts[0]
    first = (prompt[0] + run + 1) % llm.engine.model.config.vocab_size
    return replace(w, prompts=[[first, *prompt[1:]]])


def run_latency(llm: LLM, w: Workload, warmup: Workload, runs: int) -> BenchResult:
    """Workload 2: one request; decode tokens/s = 1 / time per output token (median run)."""
    _generate(llm, warmup)
    counter = _StepCounter(llm)
    samples = []
    for run in range(runs):
        desc = f"pagedllm latency, run {run + 1} of {runs}"
        (out,), wall = _generate(llm, _uncached(llm, w, run), desc=desc)
        samples.append((out.time_per_output_token, out.time_to_first_token, wall))
    tpot, ttft, wall = sorted(samples)[len(samples) // 2]  # the median run by TPOT
    n = w.max_tokens[0]
    return _result(
        requests=1,
        output_tokens=n,
        seconds=wall,
        tokens_per_s=1.0 / tpot,
        tokens_per_s_incl_prefill=n / wall,
        ttft_s=ttft,
        tpot_s=tpot,
        host_time_per_step_ms=counter.host_ms_per_step(),
        notes={
            "runs": runs,
            "tpot_runs_ms": [round(1e3 * s[0], 4) for s in samples],
            "prompt_is": "the same ids with a new first id each run: never in the prefix cache",
        },
    )


def run_ttft(llm: LLM, w: Workload, warmup: Workload, runs: int) -> BenchResult:
    """Workload 3: one long prompt, max_tokens 1; median time to first token."""
    _generate(llm, warmup)
    _generate(llm, w)  # a first long prefill allocates its activations: not timed
    ttfts, walls = [], []
    counter = _StepCounter(llm)
    for run in range(runs):
        (out,), wall = _generate(llm, _uncached(llm, w, run))
        ttfts.append(out.time_to_first_token)
        walls.append(wall)
    ttft = statistics.median(ttfts)
    return _result(
        requests=1,
        output_tokens=1,
        seconds=statistics.median(walls),
        tokens_per_s=None,
        ttft_s=ttft,
        ttft_runs_s=ttfts,
        host_time_per_step_ms=counter.host_ms_per_step(),
        notes={
            "runs": runs,
            "prefill_tokens_per_s": round(len(w.prompts[0]) / ttft, 2),
            "ttft_is": "from add_request to the sampled token on the host",
            "prompt_is": "the same ids with a new first id each run: never in the prefix cache",
        },
    )
