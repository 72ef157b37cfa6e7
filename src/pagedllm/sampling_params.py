"""Per-request sampling and stopping parameters (vLLM's names and ranges).

Owns: validation and the resolution of unset fields. A bad value (or a value of
the wrong type) raises `ValueError` naming the field and the allowed range, at
construction, before the request reaches the engine. Does not own: the
sampling itself (`sampling/sampler.py`) or stop-string matching
(`engine/stop_strings.py`).

Unset versus default. The five fields a model's `generation_config.json` may
set (`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`) default
to `None`, meaning "the user did not say". `resolved(model_defaults)` fills
them, in this order: the user's value, then the model's default, then vLLM's
default (temperature 1.0, top_p 1.0, top_k 0 = off, min_p 0.0,
repetition_penalty 1.0). A model default of `do_sample: false` makes an unset
temperature 0 (greedy), as transformers does. The engine resolves each request
once, when it is added; code that reads unresolved params sees vLLM's defaults.

Greedy: `temperature=0` (or `top_k=1`) means greedy; `SamplingParams.greedy_params()`
builds such params. `top_k=-1` is accepted as vLLM's spelling of "off" and stored
as 0. `stop` and `stop_token_ids` are stored as tuples (empty when absent).

The dataclass is mutable for compatibility, but treat it as a value: derive
new params with `dataclasses.replace`, which validates again.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

# vLLM's defaults for the fields a model's generation_config.json may override.
VLLM_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,  # 0 = off
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
# generation_config.json keys that `resolved()` reads; any other key is ignored.
MODEL_DEFAULT_KEYS = (*VLLM_DEFAULTS, "do_sample")
MAX_LOGPROBS = 20
# Below this a temperature counts as 0 (greedy); vLLM's _SAMPLING_EPS.
GREEDY_TEMPERATURE_EPS = 1e-5


def _check_int(name: str, value: Any, lo: int | None, hi: int | None, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")


def _check_float(name: str, value: Any, ok: bool | None, allowed: str) -> float:
    """`ok` is the range test on the value; None while the type is still unknown."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
    if not ok:
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
    return float(value)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


_read_defaulted_fields = operator.attrgetter(*VLLM_DEFAULTS)


@dataclass
class SamplingParams:
    max_tokens: int = 16  # >= 1: new tokens at most
    ignore_eos: bool = False  # keep going past the model's EOS ids
    temperature: float | None = None  # >= 0; 0 = greedy; None = model/vLLM default (1.0)
    top_k: int | None = None  # 0 (or -1) = off, else >= 1; None = default (off)
    top_p: float | None = None  # (0, 1]; None = default (1.0, off)
    min_p: float | None = None  # [0, 1]; None = default (0.0, off)
    repetition_penalty: float | None = None  # > 0; 1 = off; None = default (1.0)
    presence_penalty: float = 0.0  # [-2, 2], over output tokens
    frequency_penalty: float = 0.0  # [-2, 2], over output tokens
    seed: int | None = None  # per-request generator: same seed, same tokens
    min_tokens: int = 0  # [0, max_tokens]: EOS / stop ids / stop strings ignored before
    stop: str | Sequence[str] | None = None  # stored as tuple[str, ...]
    stop_token_ids: Sequence[int] | None = None  # stored as tuple[int, ...]
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # [0, 20]: top-k log-probs of each sampled token
    prompt_logprobs: int | None = None  # [0, 20]: the same for each prompt token
    skip_special_tokens: bool = True
    # Constrained decoding (issue 37): a `structured.StructuredOutput`, or the
    # keywords that build one (a dict: {"json": schema}, {"regex": ...}, ...).
    structured: Any = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, None, ">= 1")
        _check_int("min_tokens", self.min_tokens, 0, None, ">= 0")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        self._check_model_defaultable()
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and -2.0 <= v <= 2.0
            setattr(self, name, _check_float(name, v, ok, "in [-2, 2]"))
        if self.seed is not None:
            _check_int("seed", self.seed, None, None, "(or None)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                _check_int(name, v, 0, MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}] (or None)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        if self.structured is not None:
            from pagedllm.structured import StructuredOutput

            if isinstance(self.structured, Mapping):
                self.structured = StructuredOutput(**self.structured)
            elif not isinstance(self.structured, StructuredOutput):
                raise ValueError(
                    "structured must be a StructuredOutput or a dict of its keywords "
                    f"(json=, json_object=, regex=, choice=, grammar=), got {self.structured!r}"
                )

    def _check_model_defaultable(self) -> None:
        """The five fields that may be None (unset); floats are stored as float."""
        checks = {
            "temperature": (lambda v: v >= 0.0, ">= 0"),
            "top_p": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
            "min_p": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
            "repetition_penalty": (lambda v: v > 0.0, "> 0"),
        }
        for name, (test, allowed) in checks.items():
            v = getattr(self, name)
            if v is not None:
                ok = isinstance(v, (int, float)) and test(v)
                setattr(self, name, _check_float(name, v, ok, f"{allowed} (or None)"))
        if self.top_k is not None:
            _check_int("top_k", self.top_k, -1, None, "0 or -1 (off) or >= 1 (or None)")
            if self.top_k == -1:
                self.top_k = 0

    # ------------------------------------------------------------ resolution
    @property
    def is_resolved(self) -> bool:
        # One C call for the five fields (the sampler asks for every request, every step).
        return None not in _read_defaulted_fields(self)

    def resolved(
        self, model_defaults: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None
    ) -> SamplingParams:
        """A copy with every unset field filled: the model's default, then vLLM's.

        `model_defaults` holds generation_config.json keys (a dict, or
        `ModelConfig.generation_defaults`, a tuple of pairs). Keys other than
        temperature, top_p, top_k, min_p, repetition_penalty and do_sample are
        ignored; `do_sample: false` turns an unset temperature into 0 (greedy).
        An invalid model default raises ValueError saying so.
        """
        d = dict(model_defaults or {})
        updates: dict[str, Any] = {}
        for name, vllm_default in VLLM_DEFAULTS.items():
            if getattr(self, name) is not None:
                continue
            if name == "temperature" and d.get("do_sample") is False:
                updates[name] = 0.0
            elif d.get(name) is not None:
                updates[name] = d[name]
            else:
                updates[name] = vllm_default
        if not updates:
            return self
        try:
            return replace(self, **updates)
        except ValueError as e:  # self was valid, so a model default is not
            raise ValueError(f"generation_config.json default: {e}") from e

    @classmethod
    def greedy_params(cls, max_tokens: int = 16, **kwargs: Any) -> SamplingParams:
        """Greedy decoding (temperature 0), whatever the model's defaults say."""
        return cls(max_tokens=max_tokens, temperature=0.0, **kwargs)

    # ------------------------------------------------------------ derived
    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature ~0 or top_k == 1 (unset fields: vLLM defaults)."""
        temperature = VLLM_DEFAULTS["temperature"] if self.temperature is None else self.temperature
        return temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1


def _normalise_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings (or None), got {stop!r}")
    if any(s == "" for s in stop):
        raise ValueError("stop must not contain an empty string")
    return tuple(stop)


def _normalise_stop_token_ids(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    ok = isinstance(ids, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    )
    if not ok:
        raise ValueError(f"stop_token_ids must be a list of integers >= 0 (or None), got {ids!r}")
    return tuple(ids)
