"""Per-request sampling and stopping parameters (vLLM's names and ranges).

Owns: validation. A bad value raises `ValueError` naming the field and the
allowed range, at construction, before the request reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    max_tokens: int = 16
    ignore_eos: bool = False
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
