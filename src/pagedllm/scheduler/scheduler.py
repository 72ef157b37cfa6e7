"""The scheduler: which requests run this step, and how many new tokens each.

Owns: the FIFO waiting queue, the running list, admission under the page
budget (static or continuous batching; the "reserve" or "optimistic" policy),
preemption, the token budget of a step (chunked prefill), the token-level stop
checks (EOS, stop token ids, max_tokens, max_model_len) and the counters
`--stats` prints. Does not own: pages (the block manager), tensors (the
runner), text and stop strings (the engine, which calls `finish_request`).

The one rule (as vLLM v1): there is no prefill mode and no decode mode; a
request needs `num_tokens - num_computed_tokens` more tokens computed.

Two shapes of step (`SchedulerConfig.chunked_prefill`):

- chunked (the default, as vLLM v1): every step spends a token budget
  (`max_num_batched_tokens`): first one decode token for each running request
  that is generating, then prompt tokens of running requests still computing
  their prompt (a long prompt is split over steps), then new requests, FIFO,
  while budget and pages last. Prefill and decode tokens share a step, so a
  long prompt arriving never stalls the others' next tokens.
- whole prompts (the seed's, as nano-vllm): a step is either a prefill step of
  whole prompts, FIFO, packed up to the budget but always at least one (a
  prompt longer than the budget runs alone), or a decode step of every running
  request. The largest pass is `SchedulerConfig.max_tokens_per_step` tokens.

Admission (`SchedulerConfig.admission`):

- "reserve": a request reserves at admission every page it can ever write,
  `ceil((prompt + max_tokens - 1) / block_size)`, so decode never runs out of
  pages and nothing is ever preempted. The head of the queue waits while its
  reservation does not fit (an *admission wait*).
- "optimistic": a request is admitted on the pages its tokens of this step
  need; pages are added as it grows. When a running request needs a page and
  none is free, the most recently admitted running request is *preempted*:
  its pages are freed, it keeps its tokens, goes back to the head of the queue
  and later recomputes them all. No request is admitted in a step that preempted.

With either policy a request that could never fit the whole cache (its
reservation exceeds every page) is rejected at once, so the oldest running
request always fits alone and preemption always makes progress.

Invariants (`check_invariants`): waiting requests hold no pages and have
computed nothing; a running request's table covers its computed tokens (and,
under "reserve", is exactly its reservation); the block manager's own
invariants hold (reference counts match the tables).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedllm.engine_config import ADMISSION_POLICIES, BATCHING_POLICIES
from pagedllm.kv.block_manager import BlockManager
from pagedllm.request import FinishReason, Request, RequestStatus
from pagedllm.utils import plural

BATCHING_CHOICES = BATCHING_POLICIES


class RequestRejected(ValueError):
    """A request that can never run: too long for the model or for the whole KV cache."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # most requests running at once
    max_num_batched_tokens: int = 8192  # token budget of one step (see module doc)
    max_model_len: int  # prompt + generated tokens of one request
    # The model's own limit (its positions), which max_model_len may not exceed;
    # only used to give advice that leads somewhere. None: the same as max_model_len.
    model_max_len: int | None = None
    batching: str = "continuous"  # "continuous": admit every step; "static": group by group
    admission: str = "reserve"  # "reserve" or "optimistic" (see module doc)
    chunked_prefill: bool = True  # mixed steps under a token budget (see module doc)

    def __post_init__(self) -> None:
        if self.batching not in BATCHING_CHOICES:
            raise ValueError(
                f"batching must be one of {', '.join(BATCHING_CHOICES)}, got {self.batching!r}"
            )
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(
                f"admission must be one of {', '.join(ADMISSION_POLICIES)}, got {self.admission!r}"
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
        """The most tokens one step can schedule (whole prompts: a lone long
        prompt may exceed the budget; chunked: never)."""
        if self.chunked_prefill:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, self.max_model_len)


@dataclass(frozen=True)
class SchedulerOutput:
    """The plan of one step. The four tuples are parallel, in batch order."""

    scheduled: tuple[Request, ...]
    num_new_tokens: tuple[int, ...]
    # Each request's num_computed_tokens when the step was planned: its new
    # tokens sit at positions [c, c + n). A snapshot, because update() moves it.
    num_computed_tokens: tuple[int, ...]
    # Each request's pages (the block manager's own lists: read, never change).
    block_tables: tuple[list[int], ...] = ()
    admitted: tuple[Request, ...] = ()
    preempted: tuple[Request, ...] = ()  # pages taken back this step (optimistic only)
    # Requests that finished since the last plan: the runner forgets their state.
    finished_request_ids: tuple[int, ...] = ()
    admission_wait: bool = False
    # Prefix cache: pages this step's computation names (per request), and the
    # requests admitted on some of them: what `undo_step` takes back. Naming
    # hashes every full page (~1-2 us each), so it waits where it can:
    # `unnamed` holds (request, tokens) still to name, and `Scheduler.name_pages`
    # names them once the step is launched (the engine calls it; `update`,
    # `schedule` and `undo_step` settle any left). Pages that a request admitted
    # in this same step could share are named before its lookup.
    named_pages: list[tuple[Request, tuple[int, ...]]] = field(default_factory=list)
    fresh_hits: tuple[Request, ...] = ()
    unnamed: list[tuple[Request, int]] = field(default_factory=list)

    # How many of the step's tokens are prompt (or recomputed) tokens, and how
    # many are one decode token of a generating request.
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Planned before the previous step ran (schedule_continuation): request i's
    # input token is the one that step sampled in row feed_rows[i], fed on the
    # device. Empty for a normal plan.
    feed_rows: tuple[int, ...] = ()

    @property
    def is_continuation(self) -> bool:
        return bool(self.feed_rows)

    @property
    def is_prefill(self) -> bool:
        """Whether any scheduled token is a prompt token (or a recomputed one)."""
        return self.num_prefill_tokens > 0

    @property
    def total_new_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request: the tokens it gained, and whether it finished."""

    request: Request
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the EOS/stop id that finished it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._finished_ids: list[int] = []  # since the last plan
        self._unnamed_plan: SchedulerOutput | None = None  # the plan with pages left to name
        # Counters for --stats.
        self.num_admission_waits = 0
        self.num_preemptions = 0
        self.peak_running = 0
        self.max_decode_batch = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_cache_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_cache_hit_tokens = 0  # ... and found there

    # ------------------------------------------------------------ submission
    def add_request(self, request: Request) -> None:
        """Queue a request, or reject it alone if it could never run.

        A rejected request is finished with FinishReason.REJECTED and its
        `error` set to the message before RequestRejected is raised.
        """
        problem = self.rejection(request)
        if problem is not None:
            request.error = problem
            request.finish(FinishReason.REJECTED)
            raise RequestRejected(problem)
        self.waiting.append(request)

    def rejection(self, request: Request) -> str | None:
        """Why `request` could never run (its message), or None: `add_request`'s
        check alone, for a caller that adds the request later."""
        return self._rejection(request)

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
                f"request {rid}: needs {need} KV pages of {plural(bm.block_size, 'token')} "
                f"(prompt {prompt} + max_tokens {max_tokens} - 1 = {prompt + max_tokens - 1} "
                f"tokens) but the whole KV cache has {plural(bm.num_blocks, 'page')} "
                f"({plural(bm.num_blocks * bm.block_size, 'token')}); "
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
        self._settle_names()
        plan = _Plan(self.config.max_num_batched_tokens, self.block_manager)
        if self.config.chunked_prefill:
            self._schedule_chunked(plan)
        else:
            self._schedule_whole(plan)
        if plan.admission_wait:
            self.num_admission_waits += 1
        self.peak_running = max(self.peak_running, len(self.running))
        self._count_step(plan)
        finished, self._finished_ids = tuple(self._finished_ids), []
        bm = self.block_manager
        out = SchedulerOutput(
            scheduled=tuple(plan.requests),
            num_new_tokens=tuple(plan.num_new),
            num_computed_tokens=tuple(r.num_computed_tokens for r in plan.requests),
            block_tables=tuple(bm.block_tables(plan.requests)),
            admitted=tuple(plan.admitted),
            preempted=tuple(plan.preempted),
            finished_request_ids=finished,
            admission_wait=plan.admission_wait,
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decode_tokens=plan.num_decode_tokens,
            named_pages=[(r, tuple(p)) for r, p in plan.named.items() if p],
            fresh_hits=tuple(plan.fresh_hits),
            unnamed=plan.unnamed,
        )
        if out.unnamed:
            self._unnamed_plan = out
        return out

    def name_pages(self, plan: SchedulerOutput) -> None:
        """Name the full pages that `plan`'s step computes and has not named yet
        (prefix caching), adding them to `plan.named_pages`. The engine calls it
        right after launching the step, while the device runs it; calling it
        again, or for a plan without such pages, does nothing."""
        if plan.unnamed:
            bm = self.block_manager
            for request, num_tokens in plan.unnamed:
                named = bm.cache_pages(request, num_tokens)
                if named:
                    plan.named_pages.append((request, tuple(named)))
            plan.unnamed.clear()
        if self._unnamed_plan is plan:
            self._unnamed_plan = None

    def _settle_names(self) -> None:
        """Name what the last plan left unnamed (a caller that never called `name_pages`)."""
        if self._unnamed_plan is not None:
            self.name_pages(self._unnamed_plan)

    def schedule_continuation(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `prev`, planned before `prev` ran (async scheduling):
        each of prev's requests computes one more token, whose input is the
        token `prev` samples (the runner feeds it on the device, `feed_rows`
        saying which of prev's rows). None when that is not the step
        `schedule()` would plan after `prev`, or is unsafe:

        - `prev` was not an all-decode step of every running request, or it
          admitted or preempted, or someone waits to be admitted;
        - a request's next sample depends on the token not known yet
          (penalties, min_tokens not reached, prompt log-probs);
        - the pool lacks a page (a continuation never preempts: the normal
          step decides that).

        Requests that `prev` surely finishes (their last token by max_tokens or
        max_model_len) are left out. One that `prev` finishes otherwise (EOS,
        a stop id or string, an abort) is computed once more and its token
        dropped: `update` skips requests that are no longer running. A page
        whose last token is the unknown one cannot be named now (its hash
        needs that token): `update` names it once the step has run.
        """
        self._settle_names()
        if (
            not prev.scheduled
            or prev.num_prefill_tokens
            or prev.admitted
            or prev.preempted
            or self.waiting
            or len(prev.scheduled) != len(self.running)
        ):
            return None
        running = RequestStatus.RUNNING
        limit = self.config.max_model_len
        rows: list[int] = []
        for i, request in enumerate(prev.scheduled):
            c = request.num_computed_tokens  # `prev` computes position c
            params = request.sampling_params
            if (
                request.status is not running
                or request.num_tokens - c != 1
                or params.presence_penalty
                or params.frequency_penalty
                or params.repetition_penalty not in (None, 1.0)
                or len(request.output_token_ids) < params.min_tokens
                or params.prompt_logprobs is not None
            ):
                return None
            if len(request.output_token_ids) + 1 < params.max_tokens and c + 2 < limit:
                rows.append(i)  # not finished by length after `prev`
        if not rows:
            return None
        requests = tuple(prev.scheduled[i] for i in rows)
        bm = self.block_manager
        for request in requests:  # pages for position c + 1 (extra ones stay: harmless)
            if not bm.allocate_slots(request, request.num_computed_tokens + 2):
                return None
        n = len(requests)
        self.num_decode_tokens += n
        self.max_decode_batch = max(self.max_decode_batch, n)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(
            scheduled=requests,
            num_new_tokens=(1,) * n,
            num_computed_tokens=tuple(r.num_computed_tokens + 1 for r in requests),
            block_tables=tuple(bm.block_tables(requests)),
            finished_request_ids=finished,
            num_decode_tokens=n,
            feed_rows=tuple(rows),
        )

    def _schedule_chunked(self, plan: _Plan) -> None:
        """Decode tokens first, then prompt chunks of running requests, then new ones."""
        static_idle = self.config.batching == "static" and not self.running
        running = RequestStatus.RUNNING
        computing: list[Request] = []
        allocate_slots = self.block_manager.allocate_slots
        for request in list(self.running):  # a copy: preemption removes from the list
            c = request.num_computed_tokens
            if request.num_tokens - c > 1:
                computing.append(request)  # prompt tokens left: after the decode tokens
            elif plan.budget > 0 and request.status is running:  # not preempted this step
                # (The hot path: one token each, usually no new page.)
                if allocate_slots(request, c + 1) or self._make_room(request, c + 1, plan):
                    plan.add_one(request)
        for request in computing:
            if plan.budget == 0:
                break
            if request.status is not running:
                continue  # preempted earlier in this step
            n = min(request.num_tokens - request.num_computed_tokens, plan.budget)
            if self._make_room(request, request.num_computed_tokens + n, plan):
                plan.add(request, n)
        if plan.preempted:
            return  # memory is short: admit nobody this step
        if self.config.batching == "static" and not static_idle:
            return  # static: the running group finishes before the next is admitted
        # Static batching admits a whole group by pages, even past this step's budget.
        self._admit(plan, need_budget=self.config.batching == "continuous")

    def _schedule_whole(self, plan: _Plan) -> None:
        """The seed's step: admit, then whole prompts FIFO, or else everyone's decode token."""
        if self.config.batching == "continuous" or not self.running:
            self._admit(plan, need_budget=False)
        # A request admitted now is computed in this (prefill) step even when the
        # prefix cache left it one token, so a step that admits never preempts.
        admitted = set(plan.admitted)
        prefilling = [
            r
            for r in self.running
            if self._num_needed(r) > 1 or self._in_prompt(r) or r in admitted
        ]
        if prefilling:
            for request in prefilling:
                n = self._num_needed(request)
                if plan.requests and n > plan.budget:
                    break  # FIFO: no one jumps the queue; a lone long prompt still runs alone
                if self._make_room(request, request.num_tokens, plan):
                    plan.add(request, n, allow_over_budget=True)
            return
        for request in list(self.running):
            if request.status is RequestStatus.RUNNING and self._make_room(
                request, request.num_tokens, plan
            ):
                plan.add(request, 1)

    def _admit(self, plan: _Plan, need_budget: bool) -> None:
        """Admit from the head of the queue, FIFO, while pages (and budget) last."""
        bm = self.block_manager
        chunked = self.config.chunked_prefill
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            if need_budget and plan.budget == 0:
                return
            head = self.waiting[0]
            # A request that wants prompt log-probs computes every prompt token.
            wants_all = head.sampling_params.prompt_logprobs is not None
            cached, hit = ([], 0) if wants_all else bm.find_cached_prefix(head)
            if plan.unnamed and not wants_all and bm.may_share(head, hit, plan.unnamed):
                plan.name_pages()  # pages this step computes that the head may share
                cached, hit = bm.find_cached_prefix(head)
            todo = head.num_tokens - hit
            n = min(todo, plan.budget) if chunked else todo
            if self.config.admission == "reserve":
                cover = head.num_prompt_tokens + head.max_tokens - 1
            else:
                cover = hit + n
            if not bm.can_admit(head, cover, cached):
                plan.admission_wait = True  # the head keeps its place
                return
            self.waiting.popleft()
            bm.admit(head, cover, cached)
            if plan.named_set.intersection(cached):
                plan.fresh_hits.append(head)  # shares pages this very step computes
            head.num_computed_tokens = hit
            if head.num_preemptions == 0:
                head.num_cached_tokens = hit
                self.num_cache_query_tokens += head.num_prompt_tokens
                self.num_cache_hit_tokens += hit
            head.status = RequestStatus.RUNNING
            self.running.append(head)
            plan.admitted.append(head)
            if chunked and n > 0:
                plan.add(head, n)

    def _make_room(self, request: Request, num_tokens: int, plan: _Plan) -> bool:
        """Pages for the request's first `num_tokens` tokens, preempting from the
        most recently admitted when the pool is dry; False if it was preempted itself."""
        while not self.block_manager.allocate_slots(request, num_tokens):
            if self.config.admission == "reserve":
                # The reservation covers every token: this is a bookkeeping bug.
                raise RuntimeError(f"request {request.request_id} ran out of reserved KV pages")
            victim = self.running[-1]
            self._preempt(victim)
            plan.drop(victim)
            plan.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, counted: bool = True) -> None:
        """Take every page back; the request keeps its tokens and recomputes them later."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1  # (also tells the runner its block table is new)
        self.waiting.appendleft(request)
        if counted:
            self.num_preemptions += 1

    @staticmethod
    def _num_needed(request: Request) -> int:
        return request.num_tokens - request.num_computed_tokens

    @staticmethod
    def _in_prompt(request: Request) -> bool:
        return request.num_computed_tokens < request.num_prompt_tokens

    def _count_step(self, plan: _Plan) -> None:
        self.num_prefill_tokens += plan.num_prefill_tokens
        self.num_decode_tokens += plan.num_decode_tokens
        self.max_decode_batch = max(self.max_decode_batch, plan.num_decode_tokens)

    # ---------------------------------------------------------------- update
    def update(
        self, output: SchedulerOutput, sampled_token_ids: Sequence[int | None]
    ) -> list[RequestUpdate]:
        """Advance each scheduled request by its new tokens; return what happened
        to each request that gained a token (and whether it finished).

        `sampled_token_ids` is parallel to `output.scheduled`; an entry may be
        None only for a request that has not computed all its tokens yet.
        """
        if len(sampled_token_ids) != len(output.scheduled):
            raise ValueError(
                f"got {len(sampled_token_ids)} sampled ids for "
                f"{len(output.scheduled)} scheduled requests"
            )
        self.name_pages(output)
        updates: list[RequestUpdate] = []
        running = RequestStatus.RUNNING
        continuation = output.is_continuation
        caching = self.block_manager.enable_caching
        block_size = self.block_manager.block_size
        for request, num_new, token_id in zip(
            output.scheduled, output.num_new_tokens, sampled_token_ids
        ):
            if request.status is not running:
                continue  # finished by finish_request() between schedule() and update()
            request.num_computed_tokens += num_new
            if (
                continuation
                and caching
                and request.num_computed_tokens % block_size == 0
                and request.num_computed_tokens == request.num_tokens
            ):
                # The page this step filled ends in the token it was fed (a
                # continuation could not name it when planned): name it now.
                self.block_manager.cache_pages(request, request.num_computed_tokens)
            if request.num_computed_tokens < request.num_tokens:
                continue  # part of a prompt: nothing was sampled for it
            if token_id is None:
                raise ValueError(f"request {request.request_id} computed all tokens but got None")
            request.append_output_token(token_id)
            reason, stop_reason = self._check_stop(request)
            if reason is not None:
                self._finish(request, reason, stop_reason)
            updates.append(RequestUpdate(request, [token_id], reason, stop_reason))
        return updates

    def undo_step(self, plan: SchedulerOutput) -> None:
        """The step of `plan` failed (an exception, Ctrl-C) before `update`: its
        tokens stay uncomputed and are planned again. Pages it named are
        unnamed (their K/V may be half written), and a request admitted on
        such pages is preempted to recompute (it counted them as computed)."""
        plan.unnamed.clear()  # never named: nothing to take back
        if self._unnamed_plan is plan:
            self._unnamed_plan = None
        bm = self.block_manager
        for request, named in plan.named_pages:
            bm.forget_uncomputed(request, list(named))
        for request in plan.fresh_hits:
            if request.status is RequestStatus.RUNNING:
                self._preempt(request, counted=False)  # a retry, not a preemption
        # The runner may not have seen them: hand them to the next plan again.
        self._finished_ids[:0] = plan.finished_request_ids

    def _check_stop(self, request: Request) -> tuple[FinishReason | None, int | None]:
        """Token-level stops, after the newest token was appended (vLLM's rules:
        the first `min_tokens` outputs never stop on a token; `ignore_eos`
        ignores only the EOS ids; a stop wins over a length limit reached at once)."""
        params = request.sampling_params
        outputs = request.output_token_ids
        n_out = len(outputs)
        token_id = outputs[-1]
        if n_out >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                return FinishReason.STOP, token_id
            if token_id in params.stop_token_ids:
                return FinishReason.STOP, token_id
        if n_out >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def finish_request(
        self, request: Request, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """Finish a waiting or running request for the engine (stop string, abort,
        error), freeing its pages. A request already finished is left as it is."""
        if request.is_finished:
            return
        if request in self.running:
            self._finish(request, reason, stop_reason)
            return
        if request not in self.waiting:
            raise ValueError(f"request {request.request_id} is not in this scheduler")
        self.waiting.remove(request)
        self.block_manager.forget(request)
        request.finish(reason, stop_reason)
        self._finished_ids.append(request.request_id)

    def restate_finish(
        self, request: Request, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """Give a finished request another reason: a stop string found in the text
        of the token that also reached max_tokens (the string wins, as in vLLM),
        or an error met while making its text."""
        if not request.is_finished:
            raise ValueError(f"request {request.request_id} is not finished")
        request.finish_reason, request.stop_reason = reason, stop_reason

    def _finish(
        self, request: Request, reason: FinishReason, stop_reason: int | str | None
    ) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.finish(reason, stop_reason)
        self._finished_ids.append(request.request_id)

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
            rid = request.request_id
            if request.status is not RequestStatus.WAITING:
                raise AssertionError(f"waiting request {rid} is {request.status}")
            if bm.holds(request):
                raise AssertionError(f"waiting request {rid} holds pages")
            if request.num_computed_tokens:
                raise AssertionError(f"waiting request {rid} has computed tokens")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs")
        for request in self.running:
            self._check_running(request)
        holders = sum(bm.holds(r) for r in self.running)
        if holders != bm.num_holders:
            raise AssertionError("the block manager holds pages for requests that are not running")
        bm.check_invariants()

    def _check_running(self, request: Request) -> None:
        bm, rid = self.block_manager, request.request_id
        if request.status is not RequestStatus.RUNNING:
            raise AssertionError(f"running request {rid} is {request.status}")
        if not bm.holds(request):
            raise AssertionError(f"running request {rid} holds no pages")
        held, reserved = len(bm.block_table(request)), bm.reservation_blocks(request)
        if self.config.admission == "reserve" and held != reserved:
            raise AssertionError(f"request {rid} holds {held} pages, reserved {reserved}")
        if not bm.blocks_for_tokens(request.num_computed_tokens) <= held <= reserved:
            raise AssertionError(
                f"request {rid} holds {held} pages for {request.num_computed_tokens} "
                f"computed tokens (at most {reserved})"
            )
        if self._num_needed(request) < 1:
            raise AssertionError(f"running request {rid} needs no tokens (update() missed?)")


class _Plan:
    """A step being planned: who runs with how many tokens, and the budget left."""

    def __init__(self, budget: int, block_manager: BlockManager) -> None:
        self.budget = budget
        self.block_manager = block_manager
        self.requests: list[Request] = []
        self.num_new: list[int] = []
        self.admitted: list[Request] = []
        self.preempted: list[Request] = []
        self.admission_wait = False
        self.named: dict[Request, list[int]] = {}  # pages each request's tokens fill
        self.named_set: set[int] = set()
        self.unnamed: list[tuple[Request, int]] = []  # (request, tokens): pages to name
        self.fresh_hits: list[Request] = []
        self.is_decode: list[bool] = []  # per planned request: one decode token?
        self.num_prefill_tokens = 0  # prompt (or recomputed) tokens
        self.num_decode_tokens = 0  # one per generating request

    def add(self, request: Request, n: int, allow_over_budget: bool = False) -> None:
        if n > self.budget and not allow_over_budget:
            raise AssertionError(f"{n} tokens over a budget of {self.budget}")
        self.requests.append(request)
        self.num_new.append(n)
        self.budget = max(0, self.budget - n)
        c = request.num_computed_tokens
        decode = n == 1 and c >= len(request.prompt_token_ids)
        self.is_decode.append(decode)
        if decode:
            self.num_decode_tokens += 1
        else:
            self.num_prefill_tokens += n
        # Pages these tokens fill get names, for later requests to share: when
        # the step is launched, or before a later admission that may share them.
        bm = self.block_manager
        if bm.enable_caching and (c + n) // bm.block_size > c // bm.block_size:
            self.unnamed.append((request, c + n))

    def add_one(self, request: Request) -> None:
        """`add(request, 1)`, for the hot path: a request's one next token."""
        c = request.num_computed_tokens
        self.requests.append(request)
        self.num_new.append(1)
        self.budget -= 1
        decode = c >= len(request.prompt_token_ids)
        self.is_decode.append(decode)
        if decode:
            self.num_decode_tokens += 1
        else:
            self.num_prefill_tokens += 1
        bm = self.block_manager
        if bm.enable_caching and (c + 1) % bm.block_size == 0:  # fills a page
            self.unnamed.append((request, c + 1))

    def name_pages(self) -> None:
        """Name now the pages planned so far (an admission may share them)."""
        for request, num_tokens in self.unnamed:
            named = self.block_manager.cache_pages(request, num_tokens)
            self.named.setdefault(request, []).extend(named)
            self.named_set.update(named)
        self.unnamed.clear()

    def drop(self, request: Request) -> None:
        """Unschedule a request preempted after it was planned; refund its tokens.
        (Its pages are already freed; names given this step are taken back.)"""
        if request in self.requests:
            i = self.requests.index(request)
            n = self.num_new[i]
            self.budget += n
            if self.is_decode[i]:
                self.num_decode_tokens -= 1
            else:
                self.num_prefill_tokens -= n
            del self.requests[i], self.num_new[i], self.is_decode[i]
        self.unnamed[:] = [(r, n) for r, n in self.unnamed if r is not request]
        named = self.named.pop(request, [])
        self.block_manager.forget_uncomputed(request, named)
        self.named_set.difference_update(named)
        if request in self.admitted:
            self.admitted.remove(request)
