"""Text <-> token ids: byte-level BPE, chat templates, streaming detokenization.

Public names: `Tokenizer` (load with `Tokenizer.from_model_path`, `from_file`
or `from_gguf`) and `IncrementalDetokenizer`. This package imports no torch.
"""

from pagedllm.tokenizer.detokenizer import IncrementalDetokenizer
from pagedllm.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
