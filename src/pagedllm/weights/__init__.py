"""Weight readers: safetensors (our own parser) and GGUF (on the `gguf` package's constants).

Owns: turning files on disk into Hugging Face-named torch tensors, and checking
an FP8 checkpoint's float8 weights against their scales (`fp8.py`). Does not
own: model configuration (`pagedllm.config`) or fusing Q/K/V and gate/up (the
model does that at load time, with `fp8.fuse_fp8` for FP8 weights).
"""

from typing import Any

__all__ = [
    "GGUFFile",
    "SafetensorsFile",
    "load_gguf_state_dict",
    "load_hf_state_dict",
    "load_safetensors_dir",
]


def __getattr__(name: str) -> Any:
    # Each reader is imported when asked for: GGUF support needs the `gguf` package
    # (safetensors loading works where it is missing: the GPU machine), and the
    # safetensors reader imports torch (a GGUF's headers are read without it).
    if name in ("GGUFFile", "load_gguf_state_dict"):
        from pagedllm.weights import gguf

        return getattr(gguf, name)
    if name in ("SafetensorsFile", "load_hf_state_dict", "load_safetensors_dir"):
        from pagedllm.weights import safetensors

        return getattr(safetensors, name)
    raise AttributeError(f"module 'pagedllm.weights' has no attribute {name!r}")
