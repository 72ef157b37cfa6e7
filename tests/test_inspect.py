"""`pagedllm inspect`: the tensor table it prints is the file's.

Oracles: the `gguf` package's `GGUFReader` for a GGUF file (the default
model: names, shapes, ggml types, absolute offsets and sizes), and the
`safetensors` package for an HF directory (tiny random models, one file and
sharded: names, shapes, dtypes, and the bytes at each listed offset are the
tensor's own).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pagedllm.cli import main
from pagedllm.inspect_model import inspect_checkpoint
from tiny_models import make_tiny_llama, make_tiny_llama_dir


@pytest.fixture(scope="module")
def gguf_reader(smollm2_path):
    from gguf import GGUFReader

    return GGUFReader(smollm2_path)  # ~5 s: a numpy view per vocabulary string


def test_gguf_tensor_table_matches_gguf_reader(smollm2_path, gguf_reader):
    info = inspect_checkpoint(smollm2_path)
    assert info["format"] == "gguf" and info["file_bytes"] == smollm2_path.stat().st_size
    assert info["gguf"]["data_offset"] == gguf_reader.data_offset
    got = info["tensors"]
    want = gguf_reader.tensors
    assert [t["name"] for t in got] == [t.name for t in want]
    for ours, ref in zip(got, want):
        # GGUFReader lists dimensions fastest first; we print torch order (out, in).
        assert ours["shape"] == [int(d) for d in reversed(ref.shape)], ours["name"]
        assert ours["type"] == ref.tensor_type.name, ours["name"]
        assert ours["offset"] == ref.data_offset, ours["name"]
        assert ours["nbytes"] == ref.n_bytes, ours["name"]
    assert info["summary"]["parameters"] == sum(int(t.n_elements) for t in want)
    # What the loader would build: SmolLM2-135M, tied (no output.weight).
    c = info["config"]
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["vocab_size"] == 49152 and c["tie_word_embeddings"] and c["rope_scaling"] is None
    names = {t["name"]: t["hf_name"] for t in got}
    assert names["blk.0.attn_q.weight"] == "model.layers.0.self_attn.q_proj.weight"
    assert names["token_embd.weight"] == "model.embed_tokens.weight"


def _check_against_safetensors(model_dir: Path) -> dict:
    from safetensors import safe_open

    info = inspect_checkpoint(model_dir)
    assert info["format"] == "safetensors"
    seen = set()
    for file in sorted(model_dir.glob("*.safetensors")):
        data = file.read_bytes()
        with safe_open(file, framework="pt") as f:
            listed = {t["name"]: t for t in info["tensors"] if t["file"] == file.name}
            assert set(listed) == set(f.keys()), file.name
            for name, t in listed.items():
                ref = f.get_slice(name)
                assert t["shape"] == list(ref.get_shape()), name
                assert t["type"] == ref.get_dtype(), name
                tensor = f.get_tensor(name)
                assert t["nbytes"] == tensor.numel() * tensor.element_size(), name
                # The bytes at the offset we print are the tensor's, exactly.
                raw = data[t["offset"] : t["offset"] + t["nbytes"]]
                assert torch.equal(
                    torch.frombuffer(bytearray(raw), dtype=tensor.dtype).reshape(tensor.shape),
                    tensor,
                ), name
        seen |= set(listed)
    assert seen == {t["name"] for t in info["tensors"]}
    offsets = [(t["file"], t["offset"]) for t in info["tensors"]]
    assert offsets == sorted(offsets)  # file order
    return info


def test_safetensors_table_matches_safetensors_package(tmp_path):
    path, hf = make_tiny_llama_dir(tmp_path / "one", tie_word_embeddings=True)
    info = _check_against_safetensors(path)
    c = info["config"]
    assert (c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]) == (2, 4, 1)
    assert c["tie_word_embeddings"] and c["rope_scaling"]["factor"] == 8.0
    assert info["summary"]["tensors"] == len(info["tensors"])
    assert c["dtype"] == "float32"


def test_sharded_directory(tmp_path, capsys):
    model, _ = make_tiny_llama(seed=1)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    info = _check_against_safetensors(tmp_path / "sharded")
    assert len(info["files"]) > 1
    assert info["summary"]["parameters"] == sum(p.numel() for p in model.parameters())
    assert main(["inspect", "--model", str(tmp_path / "sharded"), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "file" in out and info["files"][1] in out


def test_the_command(capsys, smollm2_path):
    assert main(["inspect"]) == 0
    out = capsys.readouterr().out
    assert str(smollm2_path) in out and "KV heads Hkv    3 " in out and "offset" not in out
    assert main(["inspect", "--tensors"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index("") + 1 :]
    assert len(table) == 1 + 272  # the header and one line per tensor
    assert table[1].split()[:6] == ["1785664", "30081024", "Q8_0", "8.5", "49152", "x"]
    assert main(["inspect", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "tensors" not in info and info["config"]["num_hidden_layers"] == 30
    assert main(["inspect", "--json", "--tensors"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert len(info["tensors"]) == info["summary"]["tensors"] == 272
    assert info["summary"]["bytes"] == sum(t["nbytes"] for t in info["tensors"])
    assert info["summary"]["parameters"] == sum(math.prod(t["shape"]) for t in info["tensors"])


def _bad_paths(tmp: Path, smollm2_path: Path) -> dict[str, tuple[Path, str]]:
    (tmp / "empty_dir").mkdir()
    (tmp / "notes.txt").write_text("hello")
    (tmp / "garbage.gguf").write_bytes(b"not a gguf file at all, just some bytes")
    (tmp / "cut.gguf").write_bytes(smollm2_path.read_bytes()[:100_000])
    bad_st = tmp / "bad_st"
    bad_st.mkdir()
    (bad_st / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    no_weights, _ = make_tiny_llama_dir(tmp / "no_weights")
    (no_weights / "model.safetensors").unlink()
    broken, _ = make_tiny_llama_dir(tmp / "broken")
    blob = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(blob[:-10])
    return {
        "missing": (tmp / "nowhere", "not found"),
        "dir without config.json": (tmp / "empty_dir", "without config.json"),
        "not a model file": (tmp / "notes.txt", "expected a .gguf file"),
        "not GGUF": (tmp / "garbage.gguf", "bad magic"),
        "truncated GGUF": (tmp / "cut.gguf", "truncated"),
        "config without keys": (bad_st, "missing required key"),
        "no safetensors": (no_weights, "neither model.safetensors.index.json"),
        "truncated safetensors": (broken, "malformed safetensors file"),
    }


def test_bad_paths_fail_with_one_line_each(tmp_path, capsys, smollm2_path):
    cases = _bad_paths(tmp_path, smollm2_path)
    capsys.readouterr()  # transformers' progress bars
    for what, (path, says) in cases.items():
        assert main(["inspect", "--model", str(path)]) == 1, what
        err = capsys.readouterr().err
        assert err.startswith("pagedllm inspect: error: ") and says in err, (what, err)
        assert len(err.splitlines()) == 1, what
