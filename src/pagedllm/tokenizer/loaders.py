"""Reading a tokenizer out of model files into one plain `TokenizerSpec`.

Owns: parsing `tokenizer.json` (+ `tokenizer_config.json` and
`generation_config.json` beside it) and GGUF `tokenizer.*` metadata, and the
decisions that follow from them: which tokens are special, which ids
`add_special_tokens` puts around the text, which ids end a turn. Does not own:
encoding or decoding (`tokenizer.py`). A tokenizer.json is byte-level BPE
(Llama 3, Qwen) or SentencePiece-style BPE (Llama 2, Mistral, Gemma: "▁" for
a space, byte fallback), told apart by its decoder (`_is_spm_style`); the
latter's normalizer and decoder are parsed by `spm_bpe.py`. Unknown or
unsupported options are refused by name, never ignored. A malformed file (a JSON array, no `model`, a
merge of `[123, null]`, a regex that does not compile, an id that is no
integer or past `MAX_TOKEN_ID`) is one ValueError naming the file and what is
wrong, raised before anything is sized by a value read from it.

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
`tokenizer.ggml.pre` type (Llama 3: yes; gpt2, smollm, qwen2: no), and yes for
a SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`), as llama.cpp.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import chain, repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import regex

from pagedllm.gguf_metadata import read_gguf_metadata
from pagedllm.tokenizer.pretokenize import (
    GgufPre,
    PreTokenizer,
    from_gguf_pre,
    from_hf_json,
    gguf_pretokenizer,
)

if TYPE_CHECKING:
    from pagedllm.tokenizer.spm_bpe import SpmBpeOptions

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

# GGUF token types (llama.cpp's llama_token_type), defined beside the SentencePiece
# model that reads them (sentencepiece.py imports nothing of this module).
from pagedllm.tokenizer.sentencepiece import (  # noqa: E402
    GGUF_CONTROL,
    GGUF_NORMAL,
    GGUF_UNKNOWN,
    GGUF_USER_DEFINED,
)


@dataclass(frozen=True)
class AddedToken:
    """A token matched whole in the text before pre-tokenization (HF's added token).

    special: a control token (BOS, <|eot_id|>, <|im_start|>): only matched where
        the caller allows it, dropped by `decode(skip_special_tokens=True)`.
    lstrip / rstrip: the match also swallows the whitespace on that side.
    normalized: matched in the normalized text, as normalized itself (HF's
        rule; read for SentencePiece-style files only, whose normalizer
        changes text: a normalized "</s>" after Llama 2's Prepend is "▁</s>").
    """

    id: int
    content: str
    special: bool
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False


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
    # A SentencePiece-style model (GGUF "llama"): one score and one GGUF token
    # type per id, in id order (`merges` is then empty). None: byte-level BPE.
    scores: list[float] | None = None
    token_types: list[int] | None = None
    add_space_prefix: bool = False
    normalizer: str | None = None  # a Unicode normal form put on text first ("NFC": Qwen)
    # A SentencePiece-style BPE from a tokenizer.json (byte fallback: Llama 2,
    # Mistral, Gemma): merges by rank over characters, its normalizer and
    # decoder (`spm_bpe.py`). None: byte-level BPE (or `scores`, GGUF).
    spm_bpe: SpmBpeOptions | None = None


# ------------------------------------------------------------------ tokenizer.json

# Token ids are below this (16x the largest vocabularies, ~256k): the tokenizer
# keeps a table of every id up to the largest, so an id of 10**9 in a damaged
# file would otherwise cost gigabytes before anything else fails.
MAX_TOKEN_ID = 1 << 22


def load_tokenizer_json(path: str | Path) -> TokenizerSpec:
    """The spec of an HF `tokenizer.json` (with the tokenizer_config.json and
    generation_config.json beside it, when present).

    Every value is checked for its type (and every id for its range) before
    use: a malformed file is one ValueError naming the file and what is wrong
    in it, never a TypeError, a KeyError or an allocation sized by an unchecked id."""
    path = Path(path)
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: the file holds a JSON {_json_type(data)}, expected an object (a tokenizer.json)"
        )
    model = data.get("model")
    if model is None:
        raise ValueError(
            f"{path}: no 'model' (the BPE vocabulary and merges); is it a tokenizer.json?"
        )
    if not isinstance(model, dict):
        _bad(path, "model", model, "an object")
    if model.get("type", "BPE") != "BPE":
        raise ValueError(
            f"{path}: model type {model.get('type')!r} is not supported; pagedllm reads BPE "
            "tokenizers only (byte-level, as Llama 3's and Qwen's, or SentencePiece-style with "
            "byte fallback, as Llama 2's, Mistral's and Gemma's)"
        )
    _check_bpe_options(path, model)
    decoder = data.get("decoder")
    spm_style = _is_spm_style(path, model, decoder)
    vocab = _parse_vocab(path, model.get("vocab"))
    merges = _parse_merges(path, model.get("merges", []), vocab)
    added = _parse_added_tokens(path, data.get("added_tokens", []))
    ignore_merges = model.get("ignore_merges", False)
    if not isinstance(ignore_merges, bool):
        _bad(path, "model.ignore_merges", ignore_merges, "true or false")
    spec = TokenizerSpec(
        vocab=vocab,
        merges=merges,
        pretokenizer=_pretokenizer(path, data.get("pre_tokenizer"), spm_style),
        ignore_merges=ignore_merges,
        added_tokens=added,
        source=str(path),
    )
    if spm_style:
        spec.spm_bpe = _spm_options(path, model, data.get("normalizer"), decoder, vocab)
    else:
        spec.normalizer = _normalizer(path, data.get("normalizer"))
    token_to_id = {**vocab, **{t.content: t.id for t in added}}
    id_space = 1 + max(token_to_id.values(), default=-1)
    template_ids = _template_processing(path, data.get("post_processor"), token_to_id, id_space)
    config_path = path.with_name("tokenizer_config.json")
    config = _read_json_beside(path, "tokenizer_config.json")
    _apply_tokenizer_config(spec, config, token_to_id, template_ids, config_path)
    generation_path = path.with_name("generation_config.json")
    generation = _read_json_beside(path, "generation_config.json")
    spec.extra_eos_ids = _as_ids(generation_path, generation.get("eos_token_id"), id_space)
    return spec


def _read_json(path: Path) -> Any:
    """The JSON in `path`; a file that is not (a FIFO, bad UTF-8, not JSON) is a
    ValueError naming it. A missing file stays a FileNotFoundError."""
    from pagedllm.resolve import special_file_kind

    kind = special_file_kind(path)
    if kind is not None:  # reading /dev/zero or a FIFO would never end
        raise ValueError(f"{path} is {kind}, not a JSON file")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a directory, not a JSON file") from None


def _read_json_beside(path: Path, name: str) -> dict[str, Any]:
    """The JSON object in the file `name` beside `path`; {} when there is none."""
    other = path.with_name(name)
    if not other.is_file():
        return {}
    data = _read_json(other)
    if not isinstance(data, dict):
        raise ValueError(f"{other}: the file holds a JSON {_json_type(data)}, expected an object")
    return data


def _normalizer(path: Path, spec: Any) -> str | None:
    """The Unicode normal form a `normalizer` puts text in: None (byte-level BPE
    usually has no normalizer) or "NFC" (Qwen2, Qwen2.5 and Qwen3), alone or as
    the one step of a Sequence. Anything else is refused by name."""
    steps = [spec]
    if isinstance(spec, dict) and spec.get("type") == "Sequence":
        steps = spec.get("normalizers")
        if not isinstance(steps, list):
            _bad(path, "normalizer normalizers", steps, "a list")
        if not steps:
            return None
    if steps == [None]:
        return None
    if len(steps) == 1 and isinstance(steps[0], dict) and steps[0].get("type") == "NFC":
        return "NFC"
    shown = spec if len(steps) != 1 else steps[0]
    raise ValueError(f"{path}: normalizer {_kind(shown)} is not supported (none, or NFC as Qwen's)")


def _check_bpe_options(path: Path, model: Mapping[str, Any]) -> None:
    if model.get("dropout") not in (None, 0, 0.0):
        raise ValueError(f"{path}: BPE dropout is not supported")
    for key in ("byte_fallback", "fuse_unk"):
        if model.get(key) is not None and not isinstance(model[key], bool):
            _bad(path, f"model.{key}", model[key], "true or false")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise ValueError(f"{path}: BPE option {key}={model[key]!r} is not supported")


def _is_spm_style(path: Path, model: Mapping[str, Any], decoder: Any) -> bool:
    """Whether the file is SentencePiece-style BPE (merges over characters, "▁"
    for a space: its decoder turns "▁" back, a Metaspace or a Sequence of
    Replace, ByteFallback, Fuse and Strip) rather than byte-level BPE (a
    ByteLevel decoder, or none). The decoder decides, as it is what makes the
    vocabulary's strings text; byte_fallback needs the SentencePiece kind."""
    from pagedllm.tokenizer.spm_bpe import DECODER_TYPES

    if isinstance(decoder, dict) and decoder.get("type") in DECODER_TYPES:
        return True
    if model.get("byte_fallback"):
        raise ValueError(
            f"{path}: a byte_fallback BPE (SentencePiece style) needs a decoder that turns "
            "'▁' back into spaces (Metaspace, or a Sequence of Replace, ByteFallback, Fuse "
            f"and Strip); this file's decoder is {_kind(decoder)}"
        )
    if decoder is not None and not (
        isinstance(decoder, dict) and decoder.get("type") == "ByteLevel"
    ):
        raise ValueError(
            f"{path}: decoder {_kind(decoder)} is not supported (ByteLevel for byte-level "
            "BPE; Metaspace, or a Sequence of Replace, ByteFallback, Fuse and Strip, for "
            "SentencePiece-style BPE)"
        )
    return False


def _spm_options(
    path: Path, model: Mapping[str, Any], normalizer: Any, decoder: Any, vocab: Mapping[str, int]
) -> SpmBpeOptions:
    """The normalizer, decoder and unknown-token rules of a SentencePiece-style file."""
    # Imported here: spm_bpe.py imports sentencepiece.py, which imports this module.
    from pagedllm.tokenizer.spm_bpe import (
        SpmBpeOptions,
        decoder_from_hf_json,
        normalizer_from_hf_json,
    )

    unk = model.get("unk_token")
    if unk is not None and not isinstance(unk, str):
        _bad(path, "model.unk_token", unk, "a string or null")
    if unk is not None and unk not in vocab:
        raise ValueError(f"{path}: model.unk_token {_shown(unk)} is not in model.vocab")
    try:
        return SpmBpeOptions(
            normalizer=normalizer_from_hf_json(normalizer),
            decoder=decoder_from_hf_json(decoder),
            byte_fallback=bool(model.get("byte_fallback", False)),
            unk_token=unk,
            fuse_unk=bool(model.get("fuse_unk", False)),
        )
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _parse_vocab(path: Path, vocab: Any) -> dict[str, int]:
    if vocab is None:
        raise ValueError(f"{path}: model has no 'vocab'")
    if not isinstance(vocab, dict):
        _bad(path, "model.vocab", vocab, "an object of token -> id")
    ids = vocab.values()
    # Checked in C first (Llama 3 has 128,000 entries); the slow loop finds the bad one.
    if ids and not (set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < MAX_TOKEN_ID):
        for token, token_id in vocab.items():
            if not _is_int(token_id) or not 0 <= token_id < MAX_TOKEN_ID:
                _bad(path, f"the id of vocab token {token!r}", token_id, _ID_RULE)
    return dict(vocab)


def _parse_merges(path: Path, merges: Any, vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    # Older files write "a b"; newer ones (tokenizers >= 0.20) write ["a", "b"].
    if not isinstance(merges, list):
        _bad(path, "model.merges", merges, 'a list of merges ("a b" or ["a", "b"])')
    # Each form is parsed in C when the list holds one form only (Llama 3 has
    # 280,147 merges); a mixed list, or one holding anything else, takes a loop.
    kinds = set(map(type, merges))
    if kinds <= {str}:
        pairs = list(map(tuple, map(str.split, merges, repeat(" "))))
    elif kinds == {list}:
        pairs = list(map(tuple, merges))
    else:
        pairs = [tuple(m.split(" ")) if isinstance(m, str) else _as_tuple(m) for m in merges]
    # str.split makes strings; a list may hold anything.
    symbols_ok = kinds <= {str} or set(map(type, chain.from_iterable(pairs))) <= {str}
    if pairs and not (symbols_ok and set(map(len, pairs)) == {2}):
        bad = next(
            m
            for m, p in zip(merges, pairs)
            if len(p) != 2 or not all(isinstance(x, str) for x in p)
        )
        raise ValueError(
            f'{path}: malformed merge {_shown(bad)}; expected two symbols ("a b" or ["a", "b"])'
        )
    # What a merge makes must be a token: encode looks every symbol up in the
    # vocabulary (HF `tokenizers` refuses such a file too). Its two parts need no
    # check here: a part that is no token never forms, so the merge never applies.
    if not all(map(vocab.__contains__, map("".join, pairs))):
        a, b = next(p for p in pairs if p[0] + p[1] not in vocab)
        raise ValueError(
            f"{path}: merge {_shown([a, b])} makes {_shown(a + b)}, which is not in model.vocab"
        )
    return pairs


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, list) else ()


def _parse_added_tokens(path: Path, tokens: Any) -> list[AddedToken]:
    if not isinstance(tokens, list):
        _bad(path, "added_tokens", tokens, "a list of objects")
    added = []
    for t in tokens:
        if not isinstance(t, dict):
            _bad(path, "an added token", t, "an object with id and content")
        token_id, content = t.get("id"), t.get("content")
        if not isinstance(content, str):
            _bad(path, f"the content of added token {token_id!r}", content, "a string")
        if not _is_int(token_id) or not 0 <= token_id < MAX_TOKEN_ID:
            _bad(path, f"the id of added token {content!r}", token_id, _ID_RULE)
        flags = {}
        for key in ("special", "lstrip", "rstrip", "normalized"):
            # A token without "normalized" is normalized unless special (HF's AddedToken.from).
            flags[key] = t.get(key, not flags["special"] if key == "normalized" else False)
            if not isinstance(flags[key], bool):
                _bad(path, f"{key} of added token {content!r}", flags[key], "true or false")
        added.append(AddedToken(id=token_id, content=content, **flags))
    return added


# The options of each pre-tokenizer step that `pretokenize.py` reads, and their types.
_PRE_OPTIONS: dict[str, dict[str, type]] = {
    "Split": {"behavior": str, "invert": bool},
    "Digits": {"individual_digits": bool},
    "ByteLevel": {"add_prefix_space": bool, "use_regex": bool, "trim_offsets": bool},
    "Metaspace": {"replacement": str, "prepend_scheme": str, "split": bool},
}


def _pretokenizer(path: Path, spec: Any, spm_style: bool = False) -> PreTokenizer:
    """`pre_tokenizer`, its shape checked here and its rules built by `pretokenize.py`
    (whose errors, and a regex that does not compile, get the file's name).
    ByteLevel goes with byte-level BPE only, Metaspace with SentencePiece-style only."""
    steps = [] if spec is None else [spec]
    while steps:
        step = steps.pop()
        if not isinstance(step, dict) or not isinstance(step.get("type"), str):
            _bad(path, "a pre_tokenizer", step, "an object with a type")
        kind = step["type"]
        if kind == ("ByteLevel" if spm_style else "Metaspace"):
            has, other = (
                ("SentencePiece-style", "byte-level")
                if spm_style
                else ("byte-level", "SentencePiece-style")
            )
            raise ValueError(
                f"{path}: pre-tokenizer {kind!r} goes with {other} BPE, but this file's "
                f"decoder makes it {has}"
            )
        if kind == "Sequence":
            subs = step.get("pretokenizers", [])
            if not isinstance(subs, list):
                _bad(path, "pre_tokenizer pretokenizers", subs, "a list")
            steps.extend(subs)
        for key, want in _PRE_OPTIONS.get(kind, {}).items():
            if step.get(key) is not None and not isinstance(step[key], want):
                _bad(path, f"{kind} pre-tokenizer {key}", step[key], _TYPE_NAMES[want])
        if kind == "Split":
            pattern = step.get("pattern", {})
            if not isinstance(pattern, dict) or not all(
                isinstance(v, str) for v in pattern.values()
            ):
                _bad(path, "a Split pattern", pattern, '{"Regex": "..."} or {"String": "..."}')
    try:
        return from_hf_json(spec)
    except regex.error as e:
        raise ValueError(
            f"{path}: pre_tokenizer regex {_shown(e.pattern)} does not compile ({e})"
        ) from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _template_processing(
    path: Path, post: Any, token_to_id: Mapping[str, int], id_space: int
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(ids before $A, ids after $A) of a TemplateProcessing, or None when there is none."""
    if post is None:
        return None
    if not isinstance(post, dict):
        _bad(path, "post_processor", post, "an object with a type")
    kind = post.get("type")
    if kind == "Sequence":
        processors = post.get("processors", [])
        if not isinstance(processors, list):
            _bad(path, "post_processor processors", processors, "a list")
        found = [_template_processing(path, p, token_to_id, id_space) for p in processors]
        found = [f for f in found if f is not None]
        return found[-1] if found else None
    if kind == "ByteLevel":
        return None  # only adjusts offsets
    if kind != "TemplateProcessing":
        raise ValueError(f"{path}: post-processor {kind!r} is not supported")
    specials = post.get("special_tokens", {})
    single = post.get("single", [])
    if not isinstance(specials, dict):
        _bad(path, "TemplateProcessing special_tokens", specials, "an object")
    if not isinstance(single, list):
        _bad(path, "TemplateProcessing single", single, "a list")
    before: list[int] = []
    after: list[int] = []
    seen_sequence = False
    for item in single:
        if isinstance(item, dict) and "Sequence" in item:
            seen_sequence = True
            continue
        token = item.get("SpecialToken") if isinstance(item, dict) else None
        name = token.get("id") if isinstance(token, dict) else None
        if not isinstance(name, str):
            _bad(
                path,
                "a TemplateProcessing item",
                item,
                '{"Sequence": ...} or {"SpecialToken": ...}',
            )
        entry = specials.get(name, {})
        ids = entry.get("ids") if isinstance(entry, dict) else None
        if not ids:
            if name not in token_to_id:
                raise ValueError(
                    f"{path}: the post-processor names {name!r}, which is no token of the vocabulary"
                )
            ids = [token_to_id[name]]
        if not isinstance(ids, list) or not all(_is_int(i) and 0 <= i < id_space for i in ids):
            _bad(path, f"the ids of post-processor token {name!r}", ids, f"ids below {id_space}")
        (after if seen_sequence else before).extend(ids)
    return tuple(before), tuple(after)


def _token_string(value: Any) -> str | None:
    # tokenizer_config.json writes a token either as a string or as an AddedToken dict.
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(path: Path, value: Any, id_space: int) -> tuple[int, ...]:
    """`eos_token_id` of generation_config.json: an id or a list of them, each a token's."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    for v in values:
        if not _is_int(v) or not 0 <= v < id_space:
            _bad(path, "eos_token_id", value, f"token ids below {id_space} (the vocabulary's)")
    return tuple(values)


def _pick_template(path: Path, value: Any) -> str | None:
    # Either one template, or a list of {"name", "template"} of which "default" is the chat one.
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        _bad(path, "chat_template", value, 'a string or a list of {"name", "template"}')
    by_name = {t["name"]: t["template"] for t in value}
    return by_name.get("default")


def _kind(value: Any) -> str:
    """How an unsupported component is named in an error: its type, else its value."""
    if isinstance(value, dict):
        return repr(value.get("type"))
    return _shown(value)


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


_ID_RULE = f"an integer in [0, {MAX_TOKEN_ID:,})"
_TYPE_NAMES = {str: "a string", bool: "true or false"}


def _json_type(value: Any) -> str:
    names = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
    return names.get(type(value), "null")


def _bad(path: Path | str, what: str, value: Any, expected: str) -> NoReturn:
    raise ValueError(f"{path}: {what} is {_shown(value)}, expected {expected}")


def _apply_tokenizer_config(
    spec: TokenizerSpec,
    config: Mapping[str, Any],
    token_to_id: Mapping[str, int],
    template_ids: tuple[tuple[int, ...], tuple[int, ...]] | None,
    config_path: Path,
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

    for key in ("add_bos_token", "add_eos_token"):
        if config.get(key) is not None and not isinstance(config[key], bool):
            _bad(config_path, key, config[key], "true or false")
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
    spec.chat_template = _pick_template(config_path, config.get("chat_template"))


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
    from pagedllm.resolve import special_file_kind

    kind = special_file_kind(Path(path))
    if kind is not None:  # a FIFO would block the read
        raise ValueError(f"{path} is {kind}, not a GGUF file")
    meta = read_gguf_metadata(path, prefix="tokenizer.")
    return spec_from_gguf_metadata(meta, source=str(path))


def spec_from_gguf_metadata(meta: Mapping[str, Any], source: str = "<gguf>") -> TokenizerSpec:
    """A `TokenizerSpec` from GGUF `tokenizer.*` metadata.

    `tokenizer.ggml.model` "gpt2" is byte-level BPE (merges, a pre-tokenizer
    named by `tokenizer.ggml.pre`); "llama" is SentencePiece-style BPE (scores
    instead of merges, byte fallback; `sentencepiece.py`), which Llama 2,
    Mistral and Gemma files use. As in llama.cpp, control and unknown tokens
    are special, user-defined ones are matched in any text, and a
    SentencePiece model adds BOS and a space prefix unless the file says no.

    Every key is checked for its type (and the token arrays for their lengths)
    before use: a missing or malformed key is a ValueError naming it, never a
    KeyError, TypeError or a vocabulary silently cut short by `zip`."""
    model = meta.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(
            f"{source}: tokenizer.ggml.model {model!r} is not supported "
            "(only 'gpt2', byte-level BPE, and 'llama', SentencePiece)"
        )
    sentencepiece = model == "llama"
    if sentencepiece:
        # No pre-tokenizer (llama.cpp ignores tokenizer.ggml.pre here), BOS on.
        pre = GgufPre((), ignore_merges=False, add_bos=True)
    else:
        if "tokenizer.ggml.pre" not in meta:
            raise ValueError(
                f"{source}: no tokenizer.ggml.pre; cannot tell which pre-tokenizer to use"
            )
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
    elif not isinstance(types, list) or not set(map(type, types)) <= {int}:
        _bad_key(source, "tokenizer.ggml.token_type", types, "an array of integers")
    elif len(types) != len(tokens):
        raise ValueError(
            f"{source}: tokenizer.ggml.token_type has {len(types)} entries but "
            f"tokenizer.ggml.tokens has {len(tokens)}; they must match one to one"
        )
    scores = _gguf_scores(meta, tokens, source) if sentencepiece else None
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
        first = vocab.setdefault(tok, i)
        if sentencepiece and first != i:
            # A merge result must name one id (llama.cpp refuses such a file too).
            raise ValueError(
                f"{source}: token {tok!r} appears twice in tokenizer.ggml.tokens "
                f"(ids {first} and {i}); a SentencePiece vocabulary must not repeat a token"
            )
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
    # Gemma's files say False; llama.cpp's default for SentencePiece is True.
    add_space_prefix = sentencepiece and flag("tokenizer.ggml.add_space_prefix", True)
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
        scores=scores,
        token_types=list(types) if sentencepiece else None,
        add_space_prefix=add_space_prefix,
    )


def _gguf_scores(meta: Mapping[str, Any], tokens: list[str], source: str) -> list[float]:
    """`tokenizer.ggml.scores`: one finite number per token (the merge order of
    a SentencePiece vocabulary, so it cannot be left out)."""
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError(
            f"{source}: tokenizer.ggml.model 'llama' (SentencePiece) needs "
            "tokenizer.ggml.scores, the score that orders its merges; the file has none"
        )
    # The type check runs in C first (Gemma has 262,144 scores).
    if not (isinstance(scores, list) and set(map(type, scores)) <= {float, int}) or not all(
        map(math.isfinite, scores)
    ):
        _bad_key(source, "tokenizer.ggml.scores", scores, "an array of finite numbers")
    if len(scores) != len(tokens):
        raise ValueError(
            f"{source}: tokenizer.ggml.scores has {len(scores)} entries but "
            f"tokenizer.ggml.tokens has {len(tokens)}; they must match one to one"
        )
    return [float(x) for x in scores]


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
