"""FP8 weights on the GPU (issue 36): FP8 checkpoints and `--quantization fp8` in bf16,
through the FP8 kernels, against float32 references on the CPU.

References: transformers' LlamaForCausalLM loading the dequantized weights
(tests/fp8_checkpoints.py), or, for `quantization="fp8"`, the float32 model
itself. The GPU kernels also quantize each activation row to e4m3 (3 mantissa
bits) and the model runs in bf16, so the logits are compared by their relative
(norm) error, within 15 %, and their largest error, within 25 % of the largest
|logit|; and each greedy token by the reference's logits for it, fed the
same tokens. (These random tiny
models are sensitive: rounding the weights of the 2-layer one to e4m3 alone,
in float32 on the CPU, moves its logits by 7.9 % in norm and its largest
logit error is 10.3 % of the largest logit; the first GPU run, 2026-12-05,
measured 9-15 % largest errors against the 5 % first set here.)
Run on the GPU machine: `python3 -m pytest -q -m gpu tests/test_gpu_fp8.py`.
"""

from __future__ import annotations

import pytest
import torch

from fp8_checkpoints import (
    ct_config,
    dequantized_reference,
    fp8_method_config,
    per_block,
    per_channel,
    per_tensor,
    write_fp8_checkpoint,
)
from tiny_models import greedy, make_tiny_llama

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# Wide enough for whole 128 x 128 blocks in every projection (q 256, k/v 128 rows).
SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
NORM_REL = 0.15  # relative norm error of the logits
MAX_REL = 0.25  # the largest error, of the largest |logit|
CASES = {
    # name: (quantization_config, quantize(name, w), scale name, static input scales)
    "ct-channel": (ct_config("channel"), lambda n, w: per_channel(w), "weight_scale", False),
    "ct-tensor-static": (
        ct_config("tensor", "static"),
        lambda n, w: per_tensor(w),
        "weight_scale",
        True,
    ),
    "fp8-block128": (
        fp8_method_config((128, 128)),
        lambda n, w: per_block(w, 128, 128),
        "weight_scale_inv",
        False,
    ),
}


def prompts(n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (k,), generator=g).tolist() for k in (1, 7, 40, 70)][:n]


def check_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within NORM_REL in norm and MAX_REL of the largest |logit| at worst; returns
    the largest error."""
    got, want = got.float().cpu(), want.float().cpu()
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    norm_rel = ((got - want).norm() / want.norm()).item()
    assert norm_rel < NORM_REL and err < MAX_REL * scale, (norm_rel, err, scale)
    # (No argmax check: wherever the top two are further apart than twice the
    # largest error the argmax cannot differ, and with e4m3 weights on this random
    # model often no row is: the first GPU run found none for quantization="fp8".)
    return err


def check_greedy(outs, reference, margin: float) -> None:
    """Each token the engine chose greedily (paged K/V, CUDA graphs, the FP8
    kernels at one row and at several) is one the reference, fed the same tokens,
    rates within `margin` of its best at that step. (Comparing whole greedy runs
    would not do: these random models' top two logits are often closer than the
    FP8 error, and one different choice changes every later token.)"""
    for prompt, out in zip(prompts(), outs):
        ids = list(prompt) + list(out.token_ids)
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        short = logits.max(dim=1).values - chosen
        assert (short <= margin).all(), (out.token_ids, short.tolist(), margin)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_checkpoint_on_the_gpu_matches_its_dequantized_reference(tmp_path, case):
    from pagedllm import LLM
    from pagedllm.model import load_model
    from pagedllm.model.linear import Fp8Linear

    qc, quantize, scale_name, static = CASES[case]
    hf, cfg = make_tiny_llama(1, **SHAPE)
    path = tmp_path / case
    deq = write_fp8_checkpoint(path, hf, cfg, qc, quantize, scale_name, input_scales=static)
    reference = dequantized_reference(hf, deq, tmp_path / "reference")

    model = load_model(path, "cuda", "bfloat16")
    qkv = model.layers[0].qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.device.type == "cuda"
    assert qkv.block_size == ((128, 128) if case.startswith("fp8") else None)
    # The FP8 matrix dequantizes to the checkpoint's exactly.
    want_qkv = torch.cat([deq[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    torch.testing.assert_close(qkv.weight.cpu(), want_qkv, rtol=0, atol=0)
    ids = prompts()[3]
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
    err = check_logits(model.forward_logits(ids), want)

    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=8)
    check_greedy(llm.generate(prompts(), greedy(16)), reference, 2 * err)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_quantization_fp8_on_the_gpu(tmp_path, kv_cache_dtype):
    """A float32 checkpoint quantized as it loads (one scale per output channel),
    alone and with float8 K/V pages: close to the float32 model."""
    from pagedllm import LLM
    from pagedllm.model.linear import Fp8Linear

    hf, _ = make_tiny_llama(2, **SHAPE)
    path = tmp_path / "dense"
    hf.save_pretrained(path, safe_serialization=True)
    llm = LLM(
        str(path),
        device="cuda",
        dtype="bfloat16",
        quantization="fp8",
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=256,
        max_num_seqs=8,
    )
    model = llm.engine.model
    layer = model.layers[1]
    assert all(
        isinstance(m, Fp8Linear) and m.scale.shape == (m.shape[0],)
        for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    )
    assert model.lm_head.dtype == torch.bfloat16 and model.embed_tokens.dtype == torch.bfloat16
    ids = prompts()[3]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    err = check_logits(model.forward_logits(ids), want)
    check_greedy(llm.generate(prompts(), greedy(16)), hf, 2 * err)


def test_llama_70b_dummy_fp8_loads_on_one_gpu():
    """--preset llama-3.1-70b --load-format dummy --quantization fp8: 72.7 GB of
    weights made in FP8 (no bf16 copy), then one prefill and one decode step.
    Needs about 80 GB free (an H100 80 GB is too small, an H200 is not)."""
    from pagedllm import LLM
    from pagedllm.model.loader import weight_bytes
    from pagedllm.presets import preset_dir

    free, _ = torch.cuda.mem_get_info()
    if free < 100 * 2**30:
        pytest.skip(f"needs ~100 GB of free GPU memory, {free / 2**30:.0f} GiB free")
    llm = LLM(
        str(preset_dir("llama-3.1-70b")),
        load_format="dummy",
        quantization="fp8",
        max_model_len=512,
        max_num_seqs=4,
        kv_cache_mib=2048,
        cuda_graphs=False,
    )
    held = weight_bytes(llm.engine.model)
    assert 70e9 < held < 75e9, held
    out = llm.generate([[1, 2, 3, 4, 5]], greedy(2))[0]
    assert len(out.token_ids) == 2
