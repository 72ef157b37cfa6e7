"""Reading a tokenizer out of model files into one plain `TokenizerSpec`.

Owns: parsing `tokenizer.json` (+ `tokenizer_config.json` and
`generation_config.json` beside it) and GGUF `tokenizer.*` metadata, and the
decisions that follow from them: which tokens are special, which ids
`add_special_tokens` puts around the text, which ids end a turn. Does not own:
encoding or decoding (`tokenizer.py`). Unknown or unsupported options are
refused by name, never ignored.

Where BOS comes from (for `encode(..., add_special_tokens=True)`), first match wins:
1. `tokenizer_config.json` says `add_bos_token`/`add_eos_token`: those (this
   is what transformers does, rebuilding the post-processor);
2. the `tokenizer.json` post-processor is `TemplateProcessing`: its ids
   before and after `$A`;
3. otherwise, a Llama 3 vocabulary (one with `<|begin_of_text|>`) gets BOS:
   the Llama 3.0 `tokenizer.json` has a ByteLevel post-processor that adds
   nothing, a bug Meta later fixed with `TemplateProcessing`, and llama.cpp
   adds BOS for every `llama-bpe` model.
For GGUF: `tokenizer.ggml.add_bos_token` if present, else the default of the
`tokenizer.ggml.pre` type (Llama 3: yes; gpt2, smollm: no).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any, NoReturn

from pagedllm.gguf_metadata import read_gguf_metadata
from pagedllm.tokenizer.pretokenize import (
    PreTokenizer,
    from_gguf_pre,
    from_hf_json,
    gguf_pretokenizer,
)

# Tokens that end a turn or a document in common chat models; each one present
# as a special token joins `eos_token_ids` (llama.cpp keeps a similar list).
END_OF_TURN_TOKENS = (
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
)
LLAMA3_BOS = "<|begin_of_text|>"

# GGUF token types (llama.cpp's llama_token_type).
GGUF_NORMAL, GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_UNUSED, GGUF_BYTE = range(1, 7)


@dataclass(frozen=True)
class AddedToken:
    """A token matched whole in the text before pre-tokenization (HF's added token).

    special: a control token (BOS, <|eot_id|>, <|im_start|>): only matched where
        the caller allows it, dropped by `decode(skip_special_tokens=True)`.
    lstrip / rstrip: the match also swallows the whitespace on that side.
    """

    id: int
    content: str
    special: bool
    lstrip: bool = False
    rstrip: bool = False


@dataclass
class TokenizerSpec:
    vocab: dict[str, int]  # byte-level string -> id (model vocabulary)
    merges: list[tuple[str, str]]  # in rank order
    pretokenizer: PreTokenizer
    ignore_merges: bool = False
    added_tokens: list[AddedToken] = field(default_factory=list)
    prefix_ids: tuple[int, ...] = ()  # put before the text by add_special_tokens
    suffix_ids: tuple[int, ...] = ()  # and after it
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra_eos_ids: tuple[int, ...] = ()  # generation_config / GGUF eot, eom
    chat_template: str | None = None
    special_token_strings: dict[str, str] = field(default_factory=dict)  # for templates
    source: str = ""


# ------------------------------------------------------------------ tokenizer.json


def load_tokenizer_json(path: str | Path) -> TokenizerSpec:
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    model = data.get("model") or {}
    if model.get("type", "BPE") != "BPE":
        raise ValueError(f"{path}: model type {model.get('type')!r} is not supported (only BPE)")
    _check_bpe_options(path, model)
    if data.get("normalizer") not in (None, {"type": "Sequence", "normalizers": []}):
        kind = data["normalizer"].get("type")
        raise ValueError(f"{path}: normalizer {kind!r} is not supported (byte-level BPE has none)")
    decoder = data.get("decoder")
    if decoder is not None and decoder.get("type") != "ByteLevel":
        raise ValueError(f"{path}: decoder {decoder.get('type')!r} is not supported (ByteLevel)")

    vocab: dict[str, int] = dict(model["vocab"])
    merges = _parse_merges(path, model.get("merges", []))
    added = [
        AddedToken(
            id=int(t["id"]),
            content=t["content"],
            special=bool(t.get("special", False)),
            lstrip=bool(t.get("lstrip", False)),
            rstrip=bool(t.get("rstrip", False)),
        )
        for t in data.get("added_tokens", [])
    ]
    spec = TokenizerSpec(
        vocab=vocab,
        merges=merges,
        pretokenizer=from_hf_json(data.get("pre_tokenizer")),
        ignore_merges=bool(model.get("ignore_merges", False)),
        added_tokens=added,
        source=str(path),
    )
    token_to_id = {**vocab, **{t.content: t.id for t in added}}
    template_ids = _template_processing(path, data.get("post_processor"), token_to_id)
    config = _read_json_beside(path, "tokenizer_config.json")
    _apply_tokenizer_config(spec, config, token_to_id, template_ids)
    generation = _read_json_beside(path, "generation_config.json")
    spec.extra_eos_ids = _as_ids(generation.get("eos_token_id"))
    return spec


def _check_bpe_options(path: Path, model: Mapping[str, Any]) -> None:
    if model.get("dropout") not in (None, 0, 0.0):
        raise ValueError(f"{path}: BPE dropout is not supported")
    if model.get("byte_fallback"):
        raise ValueError(f"{path}: byte_fallback BPE (SentencePiece style) is not supported")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise ValueError(f"{path}: BPE option {key}={model[key]!r} is not supported")


def _parse_merges(path: Path, merges: list[Any]) -> list[tuple[str, str]]:
    # Older files write "a b"; newer ones (tokenizers >= 0.20) write ["a", "b"].
    try:
        # Fast path (map runs in C): all strings, the common case.
        pairs = list(map(tuple, map(str.split, merges, repeat(" "))))
    except TypeError:
        pairs = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    if any(len(p) != 2 for p in pairs):
        bad = next(m for m, p in zip(merges, pairs) if len(p) != 2)
        raise ValueError(f"{path}: malformed merge {bad!r}; expected two symbols")
    return pairs


def _template_processing(
    path: Path, post: Mapping[str, Any] | None, token_to_id: Mapping[str, int]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(ids before $A, ids after $A) of a TemplateProcessing, or None when there is none."""
    if post is None:
        return None
    kind = post.get("type")
    if kind == "Sequence":
        found = [_template_processing(path, p, token_to_id) for p in post.get("processors", [])]
        found = [f for f in found if f is not None]
        return found[-1] if found else None
    if kind == "ByteLevel":
        return None  # only adjusts offsets
    if kind != "TemplateProcessing":
        raise ValueError(f"{path}: post-processor {kind!r} is not supported")
    specials = post.get("special_tokens", {})
    before: list[int] = []
    after: list[int] = []
    seen_sequence = False
    for item in post.get("single", []):
        if "Sequence" in item:
            seen_sequence = True
            continue
        name = item["SpecialToken"]["id"]
        ids = specials.get(name, {}).get("ids") or [token_to_id[name]]
        (after if seen_sequence else before).extend(int(i) for i in ids)
    return tuple(before), tuple(after)


def _read_json_beside(path: Path, name: str) -> dict[str, Any]:
    other = path.with_name(name)
    if not other.is_file():
        return {}
    with open(other, encoding="utf-8") as f:
        return json.load(f)


def _token_string(value: Any) -> str | None:
    # tokenizer_config.json writes a token either as a string or as an AddedToken dict.
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _pick_template(value: Any) -> str | None:
    # Either one template, or a list of {"name", "template"} of which "default" is the chat one.
    if value is None or isinstance(value, str):
        return value
    by_name = {t["name"]: t["template"] for t in value}
    return by_name.get("default")


def _apply_tokenizer_config(
    spec: TokenizerSpec,
    config: Mapping[str, Any],
    token_to_id: Mapping[str, int],
    template_ids: tuple[tuple[int, ...], tuple[int, ...]] | None,
) -> None:
    strings = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        s = _token_string(config.get(key))
        if s is not None:
            strings[key] = s
    is_llama3 = LLAMA3_BOS in token_to_id
    if "bos_token" not in strings:
        if template_ids and template_ids[0]:
            strings["bos_token"] = _id_to_string(spec, template_ids[0][0])
        elif is_llama3:
            strings["bos_token"] = LLAMA3_BOS
    if "eos_token" not in strings and is_llama3:
        strings["eos_token"] = "<|end_of_text|>"
    spec.special_token_strings = strings
    spec.bos_token_id = token_to_id.get(strings.get("bos_token", ""))
    spec.eos_token_id = token_to_id.get(strings.get("eos_token", ""))

    if "add_bos_token" in config or "add_eos_token" in config:  # rule 1
        bos = (
            (spec.bos_token_id,)
            if config.get("add_bos_token") and spec.bos_token_id is not None
            else ()
        )
        eos = (
            (spec.eos_token_id,)
            if config.get("add_eos_token") and spec.eos_token_id is not None
            else ()
        )
        spec.prefix_ids, spec.suffix_ids = bos, eos
    elif template_ids is not None:  # rule 2
        spec.prefix_ids, spec.suffix_ids = template_ids
    elif is_llama3:  # rule 3
        spec.prefix_ids = (token_to_id[LLAMA3_BOS],)
    spec.chat_template = _pick_template(config.get("chat_template"))


def _id_to_string(spec: TokenizerSpec, token_id: int) -> str:
    for t in spec.added_tokens:
        if t.id == token_id:
            return t.content
    for s, i in spec.vocab.items():
        if i == token_id:
            return s
    raise ValueError(f"{spec.source}: post-processor names id {token_id}, which has no token")


# ------------------------------------------------------------------------- GGUF


def load_gguf(path: str | Path) -> TokenizerSpec:
    meta = read_gguf_metadata(path, prefix="tokenizer.")
    return spec_from_gguf_metadata(meta, source=str(path))


def spec_from_gguf_metadata(meta: Mapping[str, Any], source: str = "<gguf>") -> TokenizerSpec:
    """A `TokenizerSpec` from GGUF `tokenizer.*` metadata.

    Every key is checked for its type (and the token arrays for their lengths)
    before use: a missing or malformed key is a ValueError naming it, never a
    KeyError, TypeError or a vocabulary silently cut short by `zip`."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"{source}: tokenizer.ggml.model {model!r} is not supported (only 'gpt2', byte-level BPE)"
        )
    if "tokenizer.ggml.pre" not in meta:
        raise ValueError(f"{source}: no tokenizer.ggml.pre; cannot tell which pre-tokenizer to use")
    pre_name = meta["tokenizer.ggml.pre"]
    if not isinstance(pre_name, str):
        _bad_key(source, "tokenizer.ggml.pre", pre_name, "a string")
    pre = from_gguf_pre(pre_name)
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(
            f"{source}: no tokenizer.ggml.tokens; the file carries no vocabulary, so no "
            "tokenizer can be built from it (is it a complete llama.cpp model file?)"
        )
    tokens = _str_array(meta, "tokenizer.ggml.tokens", source)
    if not tokens:
        _bad_key(source, "tokenizer.ggml.tokens", tokens, "a non-empty array of strings")
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        types = [GGUF_NORMAL] * len(tokens)
    elif not isinstance(types, list) or not all(_is_int(t) for t in types):
        _bad_key(source, "tokenizer.ggml.token_type", types, "an array of integers")
    elif len(types) != len(tokens):
        raise ValueError(
            f"{source}: tokenizer.ggml.token_type has {len(types)} entries but "
            f"tokenizer.ggml.tokens has {len(tokens)}; they must match one to one"
        )
    merges = []
    for m in _str_array(meta, "tokenizer.ggml.merges", source):
        # Split at the first space after position 0, as llama.cpp does.
        cut = m.find(" ", 1)
        if cut < 0:
            raise ValueError(f"{source}: malformed merge {m!r} in tokenizer.ggml.merges")
        merges.append((m[:cut], m[cut + 1 :]))

    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        vocab.setdefault(tok, i)
        if kind in (GGUF_CONTROL, GGUF_UNKNOWN, GGUF_USER_DEFINED):
            # llama.cpp: control and unknown tokens are parsed in text only when
            # special tokens are allowed; user-defined ones always.
            added.append(AddedToken(id=i, content=tok, special=kind != GGUF_USER_DEFINED))

    def token_id(key: str) -> int | None:
        """The id under `key`; None when absent or outside the vocabulary (llama.cpp
        ignores such an id too)."""
        value = meta.get(key)
        if value is None:
            return None
        if not _is_int(value):
            _bad_key(source, key, value, "an integer token id")
        return value if 0 <= value < len(tokens) else None

    def flag(key: str, default: bool) -> bool:
        value = meta.get(key, default)
        if not isinstance(value, bool):
            _bad_key(source, key, value, "a bool")
        return value

    bos = token_id("tokenizer.ggml.bos_token_id")
    eos = token_id("tokenizer.ggml.eos_token_id")
    add_bos = flag("tokenizer.ggml.add_bos_token", pre.add_bos)
    add_eos = flag("tokenizer.ggml.add_eos_token", False)
    chat_template = meta.get("tokenizer.chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        _bad_key(source, "tokenizer.chat_template", chat_template, "a string")
    strings = {}
    for key, name in (
        ("tokenizer.ggml.bos_token_id", "bos_token"),
        ("tokenizer.ggml.eos_token_id", "eos_token"),
        ("tokenizer.ggml.unknown_token_id", "unk_token"),
        ("tokenizer.ggml.padding_token_id", "pad_token"),
    ):
        tid = token_id(key)
        if tid is not None:
            strings[name] = tokens[tid]
    extra = tuple(
        tid
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if (tid := token_id(key)) is not None
    )
    return TokenizerSpec(
        vocab=vocab,
        merges=merges,
        pretokenizer=gguf_pretokenizer(pre),
        ignore_merges=pre.ignore_merges,
        added_tokens=added,
        prefix_ids=(bos,) if add_bos and bos is not None else (),
        suffix_ids=(eos,) if add_eos and eos is not None else (),
        bos_token_id=bos,
        eos_token_id=eos,
        extra_eos_ids=extra,
        chat_template=chat_template,
        special_token_strings=strings,
        source=source,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad_key(source: str, key: str, value: Any, expected: str) -> NoReturn:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise ValueError(f"{source}: {key} is {shown}, expected {expected}")


def _str_array(meta: Mapping[str, Any], key: str, source: str) -> list[str]:
    """The array of strings under `key` ([] when absent)."""
    value = meta.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        _bad_key(source, key, value, "an array of strings")
    return value
