"""`Tokenizer`: text <-> token ids, identical to HF `tokenizers` and llama.cpp.

Owns: the encode pipeline (added tokens -> the model's ids for the text
between them), decode, the special-token bookkeeping (BOS, the ids that end a
turn, which ids are special) and the entry points that load a tokenizer from
model files. Does not own: file parsing (`loaders.py`), the merge loops
(`bpe.py`, `sentencepiece.py`, `spm_bpe.py`), Jinja (`chat_template.py`) or
streaming (`detokenizer.py`).

Three models sit behind the one `Tokenizer` class:
- byte-level BPE (Llama 3, SmolLM2, Qwen; tokenizer.json or GGUF "gpt2"):
  an optional NFC normalizer, a pre-tokenizer regex, then merges by rank;
- SentencePiece-style BPE from a GGUF "llama" (Gemma, Llama 2, Mistral):
  spaces as "▁", merges by score, byte fallback, as llama.cpp
  (`sentencepiece.py`);
- SentencePiece-style BPE from a tokenizer.json (the same models' HF
  directories): spaces as "▁" by the file's normalizer or Metaspace
  pre-tokenizer, merges by rank over characters, byte fallback, as HF
  `tokenizers` (`spm_bpe.py`).
They differ only in how a stretch of plain text becomes ids (`_encode_plain`)
and in what bytes an id decodes to (`_id_to_bytes`, built once, plus the
start-of-text rules of an HF SentencePiece decoder: `start_of_text`).
Everything else is shared and identical: added and special tokens, BOS, the
ids that end a turn, chat templates, `encode_chat`, decode, the streaming
detokenizer (which reads `token_bytes`, so a byte-fallback id that is half a
character waits for the rest, exactly as a byte-level one does), pickling to
the server's tokenizer processes. So it is one class with the model inside,
not a class per model: the engine, the server and `pagedllm tokenize` keep
one type to hold and no branch on the kind.

encode, step by step:
1. cut out added tokens (leftmost, longest first); special ones only when
   `allow_special` (see below);
2. byte-level BPE: normalize (NFC, if the model has it) and pre-tokenize each
   stretch of plain text between them (`pretokenize.py`), then BPE each
   pre-token through a cache (`bpe.py`); SentencePiece from a GGUF:
   `sentencepiece.py`; from a tokenizer.json: normalize the stretch, cut out
   the added tokens marked "normalized" (matched as normalized, HF's rule),
   then pre-tokenize and merge each piece (`spm_bpe.py`);
3. with `add_special_tokens`, put the model's BOS (and EOS, if it wants one)
   around the result.

Added tokens are matched leftmost-longest, as HF `tokenizers` does. llama.cpp
instead cuts them out longest token first over the whole text; the two agree
unless two added tokens overlap with the shorter one starting first, which no
supported vocabulary has (Gemma's: runs of one character, HTML tags and
control tokens, none overlapping another; checked by a test).

`allow_special` defaults to True, as in HF `tokenizers` and vLLM: a string
like "<|eot_id|>" in the text becomes that one control token. That is what
chat-template output needs (the template writes the control tokens as text).
For text from a user that must not be able to forge a turn boundary, pass
`allow_special=False`: control tokens are then spelled out as ordinary text.
Non-special added tokens are always matched (they are vocabulary, not control).

decode maps each id to its bytes (the byte-level string of a vocabulary
token, or the text of an added token; for SentencePiece, "▁" as a space and
"<0xXX>" as that byte), joins them and decodes UTF-8 with U+FFFD for invalid
bytes, exactly as `tokenizers`' ByteLevel decoder (or its ByteFallback) does
(HF's ByteFallback writes one U+FFFD per byte of an invalid run, Python one
per invalid sequence: the one difference, on invalid text only). An HF
SentencePiece decoder's start rules then touch the first tokens: Llama 2's
drops the text's leading space, Metaspace's the first token's "▁"s.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import regex

from pagedllm.tokenizer.bpe import BytePairEncoder
from pagedllm.tokenizer.bytelevel import token_bytes
from pagedllm.tokenizer.chat_template import LLAMA3_INSTRUCT_TEMPLATE, render_chat_template
from pagedllm.tokenizer.loaders import (
    END_OF_TURN_TOKENS,
    LLAMA3_BOS,
    MAX_TOKEN_ID,
    AddedToken,
    TokenizerSpec,
    load_gguf,
    load_tokenizer_json,
)
from pagedllm.tokenizer.sentencepiece import SentencePieceModel
from pagedllm.tokenizer.spm_bpe import CharBpeModel, StartOfText

# Gemma's turn markers: a vocabulary with both, and no template of its own (Gemma's
# GGUF files carry none), gets Gemma 3's template shipped in templates/.
GEMMA_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")


class Tokenizer:
    """A byte-level BPE (Llama 3, SmolLM2, Qwen) or SentencePiece-style (Gemma,
    Llama 2, Mistral GGUF) tokenizer; see the module docstring."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.source = spec.source
        self._spm: SentencePieceModel | None = None
        self._bpe: BytePairEncoder | None = None
        self._char_bpe: CharBpeModel | None = None
        if spec.spm_bpe is not None:
            self._char_bpe = CharBpeModel(
                spec.vocab,
                spec.merges,
                spec.spm_bpe,
                spec.pretokenizer,
                ignore_merges=spec.ignore_merges,
            )
        elif spec.scores is not None:
            # One entry per id, in id order, as GGUF stores them (the loader checks it).
            tokens = list(spec.vocab)
            types = spec.token_types or [1] * len(tokens)
            if not (
                list(spec.vocab.values()) == list(range(len(tokens)))
                and len(spec.scores) == len(types) == len(tokens)
            ):
                raise ValueError(
                    f"{spec.source or 'tokenizer'}: a SentencePiece vocabulary needs ids "
                    "0..n-1 in order, with one score and one type each"
                )
            unknown = spec.vocab.get(spec.special_token_strings.get("unk_token", ""))
            self._spm = SentencePieceModel(
                tokens,
                spec.scores,
                types,
                add_space_prefix=spec.add_space_prefix,
                unknown_id=unknown,
                vocab=spec.vocab,
            )
        else:
            self._bpe = BytePairEncoder(spec.vocab, spec.merges, ignore_merges=spec.ignore_merges)
        self._normalizer = spec.normalizer
        self._pretokenize = spec.pretokenizer
        self._prefix_ids = spec.prefix_ids
        self._suffix_ids = spec.suffix_ids
        self.chat_template: str | None = spec.chat_template
        self._special_strings = dict(spec.special_token_strings)

        # id -> token string: the model vocabulary, then added tokens (which may
        # extend it, as Llama 3's 256 specials do past the 128000 BPE entries).
        id_to_token: dict[int, str] = dict(zip(spec.vocab.values(), spec.vocab))
        for t in spec.added_tokens:
            id_to_token[t.id] = t.content
        if id_to_token and not 0 <= min(id_to_token) <= max(id_to_token) < MAX_TOKEN_ID:
            # Checked before the tables below are sized by the largest id (the
            # loaders check each id; this guards a spec built in code).
            bad = next(i for i in id_to_token if not 0 <= i < MAX_TOKEN_ID)
            raise ValueError(
                f"{spec.source or 'tokenizer'}: token id {bad} is outside [0, {MAX_TOKEN_ID:,})"
            )
        self.vocab_size: int = max(id_to_token) + 1 if id_to_token else 0
        self._id_to_token: list[str | None] = list(map(id_to_token.get, range(self.vocab_size)))
        # What decode emits for each id; holes in the id space emit nothing.
        # A SentencePiece-style tokenizer.json's decoder may also have rules for
        # the start of the text (`start_of_text`).
        self._decoder = spec.spm_bpe.decoder if spec.spm_bpe is not None else None
        # A SentencePiece-style tokenizer.json's "normalized" added tokens, as
        # normalized: how they are matched, and the string HF's decoder gets
        # for them ("</s>" after Llama 2's Prepend is "▁</s>", decoded " </s>").
        normalized: list[AddedToken] = []
        if self._char_bpe is not None:
            norm = self._char_bpe.normalize
            normalized = [
                dataclasses.replace(t, content=norm(t.content))
                for t in spec.added_tokens
                if t.normalized
            ]
        self._decode_strings = self._id_to_token
        if self._spm is not None:
            self._id_to_bytes: list[bytes] = self._spm.id_to_bytes
        elif self._decoder is not None:
            if normalized:
                self._decode_strings = list(self._id_to_token)
                for t in normalized:
                    self._decode_strings[t.id] = t.content
            self._id_to_bytes = self._decoder.table(self._decode_strings)
        else:
            self._id_to_bytes = [b"" if s is None else token_bytes(s) for s in self._id_to_token]
        self._token_to_id: dict[str, int] = dict(zip(id_to_token.values(), id_to_token))
        self._token_to_id.update(spec.vocab)
        self._token_to_id.update({t.content: t.id for t in spec.added_tokens})

        self.special_token_ids: frozenset[int] = frozenset(
            t.id for t in spec.added_tokens if t.special
        )
        self.added_tokens: tuple[AddedToken, ...] = tuple(spec.added_tokens)
        # Two matchers: every added token, and the non-special ones only. A
        # SentencePiece-style tokenizer.json's "normalized" tokens are matched
        # as HF does, in the normalized text, as normalized themselves (a second
        # pair of matchers); byte-level files normalize nothing that matters
        # (at most NFC), so there every token is matched in the raw text.
        spm_json = self._char_bpe is not None
        raw = [t for t in spec.added_tokens if not (t.normalized and spm_json)]
        self._added_all = _AddedTokenMatcher(raw)
        self._added_plain = _AddedTokenMatcher([t for t in raw if not t.special])
        self._normalized_all = _AddedTokenMatcher(normalized)
        self._normalized_plain = _AddedTokenMatcher([t for t in normalized if not t.special])

        self.bos_token_id: int | None = spec.bos_token_id
        self.eos_token_ids: tuple[int, ...] = self._end_of_turn_ids(spec)

        if self.chat_template is None and LLAMA3_BOS in self._token_to_id:
            if "<|start_header_id|>" in self._token_to_id and "<|eot_id|>" in self._token_to_id:
                self.chat_template = LLAMA3_INSTRUCT_TEMPLATE
        if self.chat_template is None and all(
            self._token_to_id.get(t) in self.special_token_ids for t in GEMMA_TURN_TOKENS
        ):
            self.chat_template = gemma3_template()

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load an HF `tokenizer.json` (and the `tokenizer_config.json` beside it, if any)."""
        return cls(load_tokenizer_json(path))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer stored in a GGUF file's `tokenizer.*` metadata."""
        return cls(load_gguf(path))

    @classmethod
    def from_model_path(cls, path: str | Path | None = None) -> Tokenizer:
        """The tokenizer of a model: an HF directory, a .gguf file, a tokenizer.json,
        or (None) the default model."""
        from pagedllm.resolve import resolve_model_path, special_file_kind

        if path is None:
            path = resolve_model_path(None)
        path = Path(path).expanduser()
        kind = special_file_kind(path)
        if kind is not None:
            raise ValueError(
                f"{path} is {kind}, not a tokenizer: give an HF model directory (with "
                "tokenizer.json), a .gguf file, or a tokenizer.json"
            )
        if path.is_dir():
            tj = path / "tokenizer.json"
            if not tj.is_file():
                raise FileNotFoundError(f"{path} has no tokenizer.json")
            return cls.from_file(tj)
        if path.is_file() and path.suffix.lower() == ".gguf":
            return cls.from_gguf(path)
        if path.is_file() and path.suffix.lower() == ".json":
            return cls.from_file(path)
        raise FileNotFoundError(
            f"no tokenizer at {str(path)!r}: give an HF model directory (with tokenizer.json), "
            "a .gguf file, or a tokenizer.json"
        )

    # ------------------------------------------------------------------- encode

    def encode(
        self, text: str, add_special_tokens: bool = False, *, allow_special: bool = True
    ) -> list[int]:
        """Token ids of `text`.

        add_special_tokens: put the model's BOS (and EOS if it wants one) around
            the ids. Off by default: chat templates already write BOS as text.
        allow_special: match special-token strings in `text` as those tokens
            (HF's behaviour). Pass False for untrusted text.

        A byte the vocabulary has no token for is dropped (as HF `tokenizers`
        does), so `decode(encode(text)) == text` only when every byte of the
        text has a token. SmolLM2 lacks 0x04, 0x06, 0x13, 0x14, 0x16 and 0x1d.
        """
        ids: list[int] = list(self._prefix_ids) if add_special_tokens else []
        matcher = self._added_all if allow_special else self._added_plain
        if matcher.pattern is None:
            ids += self._encode_plain(text, True, allow_special)
        else:
            pos = 0
            for m in matcher.pattern.finditer(text):
                start, end = m.span()
                if start > pos:
                    ids += self._encode_plain(text[pos:start], pos == 0, allow_special)
                ids.append(matcher.token_id(m))
                pos = end
            if pos < len(text):
                ids += self._encode_plain(text[pos:], pos == 0, allow_special)
        if add_special_tokens:
            ids += self._suffix_ids
        return ids

    def encode_batch(
        self, texts: Iterable[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def _encode_plain(
        self, text: str, at_start: bool = True, allow_special: bool = True
    ) -> list[int]:
        """Ids of text that holds no added token (no raw-matched one): SentencePiece,
        or normalize, pre-tokenize and BPE each piece. `at_start`: the text
        begins the input (a Metaspace "first" puts its "▁" there only)."""
        if not text:
            return []
        if self._spm is not None:
            return self._spm.encode(text)
        if self._char_bpe is not None:
            return self._encode_char_bpe(text, at_start, allow_special)
        if self._normalizer is not None:
            text = unicodedata.normalize(self._normalizer, text)
        return self._bpe.encode_pieces(self._pretokenize(text))

    def _encode_char_bpe(self, text: str, at_start: bool, allow_special: bool) -> list[int]:
        """A SentencePiece-style tokenizer.json, as HF runs it on a stretch between
        raw-matched added tokens: normalize the stretch, cut out the normalized
        added tokens, then pre-tokenize and BPE each piece left."""
        model = self._char_bpe
        text = model.normalize(text)
        matcher = self._normalized_all if allow_special else self._normalized_plain
        if matcher.pattern is None:
            return model.encode(text, at_start) if text else []
        ids: list[int] = []
        pos = 0
        for m in matcher.pattern.finditer(text):
            start, end = m.span()
            if start > pos:
                ids += model.encode(text[pos:start], at_start and pos == 0)
            ids.append(matcher.token_id(m))
            pos = end
        if pos < len(text):
            ids += model.encode(text[pos:], at_start and pos == 0)
        return ids

    # ------------------------------------------------------------------- decode

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; invalid UTF-8 (a character cut in half) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = False,
        *,
        start: StartOfText | None = None,
    ) -> bytes:
        """The raw bytes of `ids` (what `decode` decodes).

        start: where a stream is in the decoder's start-of-text rules (from
            `start_of_text`, advanced here); by default the ids begin the text."""
        self._check_ids(ids)
        table = self._id_to_bytes
        if skip_special_tokens:
            special = self.special_token_ids
            ids = [i for i in ids if i not in special]
        if start is None:
            start = self.start_of_text()
        if start is None or start.done:
            return b"".join([table[i] for i in ids])
        # The rules touch the first few tokens only (the first one, then any
        # that are empty or spaces while a Strip still has spaces to drop).
        head = []
        k = 0
        while k < len(ids) and not start.done:
            head.append(start.feed(ids[k], table[ids[k]]))
            k += 1
        return b"".join(head) + b"".join([table[i] for i in ids[k:]])

    def start_of_text(self) -> StartOfText | None:
        """A fresh walk through the decoder's start-of-text rules (Metaspace's
        first token, Llama 2's Strip of a leading space), for a stream that
        begins the text; None when the decoder has none (byte-level, GGUF)."""
        if self._decoder is None or not self._decoder.has_start_rule:
            return None
        return StartOfText(self._decoder, self._decode_strings)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for (b"" for an id the vocabulary does not use)."""
        self._check_ids((token_id,))
        return self._id_to_bytes[token_id]

    def _check_ids(self, ids: Sequence[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    # --------------------------------------------------------------- vocabulary

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of an id ("Ġworld", "<|eot_id|>"), None for an unused id."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        return self._id_to_token[token_id]

    def token_to_id(self, token: str) -> int | None:
        return self._token_to_id.get(token)

    @property
    def eos_token_id(self) -> int | None:
        """The model's main EOS id (first of `eos_token_ids`)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._id_to_token[self.bos_token_id]

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` starts with BOS."""
        return self.bos_token_id is not None and self._prefix_ids[:1] == (self.bos_token_id,)

    def _end_of_turn_ids(self, spec: TokenizerSpec) -> tuple[int, ...]:
        ids: list[int] = []
        for i in (spec.eos_token_id, *spec.extra_eos_ids):
            if i is not None and i not in ids:
                ids.append(i)
        for name in END_OF_TURN_TOKENS:
            i = self._token_to_id.get(name)
            if i is not None and i in self.special_token_ids and i not in ids:
                ids.append(i)
        return tuple(ids)

    # ------------------------------------------------------------ chat template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation with the model's chat template (as transformers does).

        The result already holds the control tokens as text (and BOS, for
        templates that write it): encode it with `add_special_tokens=False`
        and the default `allow_special=True`. Any template error is a ValueError.
        """
        if self.chat_template is None:
            raise ValueError(
                f"the tokenizer from {self.source} has no chat template; "
                "give the prompt as plain text instead"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self._special_strings,
            **template_kwargs,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        allow_special_in_content: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of a rendered conversation, where a control-token string typed
        *inside a message* stays plain text (so a user's `<|eot_id|>` cannot end a
        turn), while the template's own control tokens are control tokens.

        How: a content holding a special-token string is rendered as a unique
        marker; the rendered text is split at the markers; template pieces are
        encoded with special tokens allowed and those contents without. Only
        such contents are split out (a split moves BPE boundaries at the
        surrounding whitespace), so an ordinary conversation encodes exactly as
        `encode(apply_chat_template(...))`, what transformers and vLLM feed.
        """
        if allow_special_in_content:
            return self.encode(
                self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
            )
        contents: list[str] = []
        marked = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str) and self._holds_special(content):
                marked.append({**m, "content": f"\x00pagedllm-content-{len(contents)}\x00"})
                contents.append(content)
            else:
                marked.append(m)
        text = self.apply_chat_template(marked, add_generation_prompt, **template_kwargs)
        ids: list[int] = []
        pos = 0
        for i, content in enumerate(contents):
            marker = f"\x00pagedllm-content-{i}\x00"
            at = text.find(marker, pos)
            if at < 0:  # the template transformed or dropped the content: no split possible
                return self.encode(
                    self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
                )
            ids += self.encode(text[pos:at])
            ids += self.encode(content, allow_special=False)
            pos = at + len(marker)
        ids += self.encode(text[pos:])
        return ids

    def _holds_special(self, text: str) -> bool:
        """Whether `encode(text)` (special tokens allowed) would hold a special token."""
        special = self.special_token_ids
        if not special:
            return False
        raw, normalized = self._added_all, self._normalized_all
        stretches = [text]
        if raw.pattern is not None:
            matches = list(raw.pattern.finditer(text))
            if any(raw.token_id(m) in special for m in matches):
                return True
            ends = [0, *(e for m in matches for e in m.span()), len(text)]
            stretches = [text[a:b] for a, b in zip(ends[::2], ends[1::2])]
        if normalized.pattern is None:
            return False
        # As encode does: each stretch between raw-matched tokens normalized alone.
        norm = self._char_bpe.normalize
        return any(
            normalized.token_id(m) in special
            for stretch in stretches
            if stretch
            for m in normalized.pattern.finditer(norm(stretch))
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
            f"bos_token_id={self.bos_token_id}, eos_token_ids={self.eos_token_ids})"
        )


class _AddedTokenMatcher:
    """One regex that finds added tokens in text, leftmost first, longest on a tie.

    Without lstrip/rstrip tokens (every GGUF, Qwen), the regex is the tokens'
    trie (`literal_alternation`), which finds the longest token at the
    leftmost position; the matched text names the id. Gemma has 6,414 added
    tokens: a flat alternation of them took 0.7 s to compile and 15 ms per
    1,000 characters to search, the trie a fraction of a millisecond.

    With lstrip/rstrip tokens, each token is one alternative (the token as a
    capture group, with the whitespace it strips around it), longest first
    (`regex` alternation takes the first alternative that matches at a
    position, so this is HF's leftmost-longest rule too):
    `group_ids[m.lastindex]` is the matched token's id.
    """

    def __init__(self, tokens: Sequence[AddedToken]) -> None:
        ordered = sorted(tokens, key=lambda t: (-len(t.content), t.id))
        ordered = [t for t in ordered if t.content]
        self.group_ids: list[int] = [-1]  # group 0 is the whole match
        self._ids: dict[str, int] | None = None
        self.pattern: re.Pattern | regex.Pattern | None = None
        if not ordered:
            return
        if not any(t.lstrip or t.rstrip for t in ordered):
            self._ids = {}
            for t in ordered:  # a text held by two ids: the lowest, as below
                self._ids.setdefault(t.content, t.id)
            # Plain literals: the standard library's `re` compiles this trie
            # in a quarter of `regex`'s time (40 ms for Gemma's) and searches faster.
            self.pattern = re.compile(literal_alternation(self._ids))
            return
        parts = []
        for t in ordered:
            left = r"\s*" if t.lstrip else ""
            right = r"\s*" if t.rstrip else ""
            parts.append(f"{left}({regex.escape(t.content)}){right}")
            self.group_ids.append(t.id)
        self.pattern = regex.compile("|".join(parts))

    def token_id(self, m: re.Match | regex.Match) -> int:
        """The id of the token that `m` (a match of `pattern`) found."""
        if self._ids is not None:
            return self._ids[m.group()]
        return self.group_ids[m.lastindex]


def literal_alternation(strings: Iterable[str]) -> str:
    """A regex (for `re`) for any of `strings` that matches the longest one at a position.

    Built as a trie: "ab", "abc" and "b" give `(?:ab(?:c)?|b)`. At each node
    at most one branch can match the next character, and a node that ends a
    string makes its branches optional (greedy: longer first, then the
    string itself), so the match is the longest string there. The regex
    engine then walks one path per position instead of trying every string.
    """
    trie: dict = {}
    for s in strings:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}  # "" marks the end of a string
    return _trie_regex(trie) or "(?!)"


def _trie_regex(node: dict) -> str:
    branches = []
    for ch, sub in node.items():
        if not ch:
            continue
        # A run of nodes with one child and no string ending is plain text
        # (walked in a loop: recursion only at branches keeps the depth small).
        run = [ch]
        while len(sub) == 1 and "" not in sub:
            ((c, sub),) = sub.items()
            run.append(c)
        branches.append(re.escape("".join(run)) + _trie_regex(sub))
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    if "" in node:  # a string ends here: what follows is optional
        return f"(?:{body})?"
    return body


def gemma3_template() -> str:
    """Gemma 3's chat template, shipped with the package (templates/gemma3.jinja)."""
    return (resources.files(__package__) / "templates" / "gemma3.jinja").read_text("utf-8")
