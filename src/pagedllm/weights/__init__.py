"""Weight readers: safetensors (our own parser) and GGUF (on the `gguf` package's constants).

Owns: turning files on disk into Hugging Face-named torch tensors. Does not own:
model configuration (`pagedllm.config`) or fusing Q/K/V and gate/up (the model
does that at load time).
"""

from typing import Any

from pagedllm.weights.safetensors import SafetensorsFile, load_hf_state_dict, load_safetensors_dir

__all__ = [
    "GGUFFile",
    "SafetensorsFile",
    "load_gguf_state_dict",
    "load_hf_state_dict",
    "load_safetensors_dir",
]


def __getattr__(name: str) -> Any:
    # GGUF support needs the `gguf` package; import it only when asked, so that
    # safetensors loading works where gguf is not installed (the GPU machine).
    if name in ("GGUFFile", "load_gguf_state_dict"):
        from pagedllm.weights import gguf

        return getattr(gguf, name)
    raise AttributeError(f"module 'pagedllm.weights' has no attribute {name!r}")
