"""LLM: the offline Python API (`from pagedllm import LLM, SamplingParams`).

Owns: turning prompts (strings, token ids or chat conversations) into
requests, driving the engine until they finish, and packaging the outputs.
Does not own: anything numeric (engine and below).

    llm = LLM()                                  # the default SmolLM2 model
    outs = llm.generate(["The KV cache is"], SamplingParams(max_tokens=32))
    print(outs[0].text, outs[0].finish_reason)

Threads: one `LLM` runs one `generate`/`chat` call at a time. A call from a
second thread waits for the first to finish (a lock), then runs; neither is
corrupted and no result is lost. Requests added straight to `llm.engine`
beside a call are stepped along with it and left to their owner.

Errors: a bad prompt or parameter among several prompts is rejected alone
(its output has finish_reason "rejected" and `error` says why); with a single
prompt it raises. Whatever interrupts a call (an exception, Ctrl-C), every
request of that call is aborted and its pages freed before the call returns.
"""

from __future__ import annotations

import numbers
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from pagedllm.engine.llm_engine import LLMEngine, StepOutput
from pagedllm.engine_config import EngineConfig
from pagedllm.request import FinishReason, Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import RequestRejected
from pagedllm.tokenizer import Tokenizer
from pagedllm.utils import deferred_interrupts, gc_frozen

Prompt = str | list[int]
Message = dict[str, str]


@dataclass
class RequestOutput:
    request_id: int | None
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or "rejected"
    stop_reason: int | str | None = None  # the EOS/stop id or stop string that ended it
    error: str | None = None  # why it was rejected or failed
    time_to_first_token: float | None = None  # seconds from submission
    time_per_output_token: float | None = None  # seconds, over tokens after the first
    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLM:
    def __init__(
        self,
        model: Any = None,
        *,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        log: Callable[[str], None] | None = None,
        **settings: Any,
    ) -> None:
        """`model`: a path, None for the default model, or an already loaded
        LlamaModel. `settings`: any EngineConfig field (kv_cache_mib=...,
        admission="optimistic", prefix_caching=False, ...), over `config`."""
        loaded = None
        if model is not None and not isinstance(model, (str, os.PathLike)):
            loaded, model = model, None  # an already loaded model (tests, notebooks)
        config = (config or EngineConfig()).replace(model=model, **settings)
        self.engine = LLMEngine(config, loaded, tokenizer, log=log or (lambda s: None))
        self.tokenizer = self.engine.tokenizer
        self._last_run: dict[str, Any] = {}
        self._lock = threading.Lock()  # one generate/chat call at a time

    # ------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        on_step: Callable[[list[StepOutput]], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt: a string (tokenized with BOS, no chat
        template), a list of token ids, or a 1-D integer tensor/array of them."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        texts, token_lists = [], []
        for p in prompt_list:
            if isinstance(p, str):
                texts.append(p)
                token_lists.append(self._encode(p))
            else:
                texts.append(None)
                token_lists.append(p)  # checked by the engine, which names the request
        return self._run(texts, token_lists, params, use_tqdm, on_step)

    def chat(
        self,
        conversations: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
        on_step: Callable[[list[StepOutput]], None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer; chat() needs one")
        if isinstance(conversations, (str, bytes, dict)) or not isinstance(conversations, Sequence):
            raise TypeError(
                "conversations must be a list of messages ({'role': ..., 'content': ...}) "
                f"or a list of such lists, got {type(conversations).__name__}"
            )
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # one conversation
        params = _as_params_list(sampling_params, len(conversations))
        texts, token_lists = [], []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                list(conv), add_generation_prompt=add_generation_prompt
            )
            texts.append(text)
            # The template holds BOS and the control tokens as text; a control-token
            # string typed inside a message stays plain text.
            token_lists.append(
                self.tokenizer.encode_chat(list(conv), add_generation_prompt=add_generation_prompt)
            )
        return self._run(texts, token_lists, params, use_tqdm, on_step)

    def stats(self) -> dict[str, Any]:
        """Two sets of figures, named apart.

        At the top level, the engine's counters since this LLM was built (pages
        peak used, admission waits, steps, ...; `pages_free` is the pool now).
        Under "last_call", the last generate/chat call only: its requests,
        rejected ones, prompt and output tokens, wall time, output tokens/s and
        each request's time to first token.
        """
        return {**self.engine.stats(), "last_call": dict(self._last_run)}

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done at exit)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer; pass token ids instead of text")
        return self.tokenizer.encode(text, add_special_tokens=True)

    def _run(
        self,
        texts: list[str | None],
        token_lists: list[Any],
        params: list[SamplingParams],
        use_tqdm: bool | None,
        on_step: Callable[[list[StepOutput]], None] | None,
    ) -> list[RequestOutput]:
        # gc_frozen: no full collection walks the process's objects between steps.
        with self._lock, gc_frozen():
            return self._run_locked(texts, token_lists, params, use_tqdm, on_step)

    def _run_locked(
        self,
        texts: list[str | None],
        token_lists: list[Any],
        params: list[SamplingParams],
        use_tqdm: bool | None,
        on_step: Callable[[list[StepOutput]], None] | None,
    ) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs: list[RequestOutput] = []
        live: dict[int, tuple[Request, RequestOutput]] = {}  # this call's unfinished requests
        bar = None
        try:
            # 1. Submit. A request that can never run is rejected alone (or raises,
            #    when it is the only one); the others go on. A Ctrl-C waits until
            #    every submitted request is in `live`, where the cleanup finds it.
            with deferred_interrupts():
                self._submit(texts, token_lists, params, on_step is not None, outputs, live)
            # 2. Step until every request of this call is done. Outputs of requests
            #    that others added to the engine are theirs; they are skipped here.
            show = use_tqdm if use_tqdm is not None else len(live) >= 16
            bar = tqdm(total=len(live), desc="requests", unit="req", disable=not show)
            while live:
                step = self.engine.step()
                for so in step:
                    entry = live.get(so.request.request_id)
                    if entry is None or entry[0] is not so.request:
                        continue
                    out = entry[1]
                    out.text += so.new_text
                    if so.finished:
                        _finalize(so.request, out)
                        if so.state is not None:
                            out.logprobs = so.state.logprobs
                            out.prompt_logprobs = so.state.prompt_logprobs
                        del live[so.request.request_id]
                        bar.update(1)
                if on_step is not None:
                    on_step(step)
        except BaseException:
            # Never leave requests or pages behind: abort every one of this call's
            # requests, each on its own (one failure does not stop the others), and
            # hold a second Ctrl-C until the cleanup is complete.
            with deferred_interrupts():
                for req, _ in live.values():
                    try:
                        self.engine.abort(req, report=False)
                    except Exception:  # noqa: BLE001 - the next one must still be freed
                        pass
            raise
        finally:
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - t0
        n_out = sum(len(o.token_ids) for o in outputs)
        self._last_run = {
            "requests": len(outputs),
            "rejected": sum(o.finish_reason == "rejected" for o in outputs),
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
            "output_tokens": n_out,
            "wall_time_s": round(wall, 4),
            "output_tokens_per_s": round(n_out / wall, 2) if wall > 0 else None,
            "ttft_s": [o.time_to_first_token for o in outputs],
        }
        return outputs

    def _submit(
        self,
        texts: list[str | None],
        token_lists: list[Any],
        params: list[SamplingParams],
        stream: bool,
        outputs: list[RequestOutput],
        live: dict[int, tuple[Request, RequestOutput]],
    ) -> None:
        """Add each prompt's request; fill `outputs` (all) and `live` (the accepted)."""
        for text, ids, sp in zip(texts, token_lists, params):
            out = RequestOutput(None, text, ids if isinstance(ids, list) else [])
            try:
                req = self.engine.add_request(ids, sp, incremental_text=stream)
            except RequestRejected as e:
                if len(token_lists) == 1:
                    raise
                out.finish_reason = str(FinishReason.REJECTED)
                out.error = f"prompts[{len(outputs)}]: {e}"
            else:
                out.request_id = req.request_id
                out.prompt_token_ids = req.prompt_token_ids
                live[req.request_id] = (req, out)
            outputs.append(out)


def _finalize(req: Request, out: RequestOutput) -> None:
    out.token_ids = list(req.output_token_ids)
    out.finish_reason = str(req.finish_reason) if req.finish_reason else None
    out.stop_reason = req.stop_reason
    if req.first_token_time is not None:
        out.time_to_first_token = req.first_token_time - req.arrival_time
        if req.finish_time is not None and len(req.output_token_ids) > 1:
            out.time_per_output_token = (req.finish_time - req.first_token_time) / (
                len(req.output_token_ids) - 1
            )


def _as_prompt_list(prompts: Any) -> list[Any]:
    """The call's prompts as a list: one prompt (a string, a list of ids, a 1-D
    tensor/array) or a list of prompts. Each prompt is checked when it is
    submitted, so a bad one among good ones is rejected alone."""
    if isinstance(prompts, str):
        return [prompts]
    if getattr(prompts, "ndim", None) == 1 and hasattr(prompts, "tolist"):
        return [prompts]  # one prompt as a 1-D tensor or ndarray of ids
    if isinstance(prompts, (bytes, bytearray, dict, set, frozenset)) or not isinstance(
        prompts, Sequence
    ):
        raise TypeError(
            "prompts must be a string, a list of token ids, or a list of those, "
            f"got {type(prompts).__name__}"
        )
    if prompts and all(_is_number(p) for p in prompts):
        return [list(prompts)]  # one prompt given as ids (the engine checks they are ints)
    return [_as_prompt(p) for p in prompts]


def _is_number(x: Any) -> bool:
    """An int, float or bool, a numpy scalar, or a 0-d tensor."""
    return isinstance(x, numbers.Number) or (
        hasattr(x, "__index__") and getattr(x, "ndim", None) == 0
    )


def _as_prompt(p: Any) -> Any:
    """Strings stay strings; ids are listed (the engine checks each one)."""
    if isinstance(p, str):
        return p
    if isinstance(p, (list, tuple)):
        return list(p)
    return p  # a tensor, or something wrong that add_request will name


def _as_params_list(sp: Any, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sp, SamplingParams):
        return [sp] * n
    if not isinstance(sp, (list, tuple)):
        raise TypeError(
            "sampling_params must be a SamplingParams or a list of them (one per prompt), "
            f"got {type(sp).__name__}"
            + ("; build one with SamplingParams(**your_dict)" if isinstance(sp, dict) else "")
        )
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(
            f"got {len(sp)} SamplingParams for {n} prompts; give one or one per prompt"
        )
    for i, p in enumerate(sp):
        if not isinstance(p, SamplingParams):
            raise TypeError(
                f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}"
            )
    return sp
