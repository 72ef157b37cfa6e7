"""LLMEngine: the step loop that carries requests from prompt to finished text.

Owns: wiring the layers together and the order of one step, a chain of plain
values each made by one owner (docs/architecture.md, "A request's life"):

    plan    = scheduler.schedule()                  # SchedulerOutput: lists, no tensors
    step    = runner.launch(plan)                   # the device's work, queued
    result  = runner.collect(step)                  # RunnerOutput: sampled ids as host lists
    updates = scheduler.update(plan, result.sampled_token_ids)   # tokens, finishes
    outputs = engine.process(updates, result)       # text, stop strings, streaming

With async scheduling (`EngineConfig.async_scheduling`), an all-decode step's
successor is planned (`scheduler.schedule_continuation`) and launched between
`launch` and `collect`, its input tokens fed on the device from this step's
samples: the device runs it while the host does this step's bookkeeping.

The engine imports no torch: tensors live in `runner/` (imported only when an
engine is built). Does not own: any step's logic, each of which lives in its
own layer; it does own the per-request text state (detokenizer, stop strings,
log-probs) and each streaming request's outbox.

Invariant: after every step, every page is free, cached (free with a known
hash) or held by running requests; when nothing is unfinished, no page is held.

All or nothing: every change that spans layers (the scheduler's queues, the
block manager's tables, `self.states`) happens inside `deferred_interrupts()`,
so a Ctrl-C lands before or after it, never in the middle; the forward pass
stays outside, so Ctrl-C stays prompt. One lock serialises `add_request`,
`step` and `abort`, so a second thread can use the engine without corrupting
it (`LLM` holds its own lock around a whole `generate` call).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.engine.constraints import ConstraintCompiler
from pagedllm.engine.request_text import RequestText
from pagedllm.engine_config import EngineConfig
from pagedllm.kv import BlockManager
from pagedllm.request import FinishReason, Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import RequestRejected, RequestUpdate, Scheduler, SchedulerConfig
from pagedllm.tokenizer import Tokenizer
from pagedllm.utils import deferred_interrupts, plural

if TYPE_CHECKING:
    from pagedllm.model import LlamaModel
    from pagedllm.runner.model_runner import RunnerOutput

# Without --max-model-len, a model is served up to this many positions (Llama
# 3.1's own limit): a config that claims millions would otherwise cost a RoPE
# table of gigabytes and block tables as wide, for contexts nobody sends.
DEFAULT_MAX_MODEL_LEN_CAP = 131072
Logprobs = dict[int, float]


@dataclass
class RequestState:
    """Engine-side state of one request beyond what the scheduler sees."""

    request: Request
    # Incremental detokenization runs only when someone reads text as it comes
    # (streaming or stop strings); otherwise the text is decoded once at the end.
    text_state: RequestText | None
    text: str = ""  # text returned so far (stop strings removed)
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    on_output: Callable[[StepOutput], None] | None = None  # see add_request
    detokenize: bool = True  # False: ids only, its caller owns the text (add_request)


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    state: RequestState | None = None

    @property
    def request_id(self) -> int:
        return self.request.request_id

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.request.finish_reason if self.finished else None


class EngineStalledError(RuntimeError):
    """A step could make no progress: requests wait, none runs, and none can start."""


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel | None = None,
        tokenizer: Tokenizer | None = None,
        log=print,
        *,
        load_tokenizer: bool = True,
    ) -> None:
        """`tokenizer` None: the model's own is loaded, unless `load_tokenizer` is
        False (the engine core of `pagedllm serve`: the HTTP process owns the text
        and sends the tokenizer's end-of-turn ids, `add_eos_token_ids`)."""
        # The layers with tensors, imported here: the engine's own modules need no torch.
        from pagedllm.cpu_threads import apply_thread_policy
        from pagedllm.model.loader import holds_fp8_weights, weight_bytes
        from pagedllm.runner.model_runner import (
            ModelRunner,
            free_device_bytes,
            kv_cache_dtype,
            load_or_check_model,
            plan_kv_cache,
        )

        self.config = config
        self.num_threads = apply_thread_policy(config.threads)
        t0 = time.perf_counter()
        max_positions = config.max_model_len or DEFAULT_MAX_MODEL_LEN_CAP
        # Tensor parallelism: the other ranks start first, so they load their
        # shards while this process loads rank 0's.
        self.workers = _start_workers(config, model, max_positions)
        try:
            model = load_or_check_model(
                config, model, max_positions, None if self.workers is None else self.workers.tp
            )
            if tokenizer is None and load_tokenizer and model.source_path is not None:
                tokenizer = load_model_tokenizer(model.source_path, log)
            self.model = model
            self.tokenizer = tokenizer
            # Bytes of the weights on the device (rank 0's under tensor parallelism;
            # FP8 projections at a byte a value): --stats, /metrics.
            self.weight_bytes = weight_bytes(model)
            self.weights_fp8 = holds_fp8_weights(model)
            self.weights_packed = model.packed  # CPU: GGUF blocks kept
            self.load_time_s = time.perf_counter() - t0
            mc = model.config
            if tokenizer is not None:
                check_vocab_sizes(mc.vocab_size, tokenizer.vocab_size, log)
            # The positions the model was loaded for: its own limit, or fewer when it
            # was loaded with a smaller max_model_len (its RoPE table ends there).
            positions = min(mc.max_position_embeddings, model.max_positions)
            max_model_len = config.max_model_len or positions
            if config.max_model_len is None and positions < mc.max_position_embeddings:
                log(
                    f"max_model_len {positions} of the model's {mc.max_position_embeddings} "
                    f"positions; pass --max-model-len (max_model_len) for more"
                )
            if max_model_len > positions:
                raise ValueError(
                    f"max_model_len {max_model_len} exceeds the {positions} positions "
                    f"this model was loaded for; give at most {positions}"
                )
            self.max_model_len = max_model_len
            free_bytes = None
            if self.workers is not None:  # every rank's pool is the same size: the least
                self.workers.send(("free_memory", None))
                free_bytes = self.workers.tp.min_over_ranks(
                    free_device_bytes(model.device), model.device
                )
            kv_spec, why = plan_kv_cache(
                model,
                config.block_size,
                config.kv_cache_mib,
                max_model_len,
                config.max_num_seqs,
                kv_cache_dtype(config.kv_cache_dtype, model),
                free_bytes=free_bytes,
                ranks=config.tensor_parallel_size,
            )
            self.kv_spec = kv_spec
            per_rank = "" if self.workers is None else f" per rank (x{config.tensor_parallel_size})"
            log(
                f"KV cache: {plural(kv_spec.num_blocks, 'page')} of {kv_spec.block_size} tokens "
                f"= {plural(kv_spec.num_tokens, 'token')}, {kv_spec.mib:.1f} MiB{per_rank}"
                f"{'' if kv_spec.dtype == model.dtype else ' in ' + _dtype_name(kv_spec.dtype)}; "
                f"sized by {why}"
            )
            runner_settings = dict(
                kv_spec=kv_spec,
                max_model_len=max_model_len,
                max_num_seqs=config.max_num_seqs,
                # Not yet with tensor parallelism: a replayed graph runs no Python, and the
                # workers' collectives would need graphs of their own.
                use_cuda_graphs=config.cuda_graphs_wanted() and self.workers is None,
                ops_mode=config.ops_mode(),
                max_num_batched_tokens=config.max_num_batched_tokens,
            )
            t_runner = time.perf_counter()
            self.runner = ModelRunner(model, workers=self.workers, **runner_settings)
            if self.runner.graphs is not None:  # the start-up's longest part on a GPU
                prefill = self.runner.prefill_graphs.timings
                log(
                    f"KV pool and CUDA graphs ready in {time.perf_counter() - t_runner:.1f} s "
                    f"(Triton compiles on first launch): decode {self.runner.graphs.timings}"
                    + ("" if prefill is None else f"; prefill {prefill}")
                )
            if self.workers is not None:
                self.workers.send(("runner", runner_settings))  # each builds the same runner
        except BaseException:
            self.close()
            raise
        self.block_manager = BlockManager(
            kv_spec.num_blocks, kv_spec.block_size, enable_caching=config.prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len,
                model_max_len=mc.max_position_embeddings,
                batching=config.batching,
                admission=config.admission,
                chunked_prefill=config.chunked_prefill,
            ),
            self.block_manager,
        )
        self.eos_token_ids = frozenset(mc.eos_token_ids) | frozenset(
            tokenizer.eos_token_ids if tokenizer is not None else ()
        )
        self.vocab_size = mc.vocab_size
        self.generation_defaults = dict(mc.generation_defaults)
        self.states: dict[int, RequestState] = {}
        self._ids = itertools.count()
        # Outputs not yet returned by step() (e.g. of requests aborted between steps).
        self._pending: list[StepOutput] = []
        # A step queued on the device whose results the next _step collects
        # (async scheduling only; a runner LaunchedStep).
        self._inflight = None
        # With tensor parallelism too: a queued step's input ids, sampled on rank 0's
        # device, reach the workers by a broadcast (ModelRunner._forward).
        self.async_scheduling = config.async_scheduling_wanted(model.device.type)
        self.num_steps_planned_ahead = 0
        # A timeline.StepRecorder while pictures are wanted (`pagedllm --plot`); else None.
        self.recorder = None
        # Streaming requests' outputs, until `stream()` has handed out the last one.
        self._outboxes: dict[int, deque[StepOutput]] = {}
        self._lock = threading.RLock()
        self.num_steps = 0
        self.num_decode_steps = 0
        self.num_requests = 0
        self.num_output_tokens = 0
        # Constrained decoding (structured/): constraints compile off this thread;
        # a request waits here, outside the scheduler, until its matcher exists.
        # `tokenizer_loader`: how the engine core (which loads no tokenizer) gets
        # one the first time a constraint needs its vocabulary.
        self.tokenizer_loader: Callable[[], Tokenizer | None] | None = None
        self._constraints: ConstraintCompiler | None = None
        self._compiling: list[tuple[Request, Future]] = []
        # The admitted requests with a matcher, until they finish: while there are
        # none, a step does no constrained-decoding work at all (no per-row scans).
        self._constrained: list[Request] = []

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent). An engine of one
        process holds nothing that needs closing."""
        if self.workers is not None:
            self.workers.close()

    # ------------------------------------------------------------------
    def add_eos_token_ids(self, ids: Iterable[int]) -> None:
        """More ids that end a request (a tokenizer's end-of-turn tokens), for
        requests added from now on. Ids past the vocabulary are ignored, as a
        GGUF's are (config.py)."""
        with self._lock:
            more = frozenset(i for i in ids if 0 <= i < self.vocab_size)
            self.eos_token_ids = self.eos_token_ids | more

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        stream: bool = False,
        incremental_text: bool = False,
        on_output: Callable[[StepOutput], None] | None = None,
        detokenize: bool = True,
    ) -> Request:
        """Queue a request; raises RequestRejected (a ValueError) if it can never run.

        `stream`: its outputs also wait in an outbox for `stream(request)`.
        `incremental_text` (implied by `stream` and `on_output`): each output
        carries the text of its new tokens; otherwise the text is decoded once,
        at the end. `on_output`: called with each of its outputs, on the thread
        that steps the engine (keep it short). `detokenize=False`: its outputs
        carry token ids only, and its caller matches stop strings itself (the
        engine-core process of `pagedllm serve`: the HTTP process owns the text).

        All or nothing: a rejected request is never queued and leaves no state
        behind, so it costs the others nothing. `params` is validated again
        here (a SamplingParams may have been changed after it was built)."""
        with self._lock:
            rid = next(self._ids)
            ids = _check_prompt_ids(prompt_token_ids, rid, self.vocab_size)
            params = _check_params(params, rid).resolved(self.generation_defaults)
            req = Request(
                request_id=rid,
                prompt_token_ids=ids,
                sampling_params=params,
                eos_token_ids=self.eos_token_ids,
            )
            if params.stop and (self.tokenizer is None or not detokenize):
                _reject(
                    req,
                    f"request {rid}: stop strings need a tokenizer, and this model has none; "
                    f"use stop_token_ids",
                )
            compiled = None
            if params.structured is not None:
                problem = self.scheduler.rejection(req)
                if problem is not None:
                    _reject(req, problem)
                compiled = self._compiler().submit(params.structured)
            incremental = incremental_text or stream or on_output is not None
            state = self._new_state(req, incremental and detokenize, on_output)
            state.detokenize = detokenize
            with deferred_interrupts():
                self.states[rid] = state
                try:
                    if compiled is None:
                        self.scheduler.add_request(req)  # raises RequestRejected with the numbers
                    else:  # scheduled once its constraint is compiled (_admit_compiled)
                        self._compiling.append((req, compiled))
                except BaseException:
                    del self.states[rid]
                    raise
                if stream:
                    self._outboxes[rid] = deque()
                self.num_requests += 1
            return req

    def _compiler(self) -> ConstraintCompiler:
        if self._constraints is None:
            if self.tokenizer is None and self.tokenizer_loader is None:
                raise ValueError(
                    "structured output needs the model's tokenizer (its vocabulary as "
                    "text), and this model has none"
                )
            self._constraints = ConstraintCompiler(self.tokenizer, self.tokenizer_loader)
        return self._constraints

    def _admit_compiled(self, wait_s: float = 0.0) -> None:
        """Requests whose constraints have compiled go to the scheduler, each with
        its matcher; one whose constraint failed ends with the reason. With
        `wait_s`, wait that long for the first when nothing else can run."""
        if not self._compiling:
            return
        if wait_s and not self.scheduler.has_unfinished():
            wait_futures([f for _, f in self._compiling], wait_s, FIRST_COMPLETED)
        waiting = []
        with deferred_interrupts():
            for req, fut in self._compiling:
                if req.is_finished:  # aborted while compiling: abort() reported it
                    continue
                if not fut.done():
                    waiting.append((req, fut))
                    continue
                error = fut.exception()
                if error is None:
                    req.matcher = fut.result().matcher()
                    try:
                        self.scheduler.add_request(req)
                        self._constrained.append(req)
                        continue
                    except RequestRejected as e:
                        error = e
                req.error = f"request {req.request_id}: {error}"
                req.finish(FinishReason.ERROR)
                state = self.states.get(req.request_id)
                if state is not None:
                    self._report_final(req, state)
            self._compiling = waiting

    def _new_state(
        self,
        req: Request,
        incremental: bool,
        on_output: Callable[[StepOutput], None] | None,
    ) -> RequestState:
        params = req.sampling_params
        text = None
        if self.tokenizer is not None and (incremental or params.stop):
            text = RequestText(self.tokenizer, params, req.prompt_token_ids)
        return RequestState(
            req,
            text,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            on_output=on_output,
        )

    def abort(self, req: Request | int, report: bool = True) -> None:
        """Finish a request now (finish_reason "abort"), keeping the tokens it made;
        its pages go back to the pool (or stay in the prefix cache).

        `req` is a Request or its id. Safe to call for any request, at any
        time between steps, more than once. With `report`, the next `step()`
        returns its final StepOutput (all its text), as does `stream()`.
        """
        with self._lock, deferred_interrupts():
            if not isinstance(req, Request):
                state = self.states.get(req)
                if state is None:
                    return  # unknown, or already finished and reported
                req = state.request
            if not req.is_finished:
                if self.scheduler.owns(req):
                    self.scheduler.finish_request(req, FinishReason.ABORT)
                else:
                    req.finish(FinishReason.ABORT)
            state = self.states.get(req.request_id)
            if state is None or state.request is not req:
                return
            self._report_final(req, state, report)
            self._drop_finished_inflight()

    def _report_final(self, req: Request, state: RequestState, report: bool = True) -> None:
        """A request that finished outside a step (aborted, or its constraint failed):
        its last output to whoever listens (`step()` when `report`), and its state gone."""
        box = self._outboxes.get(req.request_id)
        if report or box is not None or state.on_output is not None:
            out = self._postprocess_safely(req, state, [])
            if report:
                self._pending.append(out)
            if box is not None:
                box.append(out)  # a stream always sees its end
            if state.on_output is not None:
                state.on_output(out)
        self.states.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return (
            bool(self._pending)
            or self._inflight is not None
            or bool(self._compiling)
            or self.scheduler.has_unfinished()
        )

    # ------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One engine step; returns what changed for each request that ran
        (and the final output of each request aborted since the last step).

        Outputs wait in `self._pending` until they are returned: a Ctrl-C that
        lands in the step's bookkeeping (raised when that block ends) loses
        none of them; the next `step()` returns them."""
        with self._lock:
            self._admit_compiled(wait_s=0.05)
            if self.scheduler.has_unfinished() or self._inflight is not None:
                self._step()
            results, self._pending = self._pending, []
            return results

    def _step(self) -> None:
        """Finish one step; with async scheduling, queue the next one first.

        Without it: plan, launch, collect, bookkeeping. With it, a step whose
        successor can be planned before it ends (`schedule_continuation`: an
        all-decode step) has that successor queued on the device before this
        step's results are read, so the GPU runs it while the host does this
        step's bookkeeping; the successor is collected by the next `_step`."""
        launched = plan = successor = queued = None
        advanced: list[tuple[Request, bool]] = []
        if self._constrained:  # forget the finished; the runner masks while any is left
            self._constrained = [r for r in self._constrained if not r.is_finished]
        self.runner.masking = bool(self._constrained)
        try:
            launched, self._inflight = self._inflight, None
            plan = launched.plan if launched is not None else None
            # 1. Decide what runs, unless it was decided (and queued) last step.
            if launched is None:
                with deferred_interrupts():
                    plan = self.scheduler.schedule()
                if not plan.scheduled:
                    self._raise_stalled()
                # 2. Lists -> tensors -> logits -> sampled ids, queued on the device.
                # Interruptible: nothing below changes bookkeeping until step 3
                # but the page names, which undo_step takes back.
                launched = self.runner.launch(plan)
                # The full pages this step fills get their prefix-cache names
                # while the device runs it (a long prompt's hashes cost ~0.1 ms).
                with deferred_interrupts():
                    self.scheduler.name_pages(plan)
            if self.async_scheduling:
                with deferred_interrupts():
                    successor = self.scheduler.schedule_continuation(plan)
                if successor is not None:
                    # With constrained rows only its forward pass is queued: their
                    # masks need this step's tokens (sample_deferred, below).
                    self._inflight = queued = self.runner.launch(successor, feed=launched)
                    self.num_steps_planned_ahead += 1
            # The sampled ids on the host (the step's one wait for the device).
            result = self.runner.collect(launched)
            if self._constrained:
                # The matchers consume this step's tokens now, while the successor's
                # forward pass runs, so that its masks can be made and its sampling
                # queued before this step's bookkeeping. What a token means for its
                # request (an error, the end) is decided after `update`.
                with deferred_interrupts():
                    advanced = self._advance_matchers(plan.scheduled, result.sampled_token_ids)
                if self._inflight is not None:
                    self.runner.sample_deferred(self._inflight)
        except BaseException:
            # A failed step is undone (its tokens are planned again; the pages
            # it named are unnamed), whether it failed in the runner or a Ctrl-C
            # landed at the end of the planning; so is a successor planned on it,
            # and so are the matchers' steps over its tokens and the seeded
            # generators' draws for both (the successor's first: it drew last).
            self._inflight = None
            with deferred_interrupts():
                for req, ok in advanced:
                    if ok:
                        req.matcher.rollback(1)
                for undone in (queued, launched):
                    if undone is not None:
                        self.runner.restore_generators(undone)
                if successor is not None:
                    self.scheduler.undo_step(successor)
                if plan is not None:
                    self.scheduler.undo_step(plan)
            raise
        with deferred_interrupts():
            self.num_steps += 1
            self.num_decode_steps += int(not plan.is_prefill)
            # 3. Bookkeeping: advance computed tokens, append samples, token-level stops.
            self._record_prompt_logprobs(result)
            updates = self.scheduler.update(plan, result.sampled_token_ids)
            if advanced:
                self._finish_constrained(advanced)
            # 4. Detokenize, check stop strings, report.
            self._pending += self.process(updates, plan.scheduled, result)
            self._drop_finished_inflight()
            if self.recorder is not None:
                self.recorder.record(self, plan)

    def _advance_matchers(
        self, scheduled: Sequence[Request], sampled: list[int | None]
    ) -> list[tuple[Request, bool]]:
        """Each running constrained request's matcher consumes its new token (in
        one batch, `structured.advance_matchers`); each with whether the
        constraint accepted it. A request finished before this step's tokens (by
        a stop string or an abort, still in a successor planned ahead) is left."""
        reqs, tokens = [], []
        for req, token in zip(scheduled, sampled):
            if req.matcher is not None and token is not None and not req.is_finished:
                reqs.append(req)
                tokens.append(token)
        if not reqs:
            return []
        from pagedllm.structured import advance_matchers  # loaded with the first constraint

        return list(zip(reqs, advance_matchers([r.matcher for r in reqs], tokens)))

    def _finish_constrained(self, advanced: list[tuple[Request, bool]]) -> None:
        """After `update`: a token the constraint rejected ends its request with the
        reason; a matcher that only EOS could follow ends it as a stop (its text is
        complete)."""
        for req, ok in advanced:
            if req.is_finished:  # by this token (EOS, max_tokens): nothing more to decide
                continue
            m = req.matcher
            if not ok:
                req.error = (
                    f"request {req.request_id}: {m.error or 'token rejected by its constraint'}"
                )
                self.scheduler.finish_request(req, FinishReason.ERROR)
            elif m.is_finished:
                self.scheduler.finish_request(req, FinishReason.STOP)

    def _drop_finished_inflight(self) -> None:
        """Forget a queued step whose every row has finished since it was planned
        (by a stop, an abort): nothing of it would be read."""
        queued = self._inflight
        if queued is not None and all(r.is_finished for r in queued.plan.scheduled):
            self._inflight = None

    def process(
        self, updates: list[RequestUpdate], scheduled: Sequence[Request], result: RunnerOutput
    ) -> list[StepOutput]:
        """Turn the scheduler's updates into outputs: log-probs, text, stop strings."""
        logprobs: dict[int, Logprobs | None] | None = None  # built when someone asked
        outputs = []
        for update in updates:
            req = update.request
            state = self.states.get(req.request_id)
            if state is None:
                continue
            if state.logprobs is not None:
                if logprobs is None:
                    logprobs = {r.request_id: lp for r, lp in zip(scheduled, result.logprobs)}
                if logprobs.get(req.request_id) is not None:
                    state.logprobs.append(logprobs[req.request_id])
            self.num_output_tokens += len(update.new_token_ids)
            out = self._postprocess_safely(req, state, update.new_token_ids)
            box = self._outboxes.get(req.request_id)
            if box is not None:
                box.append(out)
            if state.on_output is not None:
                state.on_output(out)
            outputs.append(out)
        return outputs

    def stream(self, req: Request) -> Iterator[StepOutput]:
        """The outputs of a request added with `stream=True`, as they come, the
        last one with `finished` set.

        Steps the engine while the request's outbox is empty (other requests'
        outputs go to their own outboxes, or are returned by those steps to
        nobody: share an engine between callers through streams). Leaving the
        loop early (a closed client, an exception) aborts the request.
        """
        box = self._outboxes.get(req.request_id)
        if box is None:
            raise ValueError(
                f"request {req.request_id} was not added with stream=True "
                f"(or its stream was read to the end already)"
            )
        finished = False
        try:
            while not finished:
                with self._lock:
                    if not box:
                        if req.is_finished and req.request_id not in self.states:
                            return  # ended with no output left (cannot happen; be safe)
                        self.step()
                    items = list(box)
                    box.clear()
                for out in items:
                    finished = finished or out.finished
                    yield out
        finally:
            if not finished:
                self.abort(req, report=False)
            self._outboxes.pop(req.request_id, None)

    def _raise_stalled(self) -> None:
        """Nothing could be scheduled although requests are unfinished: say why."""
        s, bm = self.scheduler, self.block_manager
        head = s.waiting[0] if s.waiting else None
        msg = (
            f"the engine can make no progress: {plural(s.num_waiting, 'request')} waiting, "
            f"{s.num_running} running"
        )
        if head is not None:
            msg += (
                f"; the head of the queue (request {head.request_id}) needs "
                f"{plural(bm.reservation_blocks(head), 'page')} and "
                f"{bm.num_free_blocks} of {bm.num_blocks} are free"
            )
        try:
            s.check_invariants()
        except AssertionError as e:
            msg += f"; broken invariant: {e}"
        raise EngineStalledError(msg)

    def _record_prompt_logprobs(self, result: RunnerOutput) -> None:
        """Append this step's prompt log-probs. Entries come with the prompt
        index of their first one: a request recomputing its prompt after a
        preemption sends entries it has already, which are skipped."""
        for request_id, (start, entries) in result.prompt_logprobs.items():
            state = self.states.get(request_id)
            if state is None or state.prompt_logprobs is None:
                continue
            have = len(state.prompt_logprobs)
            if start > have:
                raise RuntimeError(
                    f"request {request_id}: prompt log-probs from index {start}, have {have}"
                )
            state.prompt_logprobs.extend(entries[have - start :])

    def _postprocess_safely(
        self, req: Request, state: RequestState, new_ids: list[int]
    ) -> StepOutput:
        """`_postprocess`, but an error finishes this one request, never the batch."""
        try:
            return self._postprocess(req, state, new_ids)
        except Exception as e:
            req.error = f"request {req.request_id}: {type(e).__name__}: {e}"
            self._finish(req, FinishReason.ERROR)
            self.states.pop(req.request_id, None)
            return StepOutput(req, new_ids, "", True, state)

    def _postprocess(self, req: Request, state: RequestState, new_ids: list[int]) -> StepOutput:
        finished = req.is_finished
        tok = self.tokenizer
        if tok is None or not state.detokenize or (not finished and state.text_state is None):
            if finished:  # ids only, or no text read until the end
                self.states.pop(req.request_id, None)
            return StepOutput(req, new_ids, "", finished, state)
        ids = new_ids
        if state.text_state is None:
            # Nobody read the text as it came: decode all of it once, now.
            state.text_state = RequestText(tok, req.sampling_params, req.prompt_token_ids)
            ids = req.output_token_ids
        piece, matched = state.text_state.feed(
            ids, req.num_output_tokens, finished, req.stop_reason
        )
        if matched is not None:
            self._finish(req, FinishReason.STOP, matched)  # over a length stop, too
        state.text += piece
        if req.is_finished:
            self.states.pop(req.request_id, None)
        return StepOutput(req, new_ids, piece, req.is_finished, state)

    def _finish(self, req: Request, reason: FinishReason, stop_reason: str | None = None) -> None:
        if req.is_finished:
            self.scheduler.restate_finish(req, reason, stop_reason)
        else:
            self.scheduler.finish_request(req, reason, stop_reason)

    # ------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters since this engine was built (`pages_free` is the pool now)."""
        s = self.scheduler
        bm = self.block_manager
        per_block = self.kv_spec.bytes_per_token * self.kv_spec.block_size / 2**20
        queried = s.num_cache_query_tokens
        return {
            "requests": self.num_requests,
            "output_tokens": self.num_output_tokens,
            "threads": self.num_threads,
            "peak_active_requests": s.peak_running,
            "max_decode_batch": s.max_decode_batch,
            "admission": s.config.admission,
            "admission_waits": s.num_admission_waits,
            "preemptions": s.num_preemptions,
            "prefix_caching": bm.enable_caching,
            "prefix_cache_query_tokens": queried,
            "prefix_cache_hit_tokens": s.num_cache_hit_tokens,
            "prefix_cache_hit_rate": round(s.num_cache_hit_tokens / queried, 4) if queried else 0.0,
            "pages_total": bm.num_blocks,
            "pages_peak_used": bm.peak_used_blocks,
            "pages_free": bm.num_free_blocks,
            "pages_cached": bm.pool.num_cached,
            "prefix_cache_evictions": bm.pool.num_evictions,
            "pages_total_mib": round(bm.num_blocks * per_block, 2),
            "pages_peak_used_mib": round(bm.peak_used_blocks * per_block, 2),
            "pages_free_mib": round(bm.num_free_blocks * per_block, 2),
            "block_size": self.kv_spec.block_size,
            "kv_cache_dtype": _dtype_name(self.kv_spec.dtype),
            "weight_bytes": self.weight_bytes,
            "weights_fp8": self.weights_fp8,
            "weights_packed": self.weights_packed,
            "prefill_tokens": s.num_prefill_tokens,
            "decode_tokens": s.num_decode_tokens,
            "steps": self.num_steps,
            "decode_steps": self.num_decode_steps,
            "async_scheduling": self.async_scheduling,
            "steps_planned_ahead": self.num_steps_planned_ahead,
            "host_time_per_step_ms": round(
                1e3 * self.runner.host_time_s / max(1, self.runner.num_steps), 3
            ),
        }


def _dtype_name(dtype) -> str:
    """torch.float8_e4m3fn -> "float8_e4m3fn" (no torch import here)."""
    return str(dtype).removeprefix("torch.")


def _reject(req: Request, message: str) -> None:
    req.error = message
    req.finish(FinishReason.REJECTED)
    raise RequestRejected(message)


def _check_prompt_ids(ids: Any, rid: int, vocab_size: int) -> list[int]:
    """A list of ints in [0, vocab_size), or RequestRejected naming the request."""
    if isinstance(ids, (str, bytes, dict, set, frozenset)) or not isinstance(ids, Sequence):
        tolist = getattr(ids, "tolist", None)  # a 1-D tensor or ndarray of ints
        if tolist is None or getattr(ids, "ndim", None) != 1:
            raise RequestRejected(
                f"request {rid}: prompt token ids must be a list of integers, "
                f"got {type(ids).__name__}"
            )
        ids = tolist()
    if type(ids) in (list, tuple) and set(map(type, ids)) <= {int}:
        # The usual case, checked at C speed: 1,024 ids in ~35 us on a development
        # machine against ~55 us for the per-id loop below.
        out = list(ids)
    else:
        out = []
        for t in ids:
            if isinstance(t, bool):
                raise RequestRejected(
                    f"request {rid}: prompt token ids must be integers, got {t!r}"
                )
            try:
                out.append(operator.index(t))
            except TypeError:
                raise RequestRejected(
                    f"request {rid}: prompt token ids must be integers, "
                    f"got {t!r} ({type(t).__name__})"
                ) from None
    if out and (min(out) < 0 or max(out) >= vocab_size):
        bad = [t for t in out if not 0 <= t < vocab_size]
        raise RequestRejected(
            f"request {rid}: prompt token ids {bad[:5]} are outside the model's vocabulary "
            f"[0, {vocab_size})"
        )
    return out


def _check_params(params: Any, rid: int) -> SamplingParams:
    """Validate `params` again: a SamplingParams is mutable, and may have been
    changed after it was built. The error names the request."""
    if not isinstance(params, SamplingParams):
        raise RequestRejected(
            f"request {rid}: sampling params must be a SamplingParams, got {type(params).__name__}"
        )
    try:
        return dataclasses.replace(params)  # runs __post_init__'s checks
    except ValueError as e:
        raise RequestRejected(f"request {rid}: {e}") from None


def check_vocab_sizes(model_vocab: int, tokenizer_vocab: int, log) -> None:
    """The tokenizer may know fewer ids than the model has embedding rows (rows
    padded to a round number); never more, or text could encode to ids the
    model cannot embed."""
    if tokenizer_vocab > model_vocab:
        raise ValueError(
            f"the tokenizer has {tokenizer_vocab} ids but the model's embedding has only "
            f"{model_vocab} rows; the tokenizer does not belong to this model"
        )
    if tokenizer_vocab < model_vocab:
        log(
            f"note: the model has {model_vocab} embedding rows and the tokenizer "
            f"{tokenizer_vocab} ids; generated ids past {tokenizer_vocab - 1} have no text"
        )


def load_model_tokenizer(model_path, log) -> Tokenizer | None:
    """The model's tokenizer, or None (token-id prompts only) when it ships none.
    (The server's HTTP process loads it too, for its own text work.)"""
    if model_path.is_dir() and not (model_path / "tokenizer.json").is_file():
        log(f"{model_path} has no tokenizer.json: prompts must be token ids")
        return None
    if model_path.is_file() and model_path.suffix.lower() == ".gguf":
        from pagedllm.gguf_metadata import read_gguf_metadata

        if "tokenizer.ggml.model" not in read_gguf_metadata(model_path, "tokenizer.ggml.model"):
            log(
                f"{model_path} carries no tokenizer (tokenizer.ggml.model): prompts must be token ids"
            )
            return None
    return Tokenizer.from_model_path(model_path)


__all__ = [
    "EngineConfig",
    "EngineStalledError",
    "LLMEngine",
    "RequestRejected",
    "RequestStatus",
    "StepOutput",
]


def _start_workers(config: EngineConfig, model: Any, max_positions: int):
    """Ranks 1..N-1 of a tensor-parallel engine (None when tensor_parallel_size is 1)."""
    if config.tensor_parallel_size == 1:
        return None
    from pagedllm.model.loader import (
        check_load_format,
        read_model_config,
        resolve_device,
        resolve_dtype,
    )
    from pagedllm.model.parallel import check_divisible
    from pagedllm.resolve import resolve_model_path
    from pagedllm.runner.tp_workers import TPWorkers, WorkerSetup

    if model is not None:
        raise ValueError(
            "tensor_parallel_size > 1 loads the model in every rank's process: give the "
            "model's path (model=...), not a loaded model"
        )
    # What can be known before any process starts is checked here, so that it is a
    # plain ValueError (a worker that fails ends the whole process: tp_workers.py).
    path = resolve_model_path(config.model)
    check_divisible(read_model_config(path), config.tensor_parallel_size)
    check_load_format(path, config.load_format)
    device = resolve_device(config.device)
    resolve_dtype(config.dtype, device)  # a bad dtype: a ValueError here, not in a worker
    if device.index not in (None, 0):
        raise ValueError(
            f"device={str(config.device)!r}: with tensor parallelism rank r runs on cuda:r; "
            "give device='cuda'"
        )
    setup = WorkerSetup(
        str(path),
        device.type,
        None if config.dtype is None else str(config.dtype).removeprefix("torch."),
        max_positions,
        config.threads,
        config.load_format,
        config.quantization,
    )
    return TPWorkers(config.tensor_parallel_size, setup)
