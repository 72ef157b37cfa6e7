"""StepRecorder: what each engine step did, for pictures (`pagedllm --plot DIR`).

Owns: one small record per step, as plain values: the page pool (held per
request, cached, free), each request's phase (waiting, prefill, decode,
finished), who was admitted or preempted, whether the head of the queue had
to wait, and the step's prompt and decode tokens. Does not own: drawing
(`pagedllm/plots.py`) or anything it records.

An engine records only while `LLMEngine.recorder` is set (None by default:
nothing is kept and nothing is computed). Layer 2 (engine): no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

WAITING, PREFILL, DECODE, FINISHED = "waiting", "prefill", "decode", "finished"


@dataclass
class StepRecord:
    step: int
    pages_held: dict[int, int]  # request id -> pages it holds after the step
    pages_cached: int  # free pages that keep a prefix-cache name (reusable by a later prompt)
    pages_free: int  # free pages, cached ones included
    pages_total: int
    phase: dict[int, str]  # request id -> its phase in this step
    admitted: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    admission_wait: bool = False
    prefill_tokens: int = 0
    decode_tokens: int = 0


class StepRecorder:
    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self.finished_at: dict[int, int] = {}  # request id -> the step it finished in

    def record(self, engine: Any, plan: Any) -> None:
        """Called by the engine after a step's bookkeeping (plan: its SchedulerOutput)."""
        scheduler, bm = engine.scheduler, engine.block_manager
        n = len(self.steps) + 1
        phase: dict[int, str] = {r.request_id: WAITING for r in scheduler.waiting}
        for r, c in zip(plan.scheduled, plan.num_computed_tokens):
            if r.request_id not in phase:
                phase[r.request_id] = PREFILL if c < r.num_prompt_tokens else DECODE
            if r.is_finished:
                self.finished_at.setdefault(r.request_id, n)
        for r in scheduler.running:
            phase.setdefault(r.request_id, DECODE)  # ran nothing this step (static batching)
        for r in plan.preempted:
            phase[r.request_id] = WAITING
        held = {r.request_id: bm.block_table(r) for r in scheduler.running}
        named = bm.pool.block_hash
        held_named = {b for table in held.values() for b in table if named[b] is not None}
        self.steps.append(
            StepRecord(
                step=n,
                pages_held={rid: len(table) for rid, table in held.items()},
                pages_cached=bm.pool.num_cached - len(held_named),
                pages_free=bm.num_free_blocks,
                pages_total=bm.num_blocks,
                phase=phase,
                admitted=[r.request_id for r in plan.admitted],
                preempted=[r.request_id for r in plan.preempted],
                admission_wait=plan.admission_wait,
                prefill_tokens=plan.num_prefill_tokens,
                decode_tokens=plan.num_decode_tokens,
            )
        )
