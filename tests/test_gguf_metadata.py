"""The shared GGUF header reader: same values as the file's own writer put in,
and a clear ValueError (never struct.error or a hang) on a damaged file."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.gguf_metadata import read_gguf_metadata
from pagedllm.model.resolve import default_model_path
from pagedllm.tokenizer import Tokenizer


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
