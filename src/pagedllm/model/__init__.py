"""The Llama model: `load_model` is the front door (see `loader.py`)."""

from pagedllm.model.batch import ForwardBatch
from pagedllm.model.linear import Linear
from pagedllm.model.llama import LlamaModel
from pagedllm.model.loader import (
    build_model,
    dummy_model,
    load_model,
    resolve_device,
    resolve_dtype,
)

__all__ = [
    "ForwardBatch",
    "Linear",
    "LlamaModel",
    "build_model",
    "dummy_model",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]
