"""`Tokenizer`: text <-> token ids for byte-level BPE models, identical to HF `tokenizers`.

Owns: the encode pipeline (added tokens -> pre-tokens -> BPE ids), decode,
the special-token bookkeeping (BOS, the ids that end a turn, which ids are
special) and the entry points that load a tokenizer from model files. Does
not own: file parsing (`loaders.py`), the merge loop (`bpe.py`), Jinja
(`chat_template.py`) or streaming (`detokenizer.py`).

encode, step by step:
1. cut out added tokens (leftmost, longest first); special ones only when
   `allow_special` (see below);
2. pre-tokenize each stretch of plain text between them (`pretokenize.py`);
3. BPE each pre-token through a cache (`bpe.py`);
4. with `add_special_tokens`, put the model's BOS (and EOS, if it wants one)
   around the result.

`allow_special` defaults to True, as in HF `tokenizers` and vLLM: a string
like "<|eot_id|>" in the text becomes that one control token. That is what
chat-template output needs (the template writes the control tokens as text).
For text from a user that must not be able to forge a turn boundary, pass
`allow_special=False`: control tokens are then spelled out as ordinary text.
Non-special added tokens are always matched (they are vocabulary, not control).

decode maps each id to its bytes (the byte-level string of a vocabulary
token, or the text of an added token), joins them and decodes UTF-8 with
U+FFFD for invalid bytes, exactly as `tokenizers`' ByteLevel decoder does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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


class Tokenizer:
    """A byte-level BPE tokenizer (Llama 3, SmolLM2, GPT-2 family)."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.source = spec.source
        self._bpe = BytePairEncoder(spec.vocab, spec.merges, ignore_merges=spec.ignore_merges)
        self._pretokenize = spec.pretokenizer
        self._prefix_ids = spec.prefix_ids
        self._suffix_ids = spec.suffix_ids
        self.chat_template: str | None = spec.chat_template
        self._special_strings = dict(spec.special_token_strings)

        # id -> token string: the model vocabulary, then added tokens (which may
        # extend it, as Llama 3's 256 specials do past the 128000 BPE entries).
        id_to_token: dict[int, str] = {i: s for s, i in spec.vocab.items()}
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
        self._id_to_token: list[str | None] = [None] * self.vocab_size
        for i, s in id_to_token.items():
            self._id_to_token[i] = s
        # What decode emits for each id; holes in the id space emit nothing.
        self._id_to_bytes: list[bytes] = [
            b"" if s is None else token_bytes(s) for s in self._id_to_token
        ]
        self._token_to_id: dict[str, int] = {s: i for i, s in id_to_token.items()}
        self._token_to_id.update({s: i for s, i in spec.vocab.items()})
        self._token_to_id.update({t.content: t.id for t in spec.added_tokens})

        self.special_token_ids: frozenset[int] = frozenset(
            t.id for t in spec.added_tokens if t.special
        )
        self.added_tokens: tuple[AddedToken, ...] = tuple(spec.added_tokens)
        # Two matchers: every added token, and the non-special ones only.
        self._added_all = _AddedTokenMatcher(spec.added_tokens)
        self._added_plain = _AddedTokenMatcher([t for t in spec.added_tokens if not t.special])
        # Any special token's text, longest first (for `encode_chat`).
        specials = sorted(
            (t.content for t in spec.added_tokens if t.special and t.content), key=len
        )
        self._special_pattern = (
            regex.compile("|".join(regex.escape(c) for c in reversed(specials)))
            if specials
            else None
        )

        self.bos_token_id: int | None = spec.bos_token_id
        self.eos_token_ids: tuple[int, ...] = self._end_of_turn_ids(spec)

        if self.chat_template is None and LLAMA3_BOS in self._token_to_id:
            if "<|start_header_id|>" in self._token_to_id and "<|eot_id|>" in self._token_to_id:
                self.chat_template = LLAMA3_INSTRUCT_TEMPLATE

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
            ids += self._encode_plain(text)
        else:
            pos = 0
            for m in matcher.pattern.finditer(text):
                start, end = m.span()
                if start > pos:
                    ids += self._encode_plain(text[pos:start])
                ids.append(matcher.group_ids[m.lastindex])
                pos = end
            if pos < len(text):
                ids += self._encode_plain(text[pos:])
        if add_special_tokens:
            ids += self._suffix_ids
        return ids

    def encode_batch(
        self, texts: Iterable[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def _encode_plain(self, text: str) -> list[int]:
        """Ids of text that holds no added token: pre-tokenize, then BPE each piece."""
        if not text:
            return []
        return self._bpe.encode_pieces(self._pretokenize(text))

    # ------------------------------------------------------------------- decode

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; invalid UTF-8 (a character cut in half) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = False) -> bytes:
        """The raw bytes of `ids` (what `decode` decodes)."""
        self._check_ids(ids)
        table = self._id_to_bytes
        if skip_special_tokens:
            special = self.special_token_ids
            return b"".join([table[i] for i in ids if i not in special])
        return b"".join([table[i] for i in ids])

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
            special = self._special_pattern
            if isinstance(content, str) and special is not None and special.search(content):
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

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
            f"bos_token_id={self.bos_token_id}, eos_token_ids={self.eos_token_ids})"
        )


class _AddedTokenMatcher:
    """One regex that finds added tokens in text, leftmost first, longest on a tie.

    `regex` alternation takes the first alternative that matches at a position,
    so sorting by length (longest first) gives HF's leftmost-longest rule: in
    "<|eot_id|>" it is never a shorter added token that wins. Each alternative
    is a capture group; `group_ids[m.lastindex]` is the matched token's id.
    """

    def __init__(self, tokens: Sequence[AddedToken]) -> None:
        ordered = sorted(tokens, key=lambda t: (-len(t.content), t.id))
        ordered = [t for t in ordered if t.content]
        self.group_ids: list[int] = [-1]  # group 0 is the whole match
        parts = []
        for t in ordered:
            left = r"\s*" if t.lstrip else ""
            right = r"\s*" if t.rstrip else ""
            parts.append(f"{left}({regex.escape(t.content)}){right}")
            self.group_ids.append(t.id)
        self.pattern: regex.Pattern | None = regex.compile("|".join(parts)) if parts else None
