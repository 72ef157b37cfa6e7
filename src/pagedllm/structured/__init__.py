"""Constrained decoding (placeholder docstring; the design note follows)."""

from pagedllm.structured.constraint import StructuredOutput
from pagedllm.structured.matcher import (
    CompiledConstraint,
    ConstraintCache,
    Matcher,
    TokenizerAdapter,
    bitmask_words,
    constraint_cache,
    fill_bitmask,
    tokenizer_adapter,
)

__all__ = [
    "CompiledConstraint",
    "ConstraintCache",
    "Matcher",
    "StructuredOutput",
    "TokenizerAdapter",
    "bitmask_words",
    "constraint_cache",
    "fill_bitmask",
    "tokenizer_adapter",
]
