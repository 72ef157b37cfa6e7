"""The scheduler: which requests run this step, and how many new tokens each.

Owns: the FIFO waiting queue, the running list, admission under the page budget
(static or continuous batching), the token-level stop checks (EOS, stop token
ids, max_tokens, max_model_len) and the counters `--stats` prints. Does not own:
pages (the block manager), tensors (the runner), text and stop strings (the
engine, which calls `finish_request`).

The one rule (as vLLM v1): there is no prefill mode and no decode mode; a
request needs `num_tokens - num_computed_tokens` more tokens computed. A step
in which some running request still has prompt tokens to compute is a prefill
step, otherwise it is a decode step; the two are never mixed (as nano-vllm).

Long prompts: there is no chunked prefill. A prefill step packs whole prompts,
FIFO, up to `max_num_batched_tokens`, but always takes at least one, so a
prompt longer than that budget runs alone in its own step. The largest forward
pass is therefore `SchedulerConfig.max_tokens_per_step` tokens.

Invariants (`check_invariants`): every running request holds exactly its
reservation of pages, every waiting one holds none, and the block manager's own
invariants hold.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.kv.block_manager import BlockManager
from pagedllm.request import FinishReason, Request, RequestStatus

BATCHING_CHOICES = ("continuous", "static")


class RequestRejected(ValueError):
    """A request that can never run: too long for the model or for the whole KV cache."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # most requests running at once
    max_num_batched_tokens: int = 8192  # token budget of a prefill step (see module doc)
    max_model_len: int  # prompt + generated tokens of one request
    # The model's own limit (its positions), which max_model_len may not exceed;
    # only used to give advice that leads somewhere. None: the same as max_model_len.
    model_max_len: int | None = None
    batching: str = "continuous"  # "continuous": admit every step; "static": group by group

    def __post_init__(self) -> None:
        if self.batching not in BATCHING_CHOICES:
            raise ValueError(
                f"batching must be one of {', '.join(BATCHING_CHOICES)}, got {self.batching!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # A decode step computes one token for each running request.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )

    @property
    def max_tokens_per_step(self) -> int:
        """The most tokens one step can schedule (a lone long prompt may exceed the budget)."""
        return max(self.max_num_batched_tokens, self.max_model_len)


@dataclass(frozen=True)
class SchedulerOutput:
    """The plan of one step. The three tuples are parallel, in batch order."""

    scheduled: tuple[Request, ...]
    num_new_tokens: tuple[int, ...]
    # Each request's num_computed_tokens when the step was planned: its new
    # tokens sit at positions [c, c + n). A snapshot, because update() moves it.
    num_computed_tokens: tuple[int, ...]
    admitted: tuple[Request, ...] = ()
    preempted: tuple[Request, ...] = ()  # always empty under the conservative policy
    admission_wait: bool = False

    @property
    def is_prefill(self) -> bool:
        return any(
            n > 1 or c < r.num_prompt_tokens
            for r, n, c in zip(self.scheduled, self.num_new_tokens, self.num_computed_tokens)
        )

    @property
    def total_new_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        # Counters for --stats.
        self.num_admission_waits = 0
        self.peak_running = 0
        self.max_decode_batch = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

    # ------------------------------------------------------------ submission
    def add_request(self, request: Request) -> None:
        """Queue a request, or reject it alone if it could never run.

        A rejected request is finished with FinishReason.REJECTED and its
        `error` set to the message before RequestRejected is raised.
        """
        problem = self._rejection(request)
        if problem is not None:
            request.error = problem
            request.finish(FinishReason.REJECTED)
            raise RequestRejected(problem)
        self.waiting.append(request)

    def _rejection(self, request: Request) -> str | None:
        prompt, max_tokens = request.num_prompt_tokens, request.max_tokens
        rid = request.request_id
        if prompt == 0:
            return f"request {rid}: the prompt is empty; give at least one token"
        limit = self.config.max_model_len
        if prompt + max_tokens > limit:
            return (
                f"request {rid}: prompt ({prompt} tokens) + max_tokens ({max_tokens}) = "
                f"{prompt + max_tokens} exceeds max_model_len ({limit}); "
                + self._context_advice(prompt, max_tokens)
            )
        bm = self.block_manager
        need = bm.reservation_blocks(request)
        if need > bm.num_blocks:
            return (
                f"request {rid}: needs {need} KV pages of {bm.block_size} tokens "
                f"(prompt {prompt} + max_tokens {max_tokens} - 1 = {prompt + max_tokens - 1} "
                f"tokens) but the whole KV cache has {bm.num_blocks} pages "
                f"({bm.num_blocks * bm.block_size} tokens); "
                f"raise --kv-cache-mib (kv_cache_mib) or lower max_tokens"
            )
        return None

    def _context_advice(self, prompt: int, max_tokens: int) -> str:
        """What to do about a request over max_model_len: only advice that can work."""
        limit = self.config.max_model_len
        model_limit = max(self.config.model_max_len or limit, limit)
        options = []
        if limit < prompt + max_tokens <= model_limit:
            options.append(f"raise --max-model-len (max_model_len) to {prompt + max_tokens}")
        if prompt < limit:
            options.append(f"lower max_tokens to {limit - prompt} or less")
        if max_tokens < limit:
            options.append(f"shorten the prompt to {limit - max_tokens} tokens or fewer")
        if not options:
            options.append(f"shorten the prompt and lower max_tokens to {limit} tokens together")
        where = f"the model has {model_limit} positions"
        if limit < model_limit:
            where += f", max_model_len is {limit}"
        return " or ".join(options) + f" ({where})"

    # -------------------------------------------------------------- planning
    def schedule(self) -> SchedulerOutput:
        # 1. Admission: move the head of the waiting queue to running while its
        #    reservation fits (continuous: every step; static: only when idle).
        admitted, admission_wait = self._admit()
        if admission_wait:
            self.num_admission_waits += 1
        self.peak_running = max(self.peak_running, len(self.running))

        # 2. Prefill step if any running request still has prompt tokens to compute ...
        scheduled = self._schedule_prefills()
        is_prefill = bool(scheduled)
        # 3. ... otherwise a decode step: every running request, one token each.
        if not is_prefill:
            scheduled = list(self.running)
        num_new_tokens = [self._num_needed(r) for r in scheduled]

        # 4. Make sure the block tables cover the new tokens.
        self._ensure_slots(scheduled, num_new_tokens)

        # 5. Count.
        self._count_step(is_prefill, num_new_tokens)
        return SchedulerOutput(
            scheduled=tuple(scheduled),
            num_new_tokens=tuple(num_new_tokens),
            num_computed_tokens=tuple(r.num_computed_tokens for r in scheduled),
            admitted=tuple(admitted),
            preempted=(),
            admission_wait=admission_wait,
        )

    def _admit(self) -> tuple[list[Request], bool]:
        """Admit FIFO; return the admitted requests and whether the head had to wait for pages."""
        if self.config.batching == "static" and self.running:
            return [], False  # static: the running group finishes before the next is admitted
        admitted: list[Request] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            head = self.waiting[0]
            if not self.block_manager.can_allocate(head):
                return admitted, True  # an admission wait: the head keeps its place
            self.waiting.popleft()
            self.block_manager.allocate(head)
            head.status = RequestStatus.RUNNING
            self.running.append(head)
            admitted.append(head)
        return admitted, False

    def _schedule_prefills(self) -> list[Request]:
        """Running requests with prompt tokens left, FIFO, within the token budget."""
        scheduled: list[Request] = []
        budget = self.config.max_num_batched_tokens
        for request in self.running:
            if not self._in_prefill(request):
                continue
            need = self._num_needed(request)
            if scheduled and need > budget:
                break  # FIFO: no one jumps the queue; a lone long prompt still runs alone
            scheduled.append(request)
            budget -= need
        return scheduled

    @staticmethod
    def _num_needed(request: Request) -> int:
        return request.num_tokens - request.num_computed_tokens

    @classmethod
    def _in_prefill(cls, request: Request) -> bool:
        return (
            request.num_computed_tokens < request.num_prompt_tokens or cls._num_needed(request) > 1
        )

    def _ensure_slots(self, scheduled: list[Request], num_new_tokens: list[int]) -> None:
        for request, n in zip(scheduled, num_new_tokens):
            if not self.block_manager.append_slots(request, n):
                # Conservative admission reserved every page up front, so this cannot
                # happen. The optimistic policy will preempt from the tail of running here.
                raise RuntimeError(f"request {request.request_id} ran out of KV pages")

    def _count_step(self, is_prefill: bool, num_new_tokens: list[int]) -> None:
        if is_prefill:
            self.num_prefill_tokens += sum(num_new_tokens)
        elif num_new_tokens:
            self.num_decode_tokens += sum(num_new_tokens)
            self.max_decode_batch = max(self.max_decode_batch, len(num_new_tokens))

    # ---------------------------------------------------------------- update
    def update(
        self, output: SchedulerOutput, sampled_token_ids: Sequence[int | None]
    ) -> list[Request]:
        """Advance each scheduled request by its new tokens; return those that finished.

        `sampled_token_ids` is parallel to `output.scheduled`; an entry may be
        None only for a request that has not computed all its tokens yet.
        """
        if len(sampled_token_ids) != len(output.scheduled):
            raise ValueError(
                f"got {len(sampled_token_ids)} sampled ids for "
                f"{len(output.scheduled)} scheduled requests"
            )
        finished: list[Request] = []
        for request, num_new, token_id in zip(
            output.scheduled, output.num_new_tokens, sampled_token_ids
        ):
            if request.is_finished:
                continue  # finished by finish_request() between schedule() and update()
            request.num_computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens:
                continue  # part of a prompt: nothing was sampled for it
            if token_id is None:
                raise ValueError(f"request {request.request_id} computed all tokens but got None")
            request.append_output_token(token_id)
            reason, stop_reason = self._check_stop(request)
            if reason is not None:
                self._finish(request, reason, stop_reason)
                finished.append(request)
        return finished

    def _check_stop(self, request: Request) -> tuple[FinishReason | None, int | None]:
        """Token-level stops, after the newest token was appended."""
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        if request.num_output_tokens >= (getattr(params, "min_tokens", 0) or 0):
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return FinishReason.STOP, token_id
            if token_id in (getattr(params, "stop_token_ids", None) or ()):
                return FinishReason.STOP, token_id
        if request.num_output_tokens >= request.max_tokens:
            return FinishReason.LENGTH, None
        if request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def finish_request(
        self, request: Request, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """Finish a waiting or running request for the engine (stop string, abort).

        Frees its pages. A request that is already finished is left as it is.
        """
        if request.is_finished:
            return
        if request in self.running:
            self._finish(request, reason, stop_reason)
            return
        if request not in self.waiting:
            raise ValueError(f"request {request.request_id} is not in this scheduler")
        self.waiting.remove(request)
        request.finish(reason, stop_reason)

    def _finish(
        self, request: Request, reason: FinishReason, stop_reason: int | str | None
    ) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.finish(reason, stop_reason)

    # --------------------------------------------------------------- queries
    def owns(self, request: Request) -> bool:
        """Whether `request` is waiting or running here."""
        return request in self.running or request in self.waiting

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def check_invariants(self) -> None:
        """Raise AssertionError (never stripped by -O) if the bookkeeping is broken."""
        bm = self.block_manager
        for request in self.waiting:
            if request.status is not RequestStatus.WAITING:
                raise AssertionError(f"waiting request {request.request_id} is {request.status}")
            if request.block_table or bm.block_ids(request):
                raise AssertionError(f"waiting request {request.request_id} holds pages")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs")
        for request in self.running:
            self._check_running(request)
        held = sum(len(r.block_table) for r in self.running)
        if held != bm.num_used_blocks:
            raise AssertionError(f"running requests hold {held} pages, {bm.num_used_blocks} used")
        bm.check_invariants()

    def _check_running(self, request: Request) -> None:
        bm, rid = self.block_manager, request.request_id
        if request.status is not RequestStatus.RUNNING:
            raise AssertionError(f"running request {rid} is {request.status}")
        if len(request.block_table) != bm.reservation_blocks(request):
            raise AssertionError(
                f"request {rid} holds {len(request.block_table)} pages, "
                f"reserved {bm.reservation_blocks(request)}"
            )
        if request.block_table != bm.block_ids(request):
            raise AssertionError(f"request {rid}'s block table differs from the manager's")
        if self._num_needed(request) < 1:
            raise AssertionError(f"running request {rid} needs no tokens (update() missed?)")
