"""A request's state as it moves through the engine.

Owns: the token lists, how many tokens already have K/V in the cache
(`num_computed_tokens`), the status and the timings. Does not own: pages (the
block manager keeps every block table) or tensors (the runner makes them).

The one rule that drives scheduling: a request needs
`num_tokens - num_computed_tokens` more tokens computed. After prefill that is 1
(the token just sampled, whose K/V is written by the next step).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS id, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    REJECTED = "rejected"  # could never fit; see Request.error
    ABORT = "abort"  # aborted by its caller; the tokens made so far are kept
    ERROR = "error"  # failed alone (see Request.error); the others went on

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False)
class Request:
    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Ids that end generation unless ignore_eos (the model's EOS list).
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Prompt tokens whose K/V came from the prefix cache at first admission.
    num_cached_tokens: int = 0
    # Times its pages were taken back (it then recomputes everything it had).
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # What stopped it: the EOS/stop token id or the stop string.
    stop_reason: int | str | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    # Its constraint's matcher (structured/matcher.py) when its params have one:
    # the runner masks its logits with it, the engine advances it. The scheduler
    # never reads it.
    matcher: Any = field(default=None, repr=False)
    _num_tokens: int = field(init=False, repr=False, default=0)

    def __post_init__(self) -> None:
        self._num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        # A counter, not len() + len(): the scheduler reads it for every request
        # every step. Tokens are only ever added through append_output_token.
        return self._num_tokens

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_token_ids.append(token_id)
        self._num_tokens += 1

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.perf_counter()
