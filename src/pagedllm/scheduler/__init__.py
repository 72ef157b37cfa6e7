"""What runs each step (no torch): FIFO admission under a page budget, static or continuous."""

from pagedllm.scheduler.scheduler import (
    BATCHING_CHOICES,
    RequestRejected,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

__all__ = [
    "BATCHING_CHOICES",
    "RequestRejected",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
