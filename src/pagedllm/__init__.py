"""pagedllm: a from-scratch LLM inference engine, readable end to end.

    from pagedllm import LLM, SamplingParams

`LLM` is imported lazily so that the torch-free layers (scheduler, block
manager, tokenizer) can be used and tested without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from pagedllm.engine.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pagedllm.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
