"""LLMEngine: the step loop that carries requests from prompt to finished text.

Owns: wiring the layers together and the order of one step (DESIGN.md):
schedule -> build the batch -> forward -> sample -> scheduler.update ->
detokenize and check stop strings. Does not own: any of those steps' logic,
each of which lives in its own layer.

Invariant: after every step, every page is either free or reserved by exactly
one running request; when nothing is unfinished, every page is free.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.kv import BlockManager
from pagedllm.model import LlamaModel, load_model
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

BATCHING_POLICIES = ("continuous", "static")


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

    def __post_init__(self) -> None:
        if self.batching not in BATCHING_POLICIES:
            raise ValueError(
                f"batching={self.batching!r} is not a policy; choose one of {BATCHING_POLICIES}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


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


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel | None = None,
        tokenizer: Tokenizer | None = None,
        log=print,
    ) -> None:
        self.config = config
        t0 = time.perf_counter()
        if model is None:
            model = load_model(resolve_model_path(config.model), config.device, config.dtype)
        if tokenizer is None and model.source_path is not None:
            tokenizer = _load_tokenizer(model.source_path, log)
        self.model = model
        self.tokenizer = tokenizer
        self.load_time_s = time.perf_counter() - t0
        mc = model.config
        max_model_len = config.max_model_len or mc.max_position_embeddings
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's "
                f"{mc.max_position_embeddings} positions"
            )
        self.max_model_len = max_model_len
        kv_spec, why = plan_kv_cache(
            model, config.block_size, config.kv_cache_mib, max_model_len, config.max_num_seqs
        )
        self.kv_spec = kv_spec
        log(
            f"KV cache: {kv_spec.num_blocks} pages x {kv_spec.block_size} tokens = "
            f"{kv_spec.num_tokens} tokens, {kv_spec.mib:.1f} MiB ({why})"
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
        self.num_steps = 0
        self.num_decode_steps = 0

    # ------------------------------------------------------------------
    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, stream: bool = False
    ) -> Request:
        """Queue a request; raises RequestRejected (a ValueError) if it can never run.

        A rejected request is never queued, so it costs the others nothing."""
        params = params.resolved(self.generation_defaults)
        req = Request(
            request_id=next(self._ids),
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
        )
        vocab = self.model.config.vocab_size
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            self._reject(req, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            self._reject(
                req, "stop strings need a tokenizer, and this model has none; use stop_token_ids"
            )
        # Build the engine-side state first, so nothing half-made is ever queued.
        matcher = StopStringMatcher.from_params(params) if params.stop else None
        detok = None
        if self.tokenizer is not None and (stream or matcher is not None):
            detok = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens
            )
        state = RequestState(
            req,
            detok,
            matcher,
            generator=make_generator(params.seed, self.model.device),
            logprobs=[] if params.logprobs is not None else None,
        )
        self.scheduler.add_request(req)  # raises RequestRejected with the numbers
        self.states[req.request_id] = state
        return req

    @staticmethod
    def _reject(req: Request, message: str) -> None:
        req.error = message
        req.finish(FinishReason.REJECTED)
        raise RequestRejected(message)

    def abort(self, req: Request) -> None:
        if not req.is_finished:
            self.scheduler.finish_request(req, FinishReason.ABORT)
        self.states.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One engine step; returns what changed for each request that ran."""
        # 1. Decide what runs.
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        reqs, num_new = list(out.scheduled), list(out.num_new_tokens)
        # 2-3. Lists -> tensors -> logits of each request's last new token (and of
        # every prompt token, for requests that asked for prompt log-probs).
        full = frozenset(
            i
            for i, r in enumerate(reqs)
            if r.sampling_params.prompt_logprobs is not None and r.num_computed_tokens == 0
        )
        logits = self.runner.execute(reqs, num_new, full)  # (B or more, V) float32
        if full:
            logits = self._record_prompt_logprobs(logits, reqs, num_new, full)
        # 4. Sample; the sampled ids are the one device-to-host copy.
        states = [self.states[r.request_id] for r in reqs]
        meta = SamplingMetadata.from_requests(
            reqs, self.model.config.vocab_size, self.model.device, [s.generator for s in states]
        )
        sampler_out = self.sampler(logits, meta)
        sampled = sampler_out.sampled_token_ids.tolist()
        self.num_steps += 1
        self.num_decode_steps += int(not out.is_prefill)
        # 5. Bookkeeping: advance computed tokens, append samples, token-level stops.
        before = [r.num_output_tokens for r in reqs]
        self.scheduler.update(out, sampled)
        if sampler_out.logprobs is not None:
            self._record_logprobs(sampler_out.logprobs, reqs, states, before)
        # 6. Detokenize, check stop strings, report.
        results = []
        for req, state, n_before in zip(reqs, states, before):
            new_ids = req.output_token_ids[n_before:]
            if new_ids or req.is_finished:
                results.append(self._postprocess(req, state, new_ids))
        return results

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

    def _postprocess(self, req: Request, state: RequestState, new_ids: list[int]) -> StepOutput:
        params = req.sampling_params
        # A token that finished the request by id (EOS, stop_token_ids) is not text.
        stopped_by_id = req.is_finished and req.stop_reason is not None and new_ids
        text_ids = new_ids[:-1] if stopped_by_id and new_ids[-1] == req.stop_reason else new_ids
        piece = ""
        if state.detokenizer is not None:
            piece = state.detokenizer.add_many(text_ids)
            if req.is_finished:
                piece += state.detokenizer.finish()
            if state.stop_matcher is not None:
                piece = self._check_stop_strings(req, state.stop_matcher, piece)
        elif req.is_finished and self.tokenizer is not None:
            ids = req.output_token_ids
            if stopped_by_id and ids and ids[-1] == req.stop_reason:
                ids = ids[:-1]
            piece = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
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
        s = self.scheduler
        bm = self.block_manager
        per_block = self.kv_spec.bytes_per_token * self.kv_spec.block_size / 2**20
        return {
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


def _load_tokenizer(model_path, log) -> Tokenizer | None:
    """The model's tokenizer, or None (token-id prompts only) when it ships none."""
    if model_path.is_dir() and not (model_path / "tokenizer.json").is_file():
        log(f"{model_path} has no tokenizer.json: prompts must be token ids")
        return None
    return Tokenizer.from_model_path(model_path)


__all__ = ["EngineConfig", "LLMEngine", "RequestRejected", "RequestStatus", "StepOutput"]
