"""The sampling options of the command line, shared by `pagedllm` and `pagedllm trace`.

    --temperature T   --top-p P   --top-k K   --min-p P   --seed N

Owns: their argparse types (each value checked before a model loads: a bad
one is argparse's usage error, exit 2), their help, the keyword arguments of
`SamplingParams` they give, and the note for flags that greedy decoding
ignores. Does not own: each command's default (`cli.py`: greedy unless the
model's generation_config says otherwise; `trace.py`: greedy) or what the
values mean (`sampling_params.py`, `engine/sampler.py`).
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.engine_args import checked, number, whole_number

# Each raises argparse.ArgumentTypeError, which argparse turns into
# "PROG: error: argument --x: MESSAGE" and exit 2, before anything loads.
temperature = checked(number, lambda v: v >= 0, ">= 0 (0 is greedy)")
top_p = checked(number, lambda v: 0 < v <= 1, "in (0, 1] (1 is off)")
top_k = checked(whole_number, lambda v: v >= -1, "-1 or 0 (off) or >= 1")
min_p = checked(number, lambda v: 0 <= v <= 1, "in [0, 1] (0 is off)")

# The flags that shape sampling beyond the temperature, as SamplingParams names them.
SAMPLING_ONLY = ("top_p", "top_k", "min_p", "seed")


def add_sampling_arguments(group: argparse._ActionsContainer) -> None:
    """--temperature, --top-p, --top-k, --min-p, --seed (each None when not given)."""
    group.add_argument(
        "--temperature",
        type=temperature,
        metavar="T",
        help="> 0 samples; 0 is greedy",
    )
    group.add_argument("--top-p", type=top_p, metavar="P", help="nucleus sampling, in (0, 1]")
    group.add_argument(
        "--top-k", type=top_k, metavar="K", help="sample among the k most likely (0 or -1: off)"
    )
    group.add_argument(
        "--min-p", type=min_p, metavar="P", help="drop tokens below min_p x the top one, in [0, 1]"
    )
    group.add_argument(
        "--seed", type=whole_number, metavar="N", help="same seed, same sampled text"
    )


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `SamplingParams` fields the flags set (None: not given)."""
    return {name: getattr(args, name) for name in ("temperature", *SAMPLING_ONLY)}


def greedy_note(args: argparse.Namespace) -> str:
    """The log line of a greedy run, naming the given flags that only sampling uses."""
    ignored = [f"--{n.replace('_', '-')}" for n in SAMPLING_ONLY if getattr(args, n) is not None]
    note = f"; {', '.join(ignored)} apply only when sampling" if ignored else ""
    return f"sampling: greedy (set --temperature to sample){note}"
