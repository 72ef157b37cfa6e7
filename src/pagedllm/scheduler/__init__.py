"""What runs each step (no torch): FIFO admission under a page budget, chunked
prefill under a token budget, the "reserve" and "optimistic" policies, preemption."""

from pagedllm.scheduler.scheduler import (
    BATCHING_CHOICES,
    RequestRejected,
    RequestUpdate,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

__all__ = [
    "BATCHING_CHOICES",
    "RequestRejected",
    "RequestUpdate",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
