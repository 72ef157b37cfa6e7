"""Weight readers: safetensors (our own parser) and GGUF (on the `gguf` package's constants).

Owns: turning files on disk into Hugging Face-named torch tensors. Does not own:
model configuration (`pagedllm.config`) or fusing Q/K/V and gate/up (the model
does that at load time).
"""

from pagedllm.weights.gguf import GGUFFile, load_gguf_state_dict
from pagedllm.weights.safetensors import SafetensorsFile, load_hf_state_dict, load_safetensors_dir

__all__ = [
    "GGUFFile",
    "SafetensorsFile",
    "load_gguf_state_dict",
    "load_hf_state_dict",
    "load_safetensors_dir",
]
