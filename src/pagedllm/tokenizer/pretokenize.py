"""Pre-tokenization: cutting text into the pieces that BPE merges within.

Owns: the split rules of HF `tokenizers` (`Split`, `Digits`, the regex of
`ByteLevel`, `Metaspace`) and the map from a GGUF `tokenizer.ggml.pre` name
to the same rules. Does not own: added/special tokens (they are cut out
before, in `tokenizer.py`), the byte-level mapping (`bytelevel.py`) or merges
(`bpe.py`).

Invariant: without a `Removed` rule or a `Metaspace` (which writes spaces as
"▁" and may put one in front), the pieces concatenate back to the input;
BPE never merges across two pieces, which is why "Hello world" can never
become one token.

Unicode version: `\\p{L}`, `\\p{N}` and `\\s` come from the `regex` module's
Unicode database, HF `tokenizers` uses Oniguruma's. They agree on every
character both versions know; a character assigned only in the newest Unicode
version can be a letter for one and unassigned (a symbol) for the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import regex

# GPT-2's pattern as `tokenizers`' ByteLevel pre-tokenizer uses it. The final
# `\s+` catches whitespace that `\s+(?!\S)` leaves behind (a lone "\n" before a
# letter), so every character of the input lands in some piece.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3 (tiktoken's cl100k style): case-insensitive contractions, numbers in
# groups of up to three digits, a letter run may take one leading non-letter.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2, Qwen2.5 and Qwen3 (tokenizer.json's Split, and llama.cpp's "qwen2"):
# Llama 3's pattern with each digit alone (\p{N}, not \p{N}{1,3}).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DIGIT_PATTERN = r"\p{N}"

# HF's names for what happens to the text a rule matches.
BEHAVIORS = ("isolated", "removed", "merged_with_previous", "merged_with_next", "contiguous")
_HF_BEHAVIOR = {
    "Isolated": "isolated",
    "Removed": "removed",
    "MergedWithPrevious": "merged_with_previous",
    "MergedWithNext": "merged_with_next",
    "Contiguous": "contiguous",
}


@dataclass(frozen=True)
class SplitRule:
    """One HF `Split`: cut each piece at the matches of `pattern`."""

    pattern: str
    behavior: str = "isolated"
    invert: bool = False
    compiled: regex.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.behavior not in BEHAVIORS:
            raise ValueError(
                f"unknown split behavior {self.behavior!r}; expected one of {BEHAVIORS}"
            )
        object.__setattr__(self, "compiled", regex.compile(self.pattern))

    @property
    def is_plain(self) -> bool:
        """Isolated, not inverted, no capture groups: `findall` is the whole job."""
        return self.behavior == "isolated" and not self.invert and self.compiled.groups == 0

    def split(self, piece: str) -> list[str]:
        if self.is_plain:
            parts = self.compiled.findall(piece)
            # The usual case: the matches tile the piece (the GPT-2 and Llama 3
            # patterns match any character), so there are no gaps to keep.
            if sum(map(len, parts)) == len(piece):
                return [p for p in parts if p] if "" in parts else parts
        return self._split_spans(piece)

    def _split_spans(self, piece: str) -> list[str]:
        # (start, end, is_match) spans covering the piece, as `tokenizers` builds them.
        spans: list[tuple[int, int, bool]] = []
        pos = 0
        for m in self.compiled.finditer(piece):
            start, end = m.span()
            if start == end:
                continue  # empty matches cut nothing
            if start > pos:
                spans.append((pos, start, False))
            spans.append((start, end, True))
            pos = end
        if pos < len(piece):
            spans.append((pos, len(piece), False))
        if self.invert:
            spans = [(s, e, not hit) for s, e, hit in spans]
        return _apply_behavior(piece, spans, self.behavior)


def _apply_behavior(piece: str, spans: list[tuple[int, int, bool]], behavior: str) -> list[str]:
    """Turn (start, end, is_match) spans into pieces, exactly as `tokenizers`' split does."""
    if behavior == "isolated":
        return [piece[s:e] for s, e, _ in spans]
    if behavior == "removed":
        return [piece[s:e] for s, e, hit in spans if not hit]
    if behavior == "merged_with_next":
        # The mirror image of merged_with_previous: run it on the reversed spans.
        merged = _merge_spans(list(reversed(spans)), glue_to_next=True)
        return [piece[s:e] for s, e in reversed(merged)]
    if behavior == "contiguous":
        merged = []
        last_hit = False
        for s, e, hit in spans:
            # A run of matches (or of non-matches) becomes one piece.
            if merged and hit == last_hit:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((s, e))
            last_hit = hit
        return [piece[s:e] for s, e in merged]
    return [piece[s:e] for s, e in _merge_spans(spans, glue_to_next=False)]


def _merge_spans(spans: list[tuple[int, int, bool]], glue_to_next: bool) -> list[tuple[int, int]]:
    # A match joins the piece before it, unless that piece itself ended in a
    # match ("ab12" -> "ab1", "2"): `tokenizers`' rule, kept verbatim.
    merged: list[tuple[int, int]] = []
    last_hit = False
    for s, e, hit in spans:
        if hit and not last_hit and merged:
            start, end = merged[-1]
            merged[-1] = (s, end) if glue_to_next else (start, e)
        else:
            merged.append((s, e))
        last_hit = hit
    return merged


PREPEND_SCHEMES = ("always", "first", "never")


@dataclass(frozen=True)
class Metaspace:
    """HF's `Metaspace` pre-tokenizer (SentencePiece-style BPE: Llama 2 and
    Mistral files written by newer transformers): every space becomes
    `replacement` ("▁"), a piece gets one in front unless it starts with one
    (`prepend_scheme` "always"; "first": only the piece at the very start of
    the text, not one after an added token; "never"), and with `split` the
    piece is cut before each "▁" ("▁Hi▁▁there" -> "▁Hi", "▁", "▁there").
    """

    replacement: str = "\u2581"
    prepend_scheme: str = "always"
    split: bool = True
    _cut: SplitRule = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.replacement) != 1:
            raise ValueError(f"Metaspace replacement {self.replacement!r} must be one character")
        if self.prepend_scheme not in PREPEND_SCHEMES:
            raise ValueError(
                f"Metaspace prepend_scheme {self.prepend_scheme!r} is not one of {PREPEND_SCHEMES}"
            )
        rule = SplitRule(regex.escape(self.replacement), "merged_with_next")
        object.__setattr__(self, "_cut", rule)

    def split_at(self, piece: str, at_start: bool) -> list[str]:
        """`piece`'s pieces; `at_start`: it begins the text (for "first")."""
        rep = self.replacement
        piece = piece.replace(" ", rep)
        if not piece.startswith(rep) and (
            self.prepend_scheme == "always" or self.prepend_scheme == "first" and at_start
        ):
            piece = rep + piece
        return self._cut.split(piece) if self.split else [piece]


class PrefixSpace:
    """ByteLevel's `add_prefix_space`: a piece that does not start with a space gets one.

    `tokenizers` applies it to every piece reaching the ByteLevel step (so to
    every stretch of text between two added tokens), not only to the first.
    """

    def split(self, piece: str) -> list[str]:
        return [piece if piece.startswith(" ") else " " + piece]


@dataclass(frozen=True)
class PreTokenizer:
    """A chain of split rules, applied in order to every piece of the previous rule.

    `at_start` (for a Metaspace rule whose prepend_scheme is "first"): the
    text begins the input, so the first piece gets the "▁" in front. No rule
    before a Metaspace removes text (`from_hf_json` refuses that), so the
    first piece starts where the text does."""

    rules: tuple[SplitRule | PrefixSpace | Metaspace, ...]

    def __call__(self, text: str, at_start: bool = True) -> list[str]:
        pieces = [text]
        for rule in self.rules:
            if isinstance(rule, Metaspace):
                pieces = [
                    p
                    for k, piece in enumerate(pieces)
                    for p in rule.split_at(piece, at_start and k == 0)
                ]
            elif len(pieces) == 1:
                pieces = rule.split(pieces[0])
            else:
                pieces = [p for piece in pieces for p in rule.split(piece)]
        return pieces


# --------------------------------------------------------------------------- HF


def from_hf_json(spec: Mapping[str, Any] | None) -> PreTokenizer:
    """Build the pre-tokenizer of a `tokenizer.json` (`pre_tokenizer` object).

    Supported: `Split`, `Digits`, `ByteLevel` (which must come last: it maps
    bytes, and a rule after it would see the byte alphabet), `Metaspace`
    (SentencePiece-style files; the loader keeps it from byte-level ones), and
    `Sequence` of those. Anything else is refused by name.
    """
    if spec is None:
        return PreTokenizer(rules=())
    steps = _flatten(spec)
    rules: list[SplitRule | PrefixSpace | Metaspace] = []
    for i, step in enumerate(steps):
        kind = step.get("type")
        if kind == "Split":
            rules.append(_hf_split(step))
        elif kind == "Metaspace":
            if any(isinstance(r, SplitRule) and r.behavior == "removed" for r in rules):
                # Then the first piece may not start the text; "first" would need offsets.
                raise ValueError(
                    "pre-tokenizer: a Metaspace after a Split that removes text is not supported"
                )
            rules.append(metaspace_from_hf_json(step))
        elif kind == "Digits":
            behavior = "isolated" if step.get("individual_digits", False) else "contiguous"
            rules.append(SplitRule(DIGIT_PATTERN, behavior))
        elif kind == "ByteLevel":
            if i != len(steps) - 1:
                raise ValueError("pre-tokenizer: ByteLevel must be the last step of the Sequence")
            if step.get("add_prefix_space", False):
                rules.append(PrefixSpace())
            if step.get("use_regex", True):
                rules.append(SplitRule(GPT2_PATTERN))
        else:
            raise ValueError(
                f"pre-tokenizer type {kind!r} is not supported (Split, Digits, ByteLevel, "
                "Metaspace)"
            )
    return PreTokenizer(rules=tuple(rules))


def _flatten(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    if spec.get("type") == "Sequence":
        return [s for sub in spec.get("pretokenizers", []) for s in _flatten(sub)]
    return [spec]


def metaspace_from_hf_json(step: Mapping[str, Any]) -> Metaspace:
    """HF's Metaspace as `tokenizers` reads it: prepend_scheme "always" and split
    true by default; older files say add_prefix_space, whose false means "never"
    (and contradicts any other scheme written beside it)."""
    for key, want in (("replacement", str), ("prepend_scheme", str), ("split", bool)):
        value = step.get(key)
        if (value is not None or key == "replacement" and key in step) and not isinstance(
            value, want
        ):
            kind = "a string" if want is str else "true or false"
            raise ValueError(f"Metaspace {key} is {value!r}, expected {kind}")
    scheme = step.get("prepend_scheme")
    if step.get("add_prefix_space") is False:
        if scheme not in (None, "never"):
            raise ValueError(
                f"Metaspace add_prefix_space false contradicts prepend_scheme {scheme!r}"
            )
        scheme = "never"
    split = step.get("split")
    return Metaspace(
        replacement=step.get("replacement", "\u2581"),
        prepend_scheme="always" if scheme is None else scheme,
        split=True if split is None else split,
    )


def _hf_split(step: Mapping[str, Any]) -> SplitRule:
    pattern = step.get("pattern", {})
    if "Regex" in pattern:
        source = pattern["Regex"]
    elif "String" in pattern:
        source = regex.escape(pattern["String"])
    else:
        raise ValueError(f"Split pre-tokenizer without a Regex or String pattern: {step!r}")
    behavior = _HF_BEHAVIOR.get(step.get("behavior", "Isolated"))
    if behavior is None:
        raise ValueError(f"Split pre-tokenizer: unknown behavior {step.get('behavior')!r}")
    return SplitRule(source, behavior, bool(step.get("invert", False)))


# ------------------------------------------------------------------------- GGUF


@dataclass(frozen=True)
class GgufPre:
    """What a `tokenizer.ggml.pre` name means, following llama.cpp's llama-vocab.cpp."""

    patterns: tuple[str, ...]  # split rules, applied in order (all Isolated)
    ignore_merges: bool  # a pre-token that is a whole vocabulary entry skips BPE
    add_bos: bool  # default when the file has no tokenizer.ggml.add_bos_token


_LLAMA3 = GgufPre((LLAMA3_PATTERN,), ignore_merges=True, add_bos=True)
# StarCoder's tokenizer (which SmolLM reuses): every digit alone, then GPT-2's
# pattern; its tokenizer.json says Sequence[Digits(individual), ByteLevel].
_STARCODER = GgufPre((DIGIT_PATTERN, GPT2_PATTERN), ignore_merges=False, add_bos=False)
_GPT2 = GgufPre((GPT2_PATTERN,), ignore_merges=False, add_bos=False)
# Qwen's files set add_bos_token false; llama.cpp's BPE default is no BOS anyway.
# (Unlike HF, llama.cpp puts no NFC normalizer before the split: a decomposed
# "é" gives other ids here than with Qwen's tokenizer.json.)
_QWEN2 = GgufPre((QWEN2_PATTERN,), ignore_merges=False, add_bos=False)

GGUF_PRE: dict[str, GgufPre] = {
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smollm": _STARCODER,
    "starcoder": _STARCODER,
    "gpt2": _GPT2,
    # llama.cpp maps these to its QWEN2 pre-tokenizer (Qwen3 files say "qwen2" too).
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}


def from_gguf_pre(name: str) -> GgufPre:
    try:
        return GGUF_PRE[name]
    except KeyError:
        known = ", ".join(sorted(GGUF_PRE))
        raise ValueError(
            f"GGUF pre-tokenizer {name!r} (tokenizer.ggml.pre) is not supported; known: {known}"
        ) from None


def gguf_pretokenizer(pre: GgufPre) -> PreTokenizer:
    return PreTokenizer(rules=tuple(SplitRule(p) for p in pre.patterns))
