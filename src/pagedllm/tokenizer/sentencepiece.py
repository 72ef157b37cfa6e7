"""SentencePiece-style BPE, as llama.cpp runs it for a GGUF with `tokenizer.ggml.model = "llama"`.

Owns: turning one stretch of plain text (no added tokens in it) into ids with
score-ordered merges and byte fallback, and the bytes each id decodes to.
Does not own: cutting out added tokens (user-defined and control ones), BOS,
chat templates or streaming: `tokenizer.py` does those for both kinds of
model, which is why this is a second *model* inside the one `Tokenizer`
class, not a second tokenizer class (see `tokenizer.py`).

The rule (llama.cpp's `llm_tokenizer_spm`), on one stretch of text:
1. with `add_space_prefix` (Llama 2, Mistral; not Gemma), put a space first;
2. write every space as U+2581 ("▁"): "Hello world" -> "Hello▁world";
3. start from one symbol per character; repeatedly merge the adjacent pair
   whose concatenation is a vocabulary entry with the highest score (on a
   tie, the leftmost pair); stop when no adjacent pair is an entry;
4. each remaining symbol is its entry's id, or, for a character that has no
   entry, the ids of its UTF-8 bytes ("<0xE2>", "<0x96>", ...): byte fallback.

Unlike byte-level BPE there are no merge ranks: a pair merges when its
*result* is a token, ordered by that token's score (for Gemma the scores fall
with the position in the vocabulary, so earlier entries merge first).

Why it is not one merge over the whole stretch: a stretch has no
pre-tokenizer, so a 10,000-character prompt would be one 10,000-symbol merge
on every call. Instead the stretch is cut before each "▁" that follows a
character other than "▁" ("Hello▁world" -> "Hello", "▁world"), and each piece
is merged alone through a cache, as `bpe.py` does with pre-tokens. The cut is
exact: a merge across it would make a vocabulary entry with "▁" after another
character. Entries like that are rare (Gemma has one, ">▁</"), and the cut is
skipped wherever such an entry occurs in the text, so no merge that could
happen is ever prevented. A piece's merge is O(n log n) (a heap, as in
`bpe.py`), so even a 10,000-character run with no space costs milliseconds.
"""

from __future__ import annotations

import heapq
import operator
import re
from collections.abc import Iterable, Sequence

import regex

from pagedllm.tokenizer.bpe import _PieceCache

# GGUF token types (llama.cpp's llama_token_type); loaders.py reads them from here.
GGUF_NORMAL, GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_UNUSED, GGUF_BYTE = range(1, 7)

SPACE = "\u2581"  # "▁": how SentencePiece writes a space inside its tokens

# A cut point: before a "▁" that follows any other character.
_CUT = re.compile(f"(?<=[^{SPACE}])(?={SPACE})")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# "▁" after another character (NUL separates tokens in the search for them).
_CROSSING = re.compile(f"[^\0{SPACE}]{SPACE}")


class SentencePieceModel:
    """The vocabulary, the scores and the merge loop of one SentencePiece-style model.

    tokens, scores, types: one entry per id, as GGUF stores them
        (`tokenizer.ggml.tokens`, `.scores`, `.token_type`).
    add_space_prefix: put a space before each stretch of text
        (`tokenizer.ggml.add_space_prefix`; llama.cpp's default is True).
    unknown_id: what a byte with no "<0xXX>" token becomes (None: it is dropped).
    vocab: token -> id, when the caller has it already (it must match `tokens`).
    """

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float],
        types: Sequence[int],
        *,
        add_space_prefix: bool,
        unknown_id: int | None = None,
        vocab: dict[str, int] | None = None,
    ) -> None:
        self.add_space_prefix = add_space_prefix
        # (`vocab`: the same map, already built by the caller; not copied.)
        self.vocab: dict[str, int] = vocab or dict(zip(tokens, range(len(tokens))))
        # What a merge may make: every entry but control, unknown and unused
        # ones. llama.cpp looks a pair up in the whole vocabulary, so plain
        # text could assemble "<end_of_turn>" where the vocabulary holds the
        # pieces for it; then `allow_special=False` would not keep a user from
        # forging a turn. Where special tokens are allowed, their text is cut
        # out before this model sees it, so the two never differ there (nor
        # anywhere for Gemma, whose control tokens no merge can make).
        # (Unused entries too: llama.cpp decodes them to nothing.)
        others = [i for i, kind in enumerate(types) if kind != GGUF_NORMAL]
        self.scores: dict[str, float] = dict(zip(tokens, scores))
        for i in others:
            if types[i] in (GGUF_CONTROL, GGUF_UNKNOWN, GGUF_UNUSED):
                del self.scores[tokens[i]]
        # byte value -> id: "<0xXX>", else the one-byte token itself (llama.cpp's
        # byte_to_token), else the unknown token.
        self.byte_ids: list[int | None] = []
        for b in range(256):
            i = self.vocab.get(f"<0x{b:02X}>")
            if i is None and b < 0x80:
                i = self.vocab.get(chr(b))
            self.byte_ids.append(i if i is not None else unknown_id)
        # Entries with "▁" after another character: where one occurs in the
        # text, the piece cut there is skipped (see the module docstring).
        self._crossing = crossing_entries(tokens)
        # What each id decodes to, as llama.cpp's token_to_piece: every entry
        # as a normal one first (in C: Gemma has 262,144), then the others.
        as_text = map(operator.methodcaller("replace", SPACE, " "), tokens)
        self.id_to_bytes: list[bytes] = list(map(str.encode, as_text))
        for i in others:
            self.id_to_bytes[i] = _token_bytes(tokens[i], types[i])
        self._cache = _PieceCache(self._encode_piece)

    # ------------------------------------------------------------------ encode

    def encode(self, text: str) -> list[int]:
        """The ids of one stretch of plain text (added tokens already cut out)."""
        if self.add_space_prefix:
            text = " " + text
        text = text.replace(" ", SPACE)
        get = self._cache.__getitem__
        out: list[int] = []
        for ids in map(get, self.pieces(text)):
            out += ids
        return out

    def pieces(self, text: str) -> list[str]:
        """`text` (spaces already "▁") cut where no merge can cross (see the module docstring)."""
        return cut_before_spaces(text, self._crossing)

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        vocab, scores = self.vocab, self.scores
        out: list[int] = []
        for symbol in self.merge(list(piece)):
            if symbol in scores:  # an entry a merge may make (not a control one)
                out.append(vocab[symbol])
                continue
            # Byte fallback: only a single character can be missing (a merge
            # always makes a vocabulary entry).
            out += [
                b for b in map(self.byte_ids.__getitem__, symbol.encode("utf-8")) if b is not None
            ]
        return tuple(out)

    def merge(self, symbols: list[str]) -> list[str]:
        """Merge adjacent symbols, highest-scoring result first, leftmost on ties.

        The same linked list and heap as `BytePairEncoder.merge`, keyed by
        (-score of the merged entry, left position). A popped candidate is
        stale when either side changed since it was pushed (told by identity
        of the strings, as there), and is skipped.
        """
        n = len(symbols)
        if n < 2:
            return symbols
        scores = self.scores
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            left, right = symbols[i], symbols[i + 1]
            score = scores.get(left + right)
            if score is not None:
                heap.append((-score, i, left, right))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, i, left, right = pop(heap)
            j = nxt[i]
            if j == -1 or symbols[i] is not left or symbols[j] is not right:
                continue
            merged = symbols[i] = left + right
            symbols[j] = None
            k = nxt[j]
            nxt[i] = k
            if k != -1:
                prv[k] = i
            p = prv[i]
            if p != -1:
                before = symbols[p]
                score = scores.get(before + merged)
                if score is not None:
                    push(heap, (-score, p, before, merged))
            if k != -1:
                after = symbols[k]
                score = scores.get(merged + after)
                if score is not None:
                    push(heap, (-score, i, merged, after))
        return [s for s in symbols if s is not None]


def crossing_entries(entries: Iterable[str]) -> regex.Pattern | None:
    """A regex for the entries that hold "▁" after another character (longest
    first), or None when there are none: where one occurs in a text, no cut
    may fall inside it (`cut_before_spaces`).

    Found by one search over all the entries joined by NULs, each hit widened
    to the NULs around it: 262,144 tokens in milliseconds."""
    joined = "\0".join(entries)
    found = set()
    for m in _CROSSING.finditer(joined):
        start = joined.rfind("\0", 0, m.start()) + 1
        end = joined.find("\0", m.end())
        found.add(joined[start : end if end >= 0 else len(joined)])
    crossing = sorted(found, key=len, reverse=True)
    return regex.compile("|".join(regex.escape(t) for t in crossing)) if crossing else None


def cut_before_spaces(text: str, crossing: regex.Pattern | None) -> list[str]:
    """`text` cut before each "▁" that follows another character, except inside
    an occurrence of a `crossing` entry: pieces that merge exactly as the
    whole text would (see the module docstring)."""
    if crossing is None or crossing.search(text) is None:
        return _CUT.split(text)
    # Keep whole every occurrence of an entry that holds "▁" after another
    # character: the cut points inside one are skipped. (An overlapped
    # search reports the longest entry at each start, which covers the rest.)
    inside: set[int] = set()
    for m in crossing.finditer(text, overlapped=True):
        inside.update(range(m.start() + 1, m.end()))
    cuts = [m.start() for m in _CUT.finditer(text) if m.start() not in inside]
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _token_bytes(token: str, kind: int) -> bytes:
    """What one entry decodes to (llama.cpp's token_to_piece for SentencePiece):
    a normal entry with "▁" as a space, a byte entry its one byte, a control,
    unknown or user-defined entry its text as written, and an unused entry
    (or one of an unknown type) nothing."""
    if kind == GGUF_NORMAL:
        return token.replace(SPACE, " ").encode("utf-8")
    if kind == GGUF_BYTE:
        m = _BYTE_TOKEN.fullmatch(token)
        return bytes([int(m.group(1), 16)]) if m else token.encode("utf-8")
    if kind in (GGUF_CONTROL, GGUF_UNKNOWN, GGUF_USER_DEFINED):
        return token.encode("utf-8")
    return b""
