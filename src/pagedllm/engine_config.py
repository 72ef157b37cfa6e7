"""EngineConfig: every engine setting in one frozen dataclass (stdlib only).

Owns: the names, defaults and checks of the engine's settings. `LLM`, the CLI
(`pagedllm`, `pagedllm bench`) and the server build one of these instead of
restating the fields (the command-line flags are derived from these fields in
`engine_args.py`), so a new setting is added here once. Does not own: what the settings do (the
engine, scheduler, block manager and runner read them).

Environment switches are defaults, never overrides of an explicit setting:
`PAGEDLLM_OPS` is read when `ops` is None, `PAGEDLLM_CUDA_GRAPHS` when
`cuda_graphs` is None.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any

from pagedllm import cpu_threads  # stdlib only until a policy is applied

BATCHING_POLICIES = ("continuous", "static")
# "reserve": the seed's policy. A request reserves every page it can ever write
# at admission (ceil((prompt + max_tokens - 1) / block_size)); nothing is ever
# preempted. "optimistic": admit on the pages the prompt needs now; when decode
# runs out of pages, preempt the most recently admitted request by recompute.
ADMISSION_POLICIES = ("reserve", "optimistic")
OPS_CHOICES = ("auto", "reference", "triton")
# "auto": read the weights; "dummy": random weights of the config's shape, made on
# the device (speed work: `model` is then an HF directory, or a preset's).
LOAD_FORMATS = ("auto", "dummy")
# "auto": K/V pages in the model's dtype; "fp8": float8 e4m3, 1 byte per value with
# no scale (ops/reference.py `to_cache_dtype`): twice bf16's tokens per MiB, and
# decode attention reads half the bytes, at 3 mantissa bits of precision.
KV_CACHE_DTYPES = ("auto", "fp8")
# "none": the weights as the checkpoint stores them (an FP8 checkpoint's stay FP8 on
# CUDA); "fp8": a float checkpoint's decoder projections become float8 e4m3 with one
# scale per output channel as they load (embeddings, norms and LM head stay in the
# model's dtype, as vLLM's). On the CPU, FP8 weights are dequantized into the model's
# dtype: "fp8" then rounds each projection through FP8 and back (model/loader.py).
QUANTIZATIONS = ("none", "fp8")
MAX_NUM_SEQS = 65535  # the most programs on a CUDA grid's y and z axes


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # a path, or None for the default model
    load_format: str = "auto"  # see LOAD_FORMATS
    quantization: str = "none"  # see QUANTIZATIONS
    device: str | None = None  # "cpu", "cuda", "cuda:1"; None: CUDA when present
    dtype: str | None = None  # "float32", "bfloat16", "float16"; None: per device
    kv_cache_mib: float | None = None  # K+V of all layers; None: sized from free memory
    kv_cache_dtype: str = "auto"  # see KV_CACHE_DTYPES
    block_size: int = 16  # tokens per KV page
    batching: str = "continuous"  # "continuous": admit every step; "static": group by group
    admission: str = "reserve"  # see ADMISSION_POLICIES
    prefix_caching: bool = True  # share full pages of equal prefixes between requests
    chunked_prefill: bool = True  # split long prompts over steps; mix prefill with decode
    max_model_len: int | None = None  # prompt + output tokens of one request
    max_num_seqs: int = 256  # most requests running at once
    max_num_batched_tokens: int = 8192  # token budget of one step
    threads: int | None = None  # torch CPU threads; None: cpu_threads.py's policy
    ops: str | None = None  # "reference", "triton", "auto"; None: $PAGEDLLM_OPS or auto
    cuda_graphs: bool | None = None  # decode CUDA graphs; None: $PAGEDLLM_CUDA_GRAPHS or on
    # Queue an all-decode step's successor before reading its results, so the
    # host's bookkeeping overlaps the device's work (llm_engine._step).
    # None: on for CUDA (where the device runs ahead of the host), off on the CPU.
    async_scheduling: bool | None = None
    # Ranks (GPUs, or CPU processes) the model is split over: one process each,
    # this one rank 0 (runner/tp_workers.py). Each rank holds 1/N of the weights
    # and of the KV heads; kv_cache_mib counts one rank's pool.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        """Check every value before anything is loaded (a load can take many seconds)."""
        _check_choice("batching", self.batching, BATCHING_POLICIES)
        _check_choice("admission", self.admission, ADMISSION_POLICIES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        if self.ops is not None:
            _check_choice("ops", self.ops, OPS_CHOICES)
        for name in ("prefix_caching", "chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("cuda_graphs", "async_scheduling"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True, False or None, got {value!r}")
        _check_int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_num_seqs > MAX_NUM_SEQS:
            # The attention kernels put a step's sequences on a grid axis of at
            # most 65,535 programs.
            raise ValueError(
                f"max_num_seqs must be <= {MAX_NUM_SEQS:,} (one attention launch takes at most "
                f"that many sequences), got {self.max_num_seqs}"
            )
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_batched_tokens < self.max_num_seqs:
            # A decode step computes one token for each running request.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): a step holds one token of each running "
                f"request; or lower max_num_seqs"
            )
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2)
        if self.threads is not None:
            _check_int("threads", self.threads, 1)
            too_many = cpu_threads.too_many_threads(self.threads)
            if too_many:
                raise ValueError(f"threads must be {too_many}")
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
            # A torch.device / torch.dtype is welcome too (checked by name: no torch here).
            if value is not None and not (
                isinstance(value, str) or type(value).__module__.startswith("torch")
            ):
                raise ValueError(f"{name} must be a string (or None), got {value!r}")

    # ------------------------------------------------------------ resolved
    def ops_mode(self) -> str:
        """ "auto", "reference" or "triton": the setting, else $PAGEDLLM_OPS, else auto."""
        mode = self.ops or os.environ.get("PAGEDLLM_OPS", "auto").lower() or "auto"
        if mode not in OPS_CHOICES:
            raise ValueError(f"PAGEDLLM_OPS={mode!r}: choose one of {', '.join(OPS_CHOICES)}")
        return mode

    def cuda_graphs_wanted(self) -> bool:
        """The setting, else $PAGEDLLM_CUDA_GRAPHS ("0"/"false" turn them off), else on."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return os.environ.get("PAGEDLLM_CUDA_GRAPHS", "1").lower() not in ("0", "false", "no")

    def async_scheduling_wanted(self, device_type: str) -> bool:
        """The setting, else on for CUDA: on the CPU every op runs as it is
        called, so there is no device time for the host's work to hide behind."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device_type == "cuda"

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with `changes` (checked again)."""
        unknown = set(changes) - set(self.field_names())
        if unknown:
            raise TypeError(
                f"unknown engine setting(s) {sorted(unknown)}; "
                f"the settings are {', '.join(self.field_names())}"
            )
        return EngineConfig(**{**{n: getattr(self, n) for n in self.field_names()}, **changes})


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")


def _check_int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
