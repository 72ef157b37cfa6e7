"""LLMEngine: the step loop that carries requests from prompt to finished text.

Owns: wiring the layers together and the order of one step
(docs/architecture.md, "A request's life"):
schedule -> build the batch -> forward -> sample -> scheduler.update ->
detokenize and check stop strings. Does not own: any of those steps' logic,
each of which lives in its own layer.

Invariant: after every step, every page is either free or reserved by exactly
one running request; when nothing is unfinished, every page is free.

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
import math
import operator
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.cpu_threads import apply_thread_policy
from pagedllm.kv import BlockManager
from pagedllm.model import LlamaModel, load_model
from pagedllm.model.loader import resolve_device, resolve_dtype
from pagedllm.model.resolve import resolve_model_path
from pagedllm.request import FinishReason, Request, RequestStatus
from pagedllm.runner.model_runner import ModelRunner, plan_kv_cache
from pagedllm.sampling import (
    Sampler,
    SamplingMetadata,
    StopStringMatcher,
    compute_logprobs,
    make_generator,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import RequestRejected, Scheduler, SchedulerConfig
from pagedllm.tokenizer import IncrementalDetokenizer, Tokenizer
from pagedllm.utils import deferred_interrupts, plural

BATCHING_POLICIES = ("continuous", "static")
# Without --max-model-len, a model is served up to this many positions (Llama
# 3.1's own limit): a config that claims millions would otherwise cost a RoPE
# table of gigabytes and block tables as wide, for contexts nobody sends.
DEFAULT_MAX_MODEL_LEN_CAP = 131072


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    kv_cache_mib: float | None = None
    block_size: int = 16
    batching: str = "continuous"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    threads: int | None = None  # torch CPU threads; None = cpu_threads.py's policy

    def __post_init__(self) -> None:
        """Check every value before anything is loaded (a load can take many seconds)."""
        if self.batching not in BATCHING_POLICIES:
            raise ValueError(
                f"batching={self.batching!r} is not a policy; choose one of {BATCHING_POLICIES}"
            )
        _check_int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2)
        if self.threads is not None:
            _check_int("threads", self.threads, 1)
        mib = self.kv_cache_mib
        if mib is not None and (
            isinstance(mib, bool)
            or not isinstance(mib, (int, float))
            or not math.isfinite(mib)
            or mib <= 0
        ):
            raise ValueError(
                f"kv_cache_mib must be a positive, finite number of MiB (or None for the "
                f"default), got {mib!r}"
            )
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be a path (or None for the default), got {self.model!r}")
        for name in ("device", "dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, torch.device, torch.dtype)):
                raise ValueError(f"{name} must be a string (or None), got {value!r}")


def _check_int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")


@dataclass
class RequestState:
    """Engine-side state of one request beyond what the scheduler sees."""

    request: Request
    # Incremental detokenization runs only when someone reads text as it comes
    # (streaming or stop strings); otherwise the text is decoded once at the end.
    detokenizer: IncrementalDetokenizer | None
    stop_matcher: StopStringMatcher | None
    generator: torch.Generator | None = None
    text: str = ""  # text returned so far (stop strings removed)
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    state: RequestState | None = None


class EngineStalledError(RuntimeError):
    """A step could make no progress: requests wait, none runs, and none can start."""


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel | None = None,
        tokenizer: Tokenizer | None = None,
        log=print,
    ) -> None:
        self.config = config
        self.num_threads = apply_thread_policy(config.threads)
        t0 = time.perf_counter()
        if model is None:
            model = load_model(
                resolve_model_path(config.model),
                config.device,
                config.dtype,
                max_model_len=config.max_model_len or DEFAULT_MAX_MODEL_LEN_CAP,
            )
        else:
            _check_model_matches(model, config)
        if tokenizer is None and model.source_path is not None:
            tokenizer = _load_tokenizer(model.source_path, log)
        self.model = model
        self.tokenizer = tokenizer
        self.load_time_s = time.perf_counter() - t0
        mc = model.config
        if tokenizer is not None:
            _check_vocab_sizes(mc.vocab_size, tokenizer.vocab_size, log)
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
        kv_spec, why = plan_kv_cache(
            model, config.block_size, config.kv_cache_mib, max_model_len, config.max_num_seqs
        )
        self.kv_spec = kv_spec
        log(
            f"KV cache: {plural(kv_spec.num_blocks, 'page')} of {kv_spec.block_size} tokens "
            f"= {plural(kv_spec.num_tokens, 'token')}, {kv_spec.mib:.1f} MiB; sized by {why}"
        )
        if model.device.type == "cuda":
            # Triton launches and graph capture use the current device.
            torch.cuda.set_device(model.device)
        self.runner = ModelRunner(model, kv_spec, max_model_len, config.max_num_seqs)
        self.block_manager = BlockManager(kv_spec.num_blocks, kv_spec.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len,
                model_max_len=mc.max_position_embeddings,
                batching=config.batching,
            ),
            self.block_manager,
        )
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(mc.eos_token_ids) | frozenset(
            tokenizer.eos_token_ids if tokenizer is not None else ()
        )
        self.generation_defaults = dict(mc.generation_defaults)
        self.states: dict[int, RequestState] = {}
        self._ids = itertools.count()
        # Final outputs of aborted requests, handed out by the next step().
        self._pending: list[StepOutput] = []
        self._lock = threading.RLock()
        self.num_steps = 0
        self.num_decode_steps = 0
        self.num_requests = 0
        self.num_output_tokens = 0

    # ------------------------------------------------------------------
    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, stream: bool = False
    ) -> Request:
        """Queue a request; raises RequestRejected (a ValueError) if it can never run.

        All or nothing: a rejected request is never queued and leaves no state
        behind, so it costs the others nothing. `params` is validated again
        here (a SamplingParams may have been changed after it was built)."""
        with self._lock:
            rid = next(self._ids)
            ids = _check_prompt_ids(prompt_token_ids, rid, self.model.config.vocab_size)
            params = _check_params(params, rid).resolved(self.generation_defaults)
            req = Request(
                request_id=rid,
                prompt_token_ids=ids,
                sampling_params=params,
                eos_token_ids=self.eos_token_ids,
            )
            if params.stop and self.tokenizer is None:
                _reject(
                    req,
                    f"request {rid}: stop strings need a tokenizer, and this model has none; "
                    f"use stop_token_ids",
                )
            state = self._new_state(req, stream)
            with deferred_interrupts():
                self.states[rid] = state
                try:
                    self.scheduler.add_request(req)  # raises RequestRejected with the numbers
                except BaseException:
                    del self.states[rid]
                    raise
                self.num_requests += 1
            return req

    def _new_state(self, req: Request, stream: bool) -> RequestState:
        params = req.sampling_params
        matcher = StopStringMatcher.from_params(params) if params.stop else None
        detok = None
        if self.tokenizer is not None and (stream or matcher is not None):
            detok = self._detokenizer(req)
        return RequestState(
            req,
            detok,
            matcher,
            generator=make_generator(params.seed, self.model.device),
            logprobs=[] if params.logprobs is not None else None,
        )

    def _detokenizer(self, req: Request) -> IncrementalDetokenizer:
        # The prompt's ids prime it: a prompt given as ids may end inside a
        # UTF-8 character, which the first generated token then completes.
        tok = self.tokenizer
        assert tok is not None
        return IncrementalDetokenizer(
            tok,
            prompt_ids=[t for t in req.prompt_token_ids if t < tok.vocab_size],
            skip_special_tokens=req.sampling_params.skip_special_tokens,
        )

    def abort(self, req: Request, report: bool = True) -> None:
        """Finish `req` now (finish_reason "abort"), keeping the tokens it made.

        Safe to call for any request, at any time, more than once. With
        `report`, the next `step()` returns its final StepOutput (all its text).
        """
        with self._lock, deferred_interrupts():
            if not req.is_finished:
                if self.scheduler.owns(req):
                    self.scheduler.finish_request(req, FinishReason.ABORT)
                else:
                    req.finish(FinishReason.ABORT)
            state = self.states.get(req.request_id)
            if state is None or state.request is not req:
                return
            if report:
                self._pending.append(self._postprocess_safely(req, state, []))
            self.states.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished()

    # ------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One engine step; returns what changed for each request that ran
        (and the final output of each request aborted since the last step)."""
        with self._lock:
            if not self.scheduler.has_unfinished():
                with deferred_interrupts():
                    results, self._pending = self._pending, []
                return results
            # 1. Decide what runs.
            with deferred_interrupts():
                out = self.scheduler.schedule()
            if not out.scheduled:
                self._raise_stalled()
            reqs, num_new = list(out.scheduled), list(out.num_new_tokens)
            states = [self.states[r.request_id] for r in reqs]
            # 2-4. Lists -> tensors -> logits -> sampled ids (one device-to-host copy).
            # Interruptible: nothing below changes bookkeeping until step 5.
            sampled, sampler_out = self._forward_and_sample(reqs, num_new, states)
            with deferred_interrupts():
                self.num_steps += 1
                self.num_decode_steps += int(not out.is_prefill)
                # 5. Bookkeeping: advance computed tokens, append samples, token-level stops.
                before = [r.num_output_tokens for r in reqs]
                self.scheduler.update(out, sampled)
                if sampler_out.logprobs is not None:
                    self._record_logprobs(sampler_out.logprobs, reqs, states, before)
                # 6. Detokenize, check stop strings, report.
                results, self._pending = self._pending, []
                for req, state, n_before in zip(reqs, states, before):
                    new_ids = req.output_token_ids[n_before:]
                    self.num_output_tokens += len(new_ids)
                    if new_ids or req.is_finished:
                        results.append(self._postprocess_safely(req, state, new_ids))
            return results

    def _forward_and_sample(
        self, reqs: list[Request], num_new: list[int], states: list[RequestState]
    ) -> tuple[list[int], Any]:
        # Logits of each request's last new token (and of every prompt token,
        # for requests that asked for prompt log-probs).
        full = frozenset(
            i
            for i, r in enumerate(reqs)
            if r.sampling_params.prompt_logprobs is not None and r.num_computed_tokens == 0
        )
        logits = self.runner.execute(reqs, num_new, full)  # (B or more, V) float32
        if full:
            logits = self._record_prompt_logprobs(logits, reqs, num_new, full)
        meta = SamplingMetadata.from_requests(
            reqs, self.model.config.vocab_size, self.model.device, [s.generator for s in states]
        )
        sampler_out = self.sampler(logits, meta)
        return sampler_out.sampled_token_ids.tolist(), sampler_out

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

    def _record_prompt_logprobs(
        self, logits: torch.Tensor, reqs: list[Request], num_new: list[int], full: frozenset[int]
    ) -> torch.Tensor:
        """Store prompt log-probs (vLLM's format: None for the first token, then
        {id: logprob} with the prompt's own token and the top k); return the
        (B, V) logits of each request's last token."""
        last_rows, row = [], 0
        for i, (req, n) in enumerate(zip(reqs, num_new)):
            if i not in full:
                last_rows.append(row)
                row += 1
                continue
            k = req.sampling_params.prompt_logprobs
            prompt = req.prompt_token_ids
            entries: list[dict[int, float] | None] = [None]
            if n > 1:
                target = torch.tensor(prompt[1:n], device=logits.device)
                lp = compute_logprobs(logits[row : row + n - 1], k, target)
                ids, tok = lp.token_ids.tolist(), lp.token_logprobs.tolist()
                top_ids, top_lp = lp.topk_ids.tolist(), lp.topk_logprobs.tolist()
                for j in range(n - 1):
                    entry = dict(zip(top_ids[j][:k], top_lp[j][:k]))
                    entry[ids[j]] = tok[j]
                    entries.append(entry)
            self.states[req.request_id].prompt_logprobs = entries
            row += n
            last_rows.append(row - 1)
        return logits[torch.tensor(last_rows, device=logits.device)]

    def _record_logprobs(self, lp, reqs, states, before) -> None:
        ids, token_lp = lp.token_ids.tolist(), lp.token_logprobs.tolist()
        top_ids, top_lp = lp.topk_ids.tolist(), lp.topk_logprobs.tolist()
        for i, (req, state) in enumerate(zip(reqs, states)):
            if state.logprobs is None or req.num_output_tokens == before[i]:
                continue
            k = req.sampling_params.logprobs
            entry = dict(zip(top_ids[i][:k], top_lp[i][:k]))
            entry[ids[i]] = token_lp[i]
            state.logprobs.append(entry)

    def _postprocess_safely(
        self, req: Request, state: RequestState, new_ids: list[int]
    ) -> StepOutput:
        """`_postprocess`, but an error finishes this one request, never the batch."""
        try:
            return self._postprocess(req, state, new_ids)
        except Exception as e:
            req.error = f"request {req.request_id}: {type(e).__name__}: {e}"
            if not req.is_finished:
                self.scheduler.finish_request(req, FinishReason.ERROR)
            else:
                req.finish_reason = FinishReason.ERROR
            self.states.pop(req.request_id, None)
            return StepOutput(req, new_ids, "", True, state)

    def _postprocess(self, req: Request, state: RequestState, new_ids: list[int]) -> StepOutput:
        tok = self.tokenizer
        # A token that finished the request by id (EOS, stop_token_ids) is not text.
        stopped_by_id = (
            bool(req.is_finished and new_ids and req.stop_reason is not None)
            and new_ids[-1] == req.stop_reason
        )
        text_ids = new_ids[:-1] if stopped_by_id else new_ids
        piece = ""
        if tok is not None and state.detokenizer is None and req.is_finished:
            # Nobody read the text as it came: decode all of it once, now.
            state.detokenizer = self._detokenizer(req)
            ids = req.output_token_ids
            text_ids = ids[:-1] if stopped_by_id else ids
        if tok is not None and state.detokenizer is not None:
            # An id past the tokenizer's vocabulary (a model with padded embedding
            # rows) has no text; it must not take the request down.
            piece = state.detokenizer.add_many([t for t in text_ids if t < tok.vocab_size])
            if req.is_finished:
                piece += state.detokenizer.finish()
            if state.stop_matcher is not None:
                piece = self._check_stop_strings(req, state.stop_matcher, piece)
        state.text += piece
        if req.is_finished:
            self.states.pop(req.request_id, None)
        return StepOutput(req, new_ids, piece, req.is_finished, state)

    def _check_stop_strings(self, req: Request, matcher: StopStringMatcher, piece: str) -> str:
        emit, matched = matcher.feed(
            piece, check=req.num_output_tokens > req.sampling_params.min_tokens
        )
        if matched is not None:
            if req.is_finished:  # finished by length in the same step: the string wins
                req.finish_reason, req.stop_reason = FinishReason.STOP, matched
            else:
                self.scheduler.finish_request(req, FinishReason.STOP, matched)
        elif req.is_finished:
            emit += matcher.flush()
        return emit

    # ------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters since this engine was built (`pages_free` is the pool now)."""
        s = self.scheduler
        bm = self.block_manager
        per_block = self.kv_spec.bytes_per_token * self.kv_spec.block_size / 2**20
        return {
            "requests": self.num_requests,
            "output_tokens": self.num_output_tokens,
            "threads": self.num_threads,
            "peak_active_requests": s.peak_running,
            "max_decode_batch": s.max_decode_batch,
            "admission_waits": s.num_admission_waits,
            "pages_total": bm.num_blocks,
            "pages_peak_used": bm.peak_used_blocks,
            "pages_free": bm.num_free_blocks,
            "pages_total_mib": round(bm.num_blocks * per_block, 2),
            "pages_peak_used_mib": round(bm.peak_used_blocks * per_block, 2),
            "pages_free_mib": round(bm.num_free_blocks * per_block, 2),
            "block_size": self.kv_spec.block_size,
            "prefill_tokens": s.num_prefill_tokens,
            "decode_tokens": s.num_decode_tokens,
            "steps": self.num_steps,
            "decode_steps": self.num_decode_steps,
            "host_time_per_step_ms": round(
                1e3 * self.runner.host_time_s / max(1, self.runner.num_steps), 3
            ),
        }


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
    out: list[int] = []
    for t in ids:
        if isinstance(t, bool):
            raise RequestRejected(f"request {rid}: prompt token ids must be integers, got {t!r}")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise RequestRejected(
                f"request {rid}: prompt token ids must be integers, got {t!r} ({type(t).__name__})"
            ) from None
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad:
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


def _check_model_matches(model: LlamaModel, config: EngineConfig) -> None:
    """An already loaded model is used as it is: a device or dtype that says
    otherwise is a mistake, not a request to convert."""
    if config.device is not None:
        want = resolve_device(config.device)
        have = model.device
        if want.type != have.type or (want.index is not None and want.index != have.index):
            raise ValueError(
                f"device={str(config.device)!r} but the model given is on {have}; "
                f"load it on that device, or leave device unset"
            )
    if config.dtype is not None:
        want_dtype = resolve_dtype(config.dtype, model.device)
        if want_dtype != model.dtype:
            raise ValueError(
                f"dtype={str(config.dtype)!r} but the model given is {model.dtype}; "
                f"load it in that dtype, or leave dtype unset"
            )


def _check_vocab_sizes(model_vocab: int, tokenizer_vocab: int, log) -> None:
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


def _load_tokenizer(model_path, log) -> Tokenizer | None:
    """The model's tokenizer, or None (token-id prompts only) when it ships none."""
    if model_path.is_dir() and not (model_path / "tokenizer.json").is_file():
        log(f"{model_path} has no tokenizer.json: prompts must be token ids")
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
