"""GGUF weights kept quantized on the CPU (issue 38 item 2): `weights/gguf_blocks.py`
and `model/cpu_packed.py`.

Oracles: `gguf.quants.dequantize` for what the blocks mean (through our own
dequantizers, which equal it bit for bit: tests/test_gguf.py), and the float32
path (`--dtype float32`: the same file dequantized at load) for the packed
model's logits and tokens.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model import cpu_packed
from pagedllm.model.cpu_packed import (
    PACKED_KERNEL_MAX_ROWS,
    Fp16Table,
    PackedEmbedding,
    PackedLinear,
    pack_matrix,
)
from pagedllm.model.loader import load_model, weight_bytes
from pagedllm.weights.gguf_blocks import GgufBlocks, int4_parts
from test_gguf import LLAMA_KV, random_k_blocks, write_gguf

Q = gguf.GGMLQuantizationType
INT4 = [Q.Q4_0, Q.Q4_1, Q.Q4_K]
INT8 = [Q.Q8_0, Q.Q5_0, Q.Q6_K]


def blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> GgufBlocks:
    """A (rows, cols) matrix of `qtype` as a file would hold it."""
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        raw = random_k_blocks(qtype, rows, cols, seed)
    else:
        w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
        raw = gguf.quants.quantize(w, qtype)
    return GgufBlocks(torch.from_numpy(np.ascontiguousarray(raw)), qtype, (rows, cols))


def oracle(b: GgufBlocks) -> torch.Tensor:
    values = gguf.quants.dequantize(b.raw.numpy(), b.qtype)
    return torch.from_numpy(np.array(values, dtype=np.float32)).view(b.shape)


@pytest.mark.parametrize("qtype", INT4, ids=lambda q: q.name)
def test_int4_parts_are_the_blocks_exactly(qtype: Q) -> None:
    b = blocks(qtype, 64, 256)
    q, scale, zero = int4_parts(b)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scale.shape == zero.shape == (64, 8)
    w = (q.float().view(64, 8, 32) - 8) * scale[..., None] + zero[..., None]
    # one float32 rounding (the + 8 d of Q4_1 / Q4_K) away from ggml's own order
    torch.testing.assert_close(w.view(64, 256), oracle(b), rtol=1e-6, atol=1e-7)


def test_int4_parts_refuse_other_types() -> None:
    with pytest.raises(ValueError, match="Q8_0 is not a 4-bit format"):
        int4_parts(blocks(Q.Q8_0, 4, 64))


def test_torch_int4_layout_is_recognised_and_read_back() -> None:
    assert cpu_packed._int4pack_block_n() in (16, 32, 64, 128, 256)
    b = blocks(Q.Q4_1, 128, 96)
    lin = PackedLinear.from_blocks([b])
    assert lin.kind == "int4"
    q, scale, zero = int4_parts(b)

    def bf(t: torch.Tensor) -> torch.Tensor:  # the kernel's scales and zeros
        return t.to(torch.bfloat16).float()

    want = (q.float().view(128, 3, 32) - 8) * bf(scale)[..., None] + bf(zero)[..., None]
    assert torch.equal(lin.weight, want.view(128, 96))


@pytest.mark.parametrize("qtype", INT4 + INT8, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 3, PACKED_KERNEL_MAX_ROWS + 5])
def test_packed_product_against_the_dequantized_matrix(qtype: Q, rows: int) -> None:
    b = blocks(qtype, 64, 256, seed=1)
    lin = PackedLinear.from_blocks([b])
    assert lin.kind == ("int4" if qtype in INT4 else "int8")
    assert lin.shape == (64, 256) and lin.dtype == torch.float32
    w = oracle(b)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    out = lin(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 64)
    ref = x @ w.t()
    # bf16 activations and scales (int4), or rows rounded to int8 (one scale a row)
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < (6e-3 if qtype in INT4 else 1.5e-2), err
    # what `.weight` says is what the kernel multiplied by
    torch.testing.assert_close(out, x @ lin.weight.t(), rtol=0.02, atol=0.02 * ref.abs().max())


def test_int8_rounding_is_at_most_half_a_step_per_row() -> None:
    b = blocks(Q.Q8_0, 32, 128, seed=3)
    lin = PackedLinear.from_blocks([b])
    w = oracle(b)
    step = lin.tensors["scale"].float()[:, None]
    assert ((lin.weight - w).abs() <= step / 2 + 1e-6).all()


def test_fused_parts_int4_only_when_all_are_4_bit() -> None:
    q4 = [blocks(Q.Q4_0, 64, 64, seed=s) for s in range(3)]
    fused = pack_matrix(q4)
    assert fused.kind == "int4" and fused.shape == (192, 64)
    x = torch.randn(2, 64)
    torch.testing.assert_close(
        fused(x), torch.cat([PackedLinear.from_blocks([p])(x) for p in q4], 1)
    )
    mixed = pack_matrix([blocks(Q.Q4_0, 64, 64), blocks(Q.Q8_0, 32, 64)])
    assert mixed.kind == "int8" and mixed.shape == (96, 64)
    assert pack_matrix([blocks(Q.Q4_0, 64, 64), torch.zeros(32, 64)]) is None


def test_head_and_embeddings() -> None:
    b = blocks(Q.Q8_0, 96, 64, seed=5)
    w = oracle(b)
    emb = PackedEmbedding(b)
    ids = torch.tensor([[0, 95], [7, 7]])
    assert torch.equal(emb[ids], w[ids])
    assert emb.shape == (96, 64) and emb.dtype == torch.float32
    table = Fp16Table(w)
    assert torch.equal(table[ids], w.half().float()[ids])
    x = torch.randn(3, 64)
    ref = x.half().float() @ w.half().float().t()
    torch.testing.assert_close(table(x), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())
    assert torch.equal(table.weight, w.half().float())
    assert table.nbytes == 96 * 64 * 2


# ----- a whole model ---------------------------------------------------------------------------

HIDDEN, HEADS, D, INTER, VOCAB = 64, 4, 16, 256, 96


def packed_llama(path: Path, types: dict[str, Q], tied: bool = True) -> Path:
    """A 2-layer Llama GGUF whose projections have `types` (by GGUF name stem)."""
    kv = {
        **LLAMA_KV,
        "llama.feed_forward_length": INTER,
        "llama.vocab_size": VOCAB,
    }
    tensors = {
        "token_embd.weight": (types.get("token_embd", Q.Q8_0), (VOCAB, HIDDEN)),
        "output_norm.weight": (Q.F32, (HIDDEN,)),
    }
    if not tied:
        tensors["output.weight"] = (Q.Q8_0, (VOCAB, HIDDEN))
    for i in range(2):
        tensors |= {
            f"blk.{i}.attn_norm.weight": (Q.F32, (HIDDEN,)),
            f"blk.{i}.ffn_norm.weight": (Q.F32, (HIDDEN,)),
            f"blk.{i}.attn_q.weight": (types.get("attn_q", Q.Q4_1), (HEADS * D, HIDDEN)),
            f"blk.{i}.attn_k.weight": (types.get("attn_k", Q.Q4_1), (2 * D, HIDDEN)),
            f"blk.{i}.attn_v.weight": (types.get("attn_v", Q.Q4_1), (2 * D, HIDDEN)),
            f"blk.{i}.attn_output.weight": (types.get("attn_output", Q.Q4_0), (HIDDEN, HEADS * D)),
            f"blk.{i}.ffn_gate.weight": (types.get("ffn_gate", Q.Q4_1), (INTER, HIDDEN)),
            f"blk.{i}.ffn_up.weight": (types.get("ffn_up", Q.Q4_1), (INTER, HIDDEN)),
            f"blk.{i}.ffn_down.weight": (types.get("ffn_down", Q.Q8_0), (HIDDEN, INTER)),
        }
    return write_gguf(path, tensors, kv)


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory) -> Path:
    return packed_llama(tmp_path_factory.mktemp("packed") / "q4.gguf", {})


def test_cpu_default_keeps_a_gguf_packed_and_float32_dequantizes(tiny_q4: Path) -> None:
    packed = load_model(tiny_q4, "cpu")
    exact = load_model(tiny_q4, "cpu", "float32")
    assert packed.packed and not exact.packed
    layer = packed.layers[0]
    assert layer.qkv_proj.kind == "int4" and layer.down_proj.kind == "int8"
    assert isinstance(packed.lm_head, Fp16Table)
    assert packed.embed_tokens is packed.lm_head  # tied: one float16 table
    assert weight_bytes(packed) < weight_bytes(exact) / 2
    # Q and K rows un-permuted as in the float path (llama.cpp permutes them in the file)
    got, want = layer.qkv_proj.weight, exact.layers[0].qkv_proj.weight
    assert ((got - want).norm() / want.norm()).item() < 5e-3  # bf16 scales and zeros
    ids = [3, 17, 5, 88, 41, 2, 60, 9]
    for n in (1, len(ids), 2 * PACKED_KERNEL_MAX_ROWS):  # the kernels, then the GEMM
        seq = (ids * 8)[:n]
        got, want = packed.forward_logits(seq), exact.forward_logits(seq)
        err = ((got - want).norm() / want.norm()).item()
        assert err < 0.02, (n, err)


def test_engine_on_a_packed_model_matches_its_own_reference_loop(tiny_q4: Path) -> None:
    """Batched and paged decoding over packed weights gives the tokens that the
    model's own no-cache greedy loop gives: the packing changes the numbers, not
    the engine's (prompts decode through the packed kernels, <= 16 rows)."""
    model = load_model(tiny_q4, "cpu")
    model.source_path = None  # the file has no tokenizer: token ids only
    llm = LLM(model=model, block_size=4, kv_cache_mib=1)
    assert model.packed
    prompts = [[5, 9, 31], [70, 2], [11, 12, 13, 14]]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        seq = list(prompt)
        for _ in range(6):
            seq.append(int(model.forward_logits(seq)[-1].argmax()))
        assert list(out.token_ids) == seq[len(prompt) :]


def test_mixed_types_and_an_untied_head_load_packed(tmp_path: Path) -> None:
    types = {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "ffn_down": Q.Q6_K}
    path = packed_llama(tmp_path / "mixed.gguf", types, tied=False)
    packed, exact = load_model(path, "cpu"), load_model(path, "cpu", "float32")
    assert isinstance(packed.embed_tokens, PackedEmbedding)  # the file's blocks
    assert isinstance(packed.lm_head, Fp16Table)
    assert weight_bytes(packed) < weight_bytes(exact) / 2
    assert packed.layers[0].qkv_proj.kind == "int8"
    assert packed.layers[0].gate_up_proj.kind == "int4"
    seq = [1, 2, 3, 4, 5]
    got, want = packed.forward_logits(seq), exact.forward_logits(seq)
    assert torch.isfinite(got).all()
    # Random K-quant blocks give rows whose blocks' scales differ by 100x, where one
    # int8 scale a row rounds hard: a loose bound (real files: tests above, and
    # docs/benchmarks.md's perplexity); the untied head is float16 either way.
    assert ((got - want).norm() / want.norm()).item() < 0.25
    torch.testing.assert_close(packed.lm_head.weight, exact.lm_head.weight, rtol=1e-3, atol=1e-4)


def test_a_torch_without_the_kernels_loads_the_float32_path(tiny_q4: Path, monkeypatch) -> None:
    import pagedllm.model.loader as loader

    monkeypatch.setattr(loader, "packed_kernels_available", lambda: False)
    model = load_model(tiny_q4, "cpu")
    assert not model.packed
    assert type(model.layers[0].qkv_proj).__name__ == "Linear"
