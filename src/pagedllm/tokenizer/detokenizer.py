"""Streaming detokenization: token ids in, text out, one token at a time.

Owns: `IncrementalDetokenizer`. Does not own: stop strings or sampling.

Why it is not just `decode([token_id])`: one character can span several
tokens (an emoji is 4 UTF-8 bytes, often 2-4 byte-level tokens). Decoding each
token alone would print U+FFFD halves. Instead the bytes of every token go
through one incremental UTF-8 decoder, which holds back the bytes of an
unfinished character until the next token completes it.

Invariants:
- `"".join(pieces) + finish() == tokenizer.decode(ids, skip_special_tokens)`
  for the same ids, whatever the split (the incremental decoder replaces
  invalid bytes exactly as a one-shot decode does);
- a piece never ends in half a character;
- each `add` costs O(bytes of that token): nothing is re-decoded.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text pieces.

    prompt_ids: the prompt's ids, if the stream continues a prompt. Only its
        trailing unfinished character (a prompt given as ids can end mid-
        character) matters: the first generated token then completes it
        instead of starting with U+FFFD. Its text is not emitted.
    skip_special_tokens: leave control tokens out of the text (the engine
        passes the request's `SamplingParams.skip_special_tokens`).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []
        self.token_ids: list[int] = []
        if prompt_ids:
            # Prime the decoder with the prompt's bytes and drop their text;
            # only an unfinished trailing character stays buffered.
            self._decoder.decode(tokenizer.decode_bytes(prompt_ids, skip_special_tokens))

    def add(self, token_id: int) -> str:
        """Feed one id; return the new text (possibly "" while a character is unfinished)."""
        self.token_ids.append(token_id)
        if self.skip_special_tokens and token_id in self.tokenizer.special_token_ids:
            return ""
        piece = self._decoder.decode(self.tokenizer.token_bytes(token_id))
        if piece:
            self._pieces.append(piece)
        return piece

    def add_many(self, token_ids: Sequence[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def finish(self) -> str:
        """End of stream: flush a dangling unfinished character (as U+FFFD)."""
        piece = self._decoder.decode(b"", final=True)
        if piece:
            self._pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def pending_bytes(self) -> int:
        """Bytes held back because their character is not finished yet."""
        return len(self._decoder.getstate()[0])
