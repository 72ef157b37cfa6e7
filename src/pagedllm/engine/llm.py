"""LLM: the offline Python API (`from pagedllm import LLM, SamplingParams`).

Owns: turning prompts (strings, token ids or chat conversations) into
requests, driving the engine until they finish, and packaging the outputs.
Does not own: anything numeric (engine and below).

    llm = LLM()                                  # the default SmolLM2 model
    outs = llm.generate(["The KV cache is"], SamplingParams(max_tokens=32))
    print(outs[0].text, outs[0].finish_reason)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from pagedllm.engine.llm_engine import EngineConfig, LLMEngine, StepOutput
from pagedllm.model import LlamaModel
from pagedllm.request import FinishReason, Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import RequestRejected

Prompt = str | list[int]
Message = dict[str, str]


@dataclass
class RequestOutput:
    request_id: int | None
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length" or "rejected"
    stop_reason: int | str | None = None  # the EOS/stop id or stop string that ended it
    error: str | None = None  # why it was rejected
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
        model: str | LlamaModel | None = None,
        device: str | None = None,
        dtype: str | None = None,
        kv_cache_mib: float | None = None,
        block_size: int = 16,
        batching: str = "continuous",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 16384,
        log: Callable[[str], None] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if isinstance(model, LlamaModel):  # an already loaded model (tests, notebooks)
            engine_kwargs["model"] = model
            model = None
        config = EngineConfig(
            model=model,
            device=device,
            dtype=dtype,
            kv_cache_mib=kv_cache_mib,
            block_size=block_size,
            batching=batching,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self.engine = LLMEngine(config, log=log or (lambda s: None), **engine_kwargs)
        self.tokenizer = self.engine.tokenizer
        self._last_run: dict[str, Any] = {}

    # ------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        on_step: Callable[[list[StepOutput]], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings are tokenized with BOS, no chat template)."""
        prompt_list = _as_prompt_list(prompts)
        texts, token_lists = [], []
        for p in prompt_list:
            if isinstance(p, str):
                texts.append(p)
                token_lists.append(self._encode(p))
            else:
                texts.append(None)
                token_lists.append(list(p))
        return self._run(texts, token_lists, sampling_params, use_tqdm, on_step)

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
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # one conversation
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
        return self._run(texts, token_lists, sampling_params, use_tqdm, on_step)

    def stats(self) -> dict[str, Any]:
        """The figures of `--stats` (engine totals plus the last generate call)."""
        return {**self.engine.stats(), **self._last_run}

    # ------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer; pass token ids instead of text")
        return self.tokenizer.encode(text, add_special_tokens=True)

    def _run(
        self,
        texts: list[str | None],
        token_lists: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool | None,
        on_step: Callable[[list[StepOutput]], None] | None,
    ) -> list[RequestOutput]:
        params = _as_params_list(sampling_params, len(token_lists))
        t0 = time.perf_counter()
        outputs: list[RequestOutput] = []
        live: dict[int, tuple[Request, RequestOutput]] = {}
        bar = None
        try:
            # 1. Submit. A request that can never run is rejected alone (or raises,
            #    when it is the only one); the others go on.
            for text, ids, sp in zip(texts, token_lists, params):
                out = RequestOutput(None, text, ids)
                try:
                    req = self.engine.add_request(ids, sp, stream=on_step is not None)
                except RequestRejected as e:
                    if len(token_lists) == 1:
                        raise
                    out.finish_reason, out.error = str(FinishReason.REJECTED), str(e)
                else:
                    out.request_id = req.request_id
                    live[req.request_id] = (req, out)
                outputs.append(out)
            # 2. Step until every request is done.
            show = use_tqdm if use_tqdm is not None else len(live) >= 16
            bar = tqdm(total=len(live), desc="requests", unit="req", disable=not show)
            while self.engine.has_unfinished():
                step = self.engine.step()
                for so in step:
                    _, out = live[so.request.request_id]
                    out.text += so.new_text
                    if so.finished:
                        _finalize(so.request, out)
                        if so.state is not None:
                            out.logprobs = so.state.logprobs
                            out.prompt_logprobs = so.state.prompt_logprobs
                        bar.update(1)
                if on_step is not None:
                    on_step(step)
        except BaseException:
            for req, _ in live.values():  # never leave requests or pages behind us
                self.engine.abort(req)
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


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        return [list(prompts)]  # one prompt given as token ids
    return list(prompts)


def _as_params_list(
    sp: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(
            f"got {len(sp)} SamplingParams for {n} prompts; give one or one per prompt"
        )
    return sp
