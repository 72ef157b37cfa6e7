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
  invalid bytes exactly as a one-shot decode does); after `prompt_ids`,
  the text is what `decode(prompt_ids + ids)` adds to `decode(prompt_ids)`;
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
        instead of starting with U+FFFD. Its text is not emitted. (And the
        generated text does not begin the text: a SentencePiece-style
        decoder's start rules, Llama 2's Strip of a leading space, are spent
        on the prompt, so " Paris" after "The capital is" keeps its space.)
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
        # Where the text is in the decoder's start-of-text rules (None: it has none).
        self._start = tokenizer.start_of_text()
        if prompt_ids:
            # Prime the decoder with the prompt's bytes and drop their text;
            # only an unfinished trailing character stays buffered.
            data = tokenizer.decode_bytes(prompt_ids, skip_special_tokens, start=self._start)
            self._decoder.decode(data)

    def add(self, token_id: int) -> str:
        """Feed one id; return the new text (possibly "" while a character is unfinished)."""
        self.token_ids.append(token_id)
        if self.skip_special_tokens and token_id in self.tokenizer.special_token_ids:
            return ""
        data = self.tokenizer.token_bytes(token_id)
        if self._start is not None and not self._start.done:
            data = self._start.feed(token_id, data)
        piece = self._decoder.decode(data)
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
