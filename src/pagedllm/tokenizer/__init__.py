"""Text <-> token ids: byte-level and SentencePiece-style BPE, chat templates, streaming.

Public names: `Tokenizer` (load with `Tokenizer.from_model_path`, `from_file`
or `from_gguf`) and `IncrementalDetokenizer`. This package imports no torch.
"""

from pagedllm.tokenizer.detokenizer import IncrementalDetokenizer
from pagedllm.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
