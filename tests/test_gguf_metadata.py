"""The shared GGUF header reader: same values as the file's own writer put in,
and a clear ValueError (never struct.error or a hang) on a damaged file."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.gguf_metadata import read_gguf_metadata
from pagedllm.resolve import default_model_path
from pagedllm.tokenizer import Tokenizer
from pagedllm.tokenizer.loaders import spec_from_gguf_metadata


@pytest.fixture(scope="module")
def smol_bytes() -> bytes:
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with open(path, "rb") as f:
        return f.read(2_000_000)  # the header (key/values and tensor infos) and more


def test_reads_the_default_model_header(smollm2_path):
    md = read_gguf_metadata(smollm2_path)
    assert md["general.architecture"] == "llama"
    assert md["llama.block_count"] == 30
    assert len(md["tokenizer.ggml.tokens"]) == 49152
    assert md["tokenizer.ggml.add_bos_token"] is False
    only = read_gguf_metadata(smollm2_path, prefix="tokenizer.")
    assert only and all(k.startswith("tokenizer.") for k in only)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.integers(min_value=0, max_value=1_500_000))
def test_truncated_header_is_a_clear_error(tmp_path_factory, smol_bytes, cut):
    path = tmp_path_factory.mktemp("g") / "cut.gguf"
    path.write_bytes(smol_bytes[:cut])
    try:
        md = read_gguf_metadata(path)
    except ValueError as e:
        assert str(path) in str(e)
    else:  # the cut fell after the key/values: what was read is whole
        assert len(md["tokenizer.ggml.tokens"]) == 49152


def test_tokenizer_from_a_truncated_gguf_names_the_file(tmp_path, smol_bytes):
    path = tmp_path / "broken.gguf"
    path.write_bytes(smol_bytes[:5000])
    with pytest.raises(ValueError, match="broken.gguf.*truncated"):
        Tokenizer.from_gguf(path)


# ----- the tokenizer's keys: missing or malformed is a ValueError naming the key -----------

TOKENIZER_META: dict = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "gpt2",
    "tokenizer.ggml.tokens": ["a", "b", "ab", "<s>"],
    "tokenizer.ggml.token_type": [1, 1, 1, 3],
    "tokenizer.ggml.merges": ["a b"],
    "tokenizer.ggml.bos_token_id": 3,
}


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("tokenizer.ggml.tokens", None, "no tokenizer.ggml.tokens"),
        ("tokenizer.ggml.tokens", "abc", "tokenizer.ggml.tokens is 'abc', expected an array"),
        ("tokenizer.ggml.tokens", [1, 2], "tokenizer.ggml.tokens is .*expected an array of str"),
        ("tokenizer.ggml.tokens", [], "tokenizer.ggml.tokens is \\[\\], expected a non-empty"),
        ("tokenizer.ggml.token_type", [1, 1], "tokenizer.ggml.token_type has 2 entries but"),
        ("tokenizer.ggml.token_type", ["x"] * 4, "tokenizer.ggml.token_type is .*integers"),
        ("tokenizer.ggml.merges", [7], "tokenizer.ggml.merges is \\[7\\], expected an array"),
        ("tokenizer.ggml.merges", ["ab"], "malformed merge 'ab' in tokenizer.ggml.merges"),
        ("tokenizer.ggml.pre", ["gpt2"], "tokenizer.ggml.pre is \\['gpt2'\\], expected a string"),
        ("tokenizer.ggml.bos_token_id", "3", "tokenizer.ggml.bos_token_id is '3', expected"),
        ("tokenizer.ggml.bos_token_id", [3], "tokenizer.ggml.bos_token_id is \\[3\\], expected"),
        ("tokenizer.ggml.add_bos_token", "yes", "tokenizer.ggml.add_bos_token is 'yes'"),
        ("tokenizer.chat_template", 5, "tokenizer.chat_template is 5, expected a string"),
    ],
)
def test_malformed_tokenizer_metadata_names_the_key(key: str, value: object, says: str) -> None:
    meta = dict(TOKENIZER_META)
    if value is None:
        del meta[key]
    else:
        meta[key] = value
    with pytest.raises(ValueError, match=f"^t.gguf: {says}"):
        spec_from_gguf_metadata(meta, source="t.gguf")


def test_tokenizer_metadata_that_is_well_formed_loads() -> None:
    spec = spec_from_gguf_metadata(TOKENIZER_META, source="t.gguf")
    assert spec.vocab == {"a": 0, "b": 1, "ab": 2, "<s>": 3} and spec.merges == [("a", "b")]
    assert spec.bos_token_id == 3 and [t.id for t in spec.added_tokens] == [3]


def test_gguf_file_without_tokens_names_the_key(tmp_path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "notok.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="notok.gguf: no tokenizer.ggml.tokens"):
        Tokenizer.from_gguf(path)
