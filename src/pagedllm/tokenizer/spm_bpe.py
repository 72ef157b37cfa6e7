"""SentencePiece-style BPE read from an HF `tokenizer.json` (Llama 2, Mistral, Gemma, TinyLlama).

Owns: what such a file does that byte-level BPE does not, exactly as HF
`tokenizers` runs it:
- the normalizer: `Prepend("▁")`, `Replace(" ", "▁")`, NFC, in a `Sequence`;
- the model: merges by rank over *characters* (not over byte-level symbols),
  a character that is no vocabulary entry written as its UTF-8 byte tokens
  "<0xE2>" "<0x96>" ... (`byte_fallback`), else as the unknown token (a run of
  unknown characters as one, with `fuse_unk`), else dropped;
- the decoder: what each id decodes to (`Replace("▁", " ")`, `ByteFallback`,
  `Fuse`, `Metaspace`) and the two rules for the start of the text, which no
  per-id table can hold (`StartOfText`): Metaspace drops the "▁" of the first
  token, `Strip(" ", 1, 0)` after `Fuse` drops the text's leading space.
Does not own: added tokens (`tokenizer.py` cuts them out, the normalized ones
from the normalized text), the `Metaspace` and `Split` pre-tokenizers
(`pretokenize.py`), the merge loop (`bpe.py`'s `BytePairEncoder.merge`: ranks
over strings, the same loop for characters as for byte-level symbols), or the
cut of long stretches before each "▁" (`sentencepiece.py`, exact here too:
no merge crosses a cut, since a crossing merge's result would be one of the
entries found by `crossing_entries`, whose occurrences are kept whole).

Where we part from HF, on purpose:
- a run of byte tokens that is not valid UTF-8 decodes, in HF's ByteFallback,
  as one U+FFFD per byte token; here as Python's decoder has it, one U+FFFD
  per maximal invalid subsequence ("<0xE2><0x96>": "\ufffd\ufffd" for HF,
  "\ufffd" here). One rule for every tokenizer keeps the streaming
  detokenizer equal to a one-shot decode; valid text decodes identically;
- a special added token marked "normalized" whose normalized form differs
  ("</s>" after a Prepend normalizer: "▁</s>") is not skipped by HF's
  `decode(skip_special_tokens=True)` (tokenizers 0.23 looks the normalized
  string up among the special ones); we skip special tokens by id. Without
  skipping, it decodes as HF's: as normalized (" </s>").
"""

from __future__ import annotations

import operator
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import regex

from pagedllm.tokenizer.bpe import BytePairEncoder, _PieceCache
from pagedllm.tokenizer.pretokenize import PreTokenizer, metaspace_from_hf_json
from pagedllm.tokenizer.sentencepiece import SPACE, crossing_entries, cut_before_spaces

# HF's ByteFallback decoder takes a token of 6 bytes "<0x..>" whose two
# characters parse as a hexadecimal u8 (Rust's from_str_radix also takes "+F").
_BYTE_TOKEN = re.compile(r"<0x(\+[0-9A-Fa-f]|[0-9A-Fa-f]{2})>")
# Decoder step types of a SentencePiece-style file (anything else is refused by name).
DECODER_TYPES = ("Sequence", "Replace", "ByteFallback", "Fuse", "Strip", "Metaspace")


# ------------------------------------------------------------------ normalizer


@dataclass(frozen=True)
class Normalizer:
    """HF normalizer steps, applied in order: ("prepend", text), ("replace",
    pattern, content) with a plain-string pattern, ("nfc",)."""

    steps: tuple[tuple[str, ...], ...] = ()

    def __call__(self, text: str) -> str:
        for step in self.steps:
            if step[0] == "replace":
                text = text.replace(step[1], step[2])
            elif step[0] == "prepend":
                if text:  # HF prepends to a non-empty string only
                    text = step[1] + text
            else:
                text = unicodedata.normalize("NFC", text)
        return text


def normalizer_from_hf_json(spec: Any) -> Normalizer:
    """The `normalizer` of a SentencePiece-style tokenizer.json; ValueError naming
    what is not supported (a Regex Replace, Lowercase, Precompiled, ...)."""
    steps: list[tuple[str, ...]] = []
    todo = [] if spec is None else [spec]
    while todo:
        step = todo.pop(0)
        kind = step.get("type") if isinstance(step, dict) else None
        if kind == "Sequence":
            subs = step.get("normalizers")
            if not isinstance(subs, list):
                raise ValueError(f"normalizer normalizers is {_shown(subs)}, expected a list")
            todo = [*subs, *todo]
        elif kind == "Prepend":
            steps.append(("prepend", _string(step, "prepend", "Prepend normalizer")))
        elif kind == "Replace":
            pattern = _string_pattern(step, "Replace normalizer")
            steps.append(("replace", pattern, _string(step, "content", "Replace normalizer")))
        elif kind == "NFC":
            steps.append(("nfc",))
        else:
            shown = repr(kind) if kind is not None else _shown(step)
            raise ValueError(
                f"normalizer {shown} is not supported in a SentencePiece-style tokenizer "
                "(Prepend, Replace of a string, NFC, or a Sequence of those)"
            )
    return Normalizer(tuple(steps))


# --------------------------------------------------------------------- decoder


@dataclass(frozen=True)
class Decoder:
    """An HF decoder of a SentencePiece-style file, as three parts in this order:

    token_steps: what each token's string goes through first, alone:
        ("replace", pattern, content), ("strip", char, start, stop) and
        ("metaspace", replacement, drop_first) (the replacement becomes a
        space, or nothing in the first token when `drop_first`);
    byte_fallback: then a token "<0xXX>" is that byte;
    strip_start: then, after `Fuse`, (char, n): up to n leading `char`s of
        the whole text are dropped (Llama 2's `Strip(" ", 1, 0)`).
    Steps in another order (a Replace after ByteFallback, ByteFallback after
    Fuse, a Strip of the text's end) are refused when the file is read: their
    result is no per-token table plus a start rule.
    """

    token_steps: tuple[tuple[Any, ...], ...] = ()
    byte_fallback: bool = False
    strip_start: tuple[str, int] | None = None

    @property
    def drops_in_first(self) -> bool:
        return any(s[0] == "metaspace" and s[2] for s in self.token_steps)

    @property
    def has_start_rule(self) -> bool:
        return self.drops_in_first or self.strip_start is not None

    def token_bytes(self, token: str, first: bool = False) -> bytes:
        """What one token decodes to; `first`: it is the first token decoded."""
        for step in self.token_steps:
            token = self._apply(step, token, first)
        if self.byte_fallback and len(token) == 6:
            m = _BYTE_TOKEN.fullmatch(token)
            if m is not None:
                return bytes([int(m.group(1), 16)])
        return token.encode("utf-8")

    def table(self, tokens: Sequence[str | None]) -> list[bytes]:
        """`token_bytes` of every id (b"" for an id with no token), the common
        steps in C: Gemma has 262,144 tokens."""
        strings: list[str] = ["" if t is None else t for t in tokens]
        for step in self.token_steps:
            if step[0] == "strip":
                strings = [self._apply(step, s, False) for s in strings]
            else:
                pattern = step[1]
                content = step[2] if step[0] == "replace" else " "
                strings = list(map(operator.methodcaller("replace", pattern, content), strings))
        out = list(map(str.encode, strings))
        if self.byte_fallback:
            for i, s in enumerate(strings):
                if len(s) == 6 and (m := _BYTE_TOKEN.fullmatch(s)) is not None:
                    out[i] = bytes([int(m.group(1), 16)])
        return out

    @staticmethod
    def _apply(step: tuple[Any, ...], token: str, first: bool) -> str:
        if step[0] == "replace":
            return token.replace(step[1], step[2])
        if step[0] == "metaspace":
            return token.replace(step[1], "" if first and step[2] else " ")
        _, char, start, stop = step  # HF's Strip: up to `start`/`stop` chars at each end
        lo = 0
        while lo < min(start, len(token)) and token[lo] == char:
            lo += 1
        hi = len(token)
        while len(token) - hi < stop and hi > lo and token[hi - 1] == char:
            hi -= 1
        return token[lo:hi]


def decoder_from_hf_json(spec: Any) -> Decoder:
    """The `decoder` of a SentencePiece-style tokenizer.json; ValueError naming
    what is not supported."""
    steps = [spec]
    while any(isinstance(s, dict) and s.get("type") == "Sequence" for s in steps):
        flat = []
        for s in steps:
            if isinstance(s, dict) and s.get("type") == "Sequence":
                subs = s.get("decoders")
                if not isinstance(subs, list):
                    raise ValueError(f"decoder decoders is {_shown(subs)}, expected a list")
                flat += subs
            else:
                flat.append(s)
        steps = flat
    token_steps: list[tuple[Any, ...]] = []
    byte_fallback = fused = False
    strip_start: tuple[str, int] | None = None
    for step in steps:
        kind = step.get("type") if isinstance(step, dict) else None
        if kind not in DECODER_TYPES:
            shown = repr(kind) if kind is not None else _shown(step)
            raise ValueError(
                f"decoder {shown} is not supported in a SentencePiece-style tokenizer "
                "(Metaspace, or a Sequence of Replace, ByteFallback, Fuse and Strip)"
            )
        if kind == "Fuse":
            fused = True
        elif kind == "ByteFallback":
            if fused:
                raise ValueError(
                    "decoder ByteFallback after Fuse is not supported (it would see one "
                    "fused string, never a byte token)"
                )
            byte_fallback = True
        elif kind == "Strip" and fused:
            char, start, stop = _strip_options(step)
            if stop:
                raise ValueError(
                    "decoder Strip of the text's end (stop > 0) is not supported: a stream "
                    "cannot know where the text ends"
                )
            if strip_start is not None:
                raise ValueError("decoder: two Strip steps after Fuse are not supported")
            strip_start = (char, start) if start else None
        elif byte_fallback or fused:
            raise ValueError(
                f"decoder {kind} after ByteFallback or Fuse is not supported (only "
                "Strip of the start may follow them)"
            )
        elif kind == "Strip":
            token_steps.append(("strip", *_strip_options(step)))
        elif kind == "Replace":
            pattern = _string_pattern(step, "Replace decoder")
            token_steps.append(("replace", pattern, _string(step, "content", "Replace decoder")))
        else:  # Metaspace
            meta = metaspace_from_hf_json(step)
            token_steps.append(("metaspace", meta.replacement, meta.prepend_scheme != "never"))
    return Decoder(tuple(token_steps), byte_fallback, strip_start)


class StartOfText:
    """One decode's (or one stream's) way through the decoder's start-of-text rules.

    HF decodes the list of tokens as a whole: Metaspace treats its first token
    apart, and a Strip after Fuse sees the fused text. Everything else is per
    token, so a decode is the table's bytes with these two rules put on its
    first tokens: `feed` each id in order (special ones already left out, as
    HF leaves them out before the decoder) until `done`.
    """

    def __init__(self, decoder: Decoder, tokens: Sequence[str | None]) -> None:
        self._decoder = decoder
        self._tokens = tokens
        self._first = decoder.drops_in_first
        char, count = decoder.strip_start or (" ", 0)
        self._strip = char.encode("utf-8")
        self._left = count

    @property
    def done(self) -> bool:
        return not self._first and not self._left

    def feed(self, token_id: int, data: bytes) -> bytes:
        """The bytes of `token_id` (`data`, the table's) as this position in the text has them."""
        if self._tokens[token_id] is None:
            return data  # an id with no token: HF drops it before the decoder
        if self._first:
            self._first = False
            data = self._decoder.token_bytes(self._tokens[token_id], first=True)
        while self._left and data.startswith(self._strip):
            data = data[len(self._strip) :]
            self._left -= 1
        if data:  # the text has begun with something else: nothing more to strip
            self._left = 0
        return data


# ----------------------------------------------------------------------- model


@dataclass(frozen=True)
class SpmBpeOptions:
    """What a SentencePiece-style tokenizer.json says beyond vocabulary and merges."""

    normalizer: Normalizer
    decoder: Decoder
    byte_fallback: bool = True
    unk_token: str | None = None  # in the vocabulary (the loader checks it)
    fuse_unk: bool = False


class CharBpeModel:
    """HF's BPE model over characters: one stretch of normalized text (no added
    token in it) -> ids, through the pre-tokenizer, merges by rank, byte
    fallback and the unknown token.

    Each pre-token is cut before its "▁"s (`cut_before_spaces`) and each piece
    merged alone through a cache: a stretch of Llama 2 text has no
    pre-tokenizer, and would otherwise be one merge of thousands of symbols
    on every call. The cut is exact when
    - "▁" is an entry (so no unknown run or byte fallback spans a cut);
    - no merge takes a byte token or the unknown token as a part (then every
      merged symbol is plain characters of the text, and one that crosses a
      cut is an occurrence of a crossing entry, where no cut is made);
    - characters that would be dropped (no entry, no byte tokens, no unknown
      token) are dropped before the cut: HF drops them before merging, so
      their neighbours meet ("▁😀▁" is "▁▁" when 😀 has no way in).
    Without the first two (no real vocabulary), pre-tokens are merged whole.
    """

    def __init__(
        self,
        vocab: Mapping[str, int],
        merges: Iterable[tuple[str, str]],
        options: SpmBpeOptions,
        pretokenizer: PreTokenizer,
        *,
        ignore_merges: bool = False,
    ) -> None:
        merges = list(merges)
        self._bpe = BytePairEncoder(vocab, merges)  # its ranks and merge loop
        self.vocab: dict[str, int] = self._bpe.vocab
        self.normalize = options.normalizer
        self._pretokenize = pretokenizer
        self.ignore_merges = ignore_merges
        self.byte_fallback = options.byte_fallback
        self.unk_token = options.unk_token
        self.fuse_unk = options.fuse_unk
        # byte value -> its token "<0xXX>" (uppercase hex, as HF formats it), or None.
        self._byte_symbols: list[str | None] = [
            t if (t := f"<0x{b:02X}>") in self.vocab else None for b in range(256)
        ]
        # (Both searches in C: Gemma has 514,906 merges.)
        atoms = {t for t in self._byte_symbols if t is not None} | {self.unk_token}
        self._cut = SPACE in self.vocab and atoms.isdisjoint(chain.from_iterable(merges))
        self._crossing: regex.Pattern | None = crossing_entries(map("".join, merges))
        # Whether some character may have no way in at all (then it is dropped first).
        self._drops = self.unk_token is None and not (
            self.byte_fallback and None not in self._byte_symbols
        )
        self._cache = _PieceCache(self._encode_piece)

    def encode(self, text: str, at_start: bool = True) -> list[int]:
        """Ids of normalized text; `at_start`: it begins the input (Metaspace "first")."""
        vocab = self.vocab
        get = self._cache.__getitem__
        out: list[int] = []
        for pre in self._pretokenize(text, at_start):
            if self.ignore_merges and pre in vocab:
                out.append(vocab[pre])
                continue
            if self._drops:
                pre = "".join(filter(self._has_way_in, pre))
            if self._cut:
                for ids in map(get, cut_before_spaces(pre, self._crossing)):
                    out += ids
            else:
                out += get(pre)
        return out

    def _has_way_in(self, ch: str) -> bool:
        """Whether a character becomes a symbol (an entry, or bytes that all are)."""
        if ch in self.vocab:
            return True
        symbols = self._byte_symbols
        return self.byte_fallback and all(symbols[b] is not None for b in ch.encode("utf-8"))

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        vocab, unk = self.vocab, self.unk_token
        symbols: list[str] = []
        pending = False  # unknown characters seen and not yet written as `unk`
        for ch in piece:
            if ch in vocab:
                if pending:
                    symbols.append(unk)
                    pending = False
                symbols.append(ch)
                continue
            if self.byte_fallback:
                parts = [self._byte_symbols[b] for b in ch.encode("utf-8")]
                if None not in parts:
                    # HF leaves a pending unknown run pending here: it is written
                    # after these bytes, and the next unknown character joins it.
                    symbols += parts
                    continue
            if unk is not None:
                if pending and not self.fuse_unk:
                    symbols.append(unk)
                pending = True
        if pending:
            symbols.append(unk)
        return tuple(vocab[s] for s in self._bpe.merge(symbols))


# ----------------------------------------------------------------------- parse


def _string(step: Mapping[str, Any], key: str, what: str) -> str:
    value = step.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{what} {key} is {_shown(value)}, expected a string")
    return value


def _string_pattern(step: Mapping[str, Any], what: str) -> str:
    pattern = step.get("pattern")
    if isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
        raise ValueError(f"{what} with a Regex pattern is not supported (only a String)")
    if not (isinstance(pattern, dict) and isinstance(pattern.get("String"), str)):
        raise ValueError(f'{what} pattern is {_shown(pattern)}, expected {{"String": "..."}}')
    if not pattern["String"]:
        raise ValueError(f"{what} pattern is an empty string")
    return pattern["String"]


def _strip_options(step: Mapping[str, Any]) -> tuple[str, int, int]:
    char = _string(step, "content", "Strip decoder")
    if len(char) != 1:
        raise ValueError(f"Strip decoder content is {char!r}, expected one character")
    counts = []
    for key in ("start", "stop"):
        value = step.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"Strip decoder {key} is {_shown(value)}, expected a count >= 0")
        counts.append(value)
    return char, counts[0], counts[1]


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."
