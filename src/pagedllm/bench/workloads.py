"""The three standard workloads of `docs/gpu.md`, drawn exactly as written there,
and the shared-prefix workload of `pagedllm bench prefix`.

Owns: the prompts (token-id lists) and per-request output lengths of each
workload, and the check that the throughput draw is the published one. Does
not own: running them (`ours.py`, `hf_peer.py`) or reporting (`report.py`).

Invariant: `draw_throughput(256)` (no scaling) has sum(max_tokens) == 133,966,
the figure every engine that publishes this workload reports against.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pagedllm.utils import plural

THROUGHPUT_NUM_REQUESTS = 256
THROUGHPUT_SUM_MAX_TOKENS = 133_966  # sum(max_tokens) of the 256-request draw
DRAW_MIN_LEN, DRAW_MAX_LEN = 100, 1024  # prompt and output lengths are drawn in this range
PROMPT_ID_HIGH = 10_000  # prompt ids are drawn in [0, 10000] (randint is inclusive)


@dataclass(frozen=True)
class Workload:
    """Prompts as token ids, and the exact number of new tokens each request makes."""

    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    description: str

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def fold_to_vocab(ids: list[int], vocab_size: int | None) -> list[int]:
    """Map ids into [0, vocab_size) for models smaller than the draw (tiny test models)."""
    if vocab_size is None or vocab_size > PROMPT_ID_HIGH:
        return ids
    return [t % vocab_size for t in ids]


def _scale(n: int, limit: int | None) -> int:
    """Shrink a drawn length in proportion, so that DRAW_MAX_LEN becomes `limit`."""
    if limit is None:
        return n
    return max(1, math.ceil(n * limit / DRAW_MAX_LEN))


def draw_throughput(
    num_requests: int = THROUGHPUT_NUM_REQUESTS,
    max_prompt_len: int | None = None,
    max_output_len: int | None = None,
    vocab_size: int | None = None,
) -> Workload:
    """Workload 1: the draw of docs/gpu.md, with `num_requests` in place of 256.

    With `max_prompt_len` / `max_output_len` (small CPU runs) every drawn length
    is scaled by limit/1024 (rounded up): the same mix of short and long
    requests, shorter. Prompts keep the prefix of their drawn ids.
    """
    # 1. The draw, verbatim from docs/gpu.md (prompts first, then all output lengths).
    rng = random.Random(0)
    prompts = [
        [rng.randint(0, PROMPT_ID_HIGH) for _ in range(rng.randint(DRAW_MIN_LEN, DRAW_MAX_LEN))]
        for _ in range(num_requests)
    ]
    max_tokens = [rng.randint(DRAW_MIN_LEN, DRAW_MAX_LEN) for _ in range(num_requests)]
    if num_requests == THROUGHPUT_NUM_REQUESTS:
        total = sum(max_tokens)
        assert total == THROUGHPUT_SUM_MAX_TOKENS, f"sum(max_tokens) is {total}, not 133,966"
    # 2. Optional reduction for small machines, then fit the ids to the model.
    prompts = [fold_to_vocab(p[: _scale(len(p), max_prompt_len)], vocab_size) for p in prompts]
    max_tokens = [_scale(m, max_output_len) for m in max_tokens]
    scaled = max_prompt_len is not None or max_output_len is not None
    desc = f"{plural(num_requests, 'request')} drawn with random.Random(0) as in docs/gpu.md"
    if scaled:
        desc += (
            f", lengths scaled to prompt <= {max_prompt_len or DRAW_MAX_LEN}, "
            f"output <= {max_output_len or DRAW_MAX_LEN}"
        )
    return Workload("throughput", prompts, max_tokens, desc)


def fixed_throughput(
    num_requests: int, prompt_len: int, output_len: int, vocab_size: int | None = None
) -> Workload:
    """All at once, every request the same lengths: `vllm bench serve --dataset-name
    random`'s shape (each prompt its own random ids, so none shares a cached
    prefix), to set the engine alone beside a server that ran the same draw."""
    prompts = [random_prompt(prompt_len, vocab_size, seed=i) for i in range(num_requests)]
    desc = (
        f"{plural(num_requests, 'request')} of {plural(prompt_len, 'prompt token')} and "
        f"{plural(output_len, 'new token')} each, random ids (seed = request index)"
    )
    return Workload("throughput", prompts, [output_len] * num_requests, desc)


def random_prompt(length: int, vocab_size: int | None = None, seed: int = 0) -> list[int]:
    """`length` random ids in [0, 10000], folded into the vocabulary if it is smaller."""
    rng = random.Random(seed)
    return fold_to_vocab([rng.randint(0, PROMPT_ID_HIGH) for _ in range(length)], vocab_size)


def latency_workload(
    prompt_len: int = 128, output_len: int = 512, vocab_size: int | None = None
) -> Workload:
    """Workload 2: one request, batch 1, greedy, EOS ignored."""
    return Workload(
        "latency",
        [random_prompt(prompt_len, vocab_size)],
        [output_len],
        f"batch 1, prompt {plural(prompt_len, 'token')}, {plural(output_len, 'new token')}",
    )


def ttft_workload(prompt_len: int = 1024, vocab_size: int | None = None) -> Workload:
    """Workload 3: one request with a long prompt and a single new token."""
    return Workload(
        "ttft",
        [random_prompt(prompt_len, vocab_size)],
        [1],
        f"one request, prompt {plural(prompt_len, 'token')}, max_tokens 1",
    )


PREFIX_NUM_REQUESTS, PREFIX_LEN, PREFIX_SUFFIX_LEN, PREFIX_OUTPUT_LEN = 256, 1024, 100, 128


def prefix_workload(
    num_requests: int = PREFIX_NUM_REQUESTS,
    prefix_len: int = PREFIX_LEN,
    suffix_len: int = PREFIX_SUFFIX_LEN,
    output_len: int = PREFIX_OUTPUT_LEN,
    vocab_size: int | None = None,
) -> Workload:
    """`num_requests` prompts: one shared `prefix_len`-token prefix (a long system
    prompt, a few-shot preamble), then each request's own `suffix_len` tokens.

    Ids are drawn with random.Random(0): the prefix first, then the suffixes in
    request order, so a smaller draw is a prefix of a larger one.
    """
    rng = random.Random(0)
    shared = [rng.randint(0, PROMPT_ID_HIGH) for _ in range(prefix_len)]
    prompts = [
        fold_to_vocab(
            shared + [rng.randint(0, PROMPT_ID_HIGH) for _ in range(suffix_len)], vocab_size
        )
        for _ in range(num_requests)
    ]
    return Workload(
        "prefix",
        prompts,
        [output_len] * num_requests,
        f"{plural(num_requests, 'request')} sharing a {prefix_len}-token prefix, each with its "
        f"own {suffix_len}-token suffix, {plural(output_len, 'new token')}",
    )


def reusable_prompt_share(w: Workload, prefix_len: int, block_size: int) -> float:
    """The most a prefix cache can reuse: the shared prefix's full pages of every
    request but the first, over all prompt tokens (a page is shared only when full)."""
    reusable = (w.num_requests - 1) * (prefix_len // block_size) * block_size
    return reusable / w.prompt_tokens if w.prompt_tokens else 0.0


def warmup_workload(vocab_size: int | None = None) -> Workload:
    """The short request run before every measurement (not timed)."""
    return Workload("warm-up", [random_prompt(16, vocab_size, seed=1)], [8], "warm-up")
