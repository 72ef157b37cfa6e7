"""Qwen2, Qwen3, Mistral and Gemma 3 compute what transformers computes (float32, CPU).

Oracle: transformers' model of each family on the same random weights, read
from the same HF directory the test writes. The prompts are longer than the
sliding window, so the windowed layers must drop the oldest positions.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.model import load_model

WINDOW = 6
COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
FAMILIES = {
    # name: (transformers config class, model class, overrides)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=10000.0)),
    "qwen2-window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    # Qwen3: a head_dim that is not hidden / heads, q/k norms.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    # Gemma 3: windowed layers 0 and 1 (pattern 3), global layer 2 with its own RoPE base.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=32,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            tie_word_embeddings=True,
        ),
    ),
}


def make_family_dir(tmp_path, name: str, seed: int = 0, **more):
    """Write a random transformers checkpoint of family `name` (a key of FAMILIES,
    with `more` config overrides) to tmp_path / name; returns (path, hf_model)."""
    import transformers

    config_cls, model_cls, overrides = FAMILIES[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, **more})
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:  # norms away from 1 (Gemma's away from 0: it adds 1)
                p.normal_(0.0 if name == "gemma3" else 1.0, 0.2)
            else:
                p.normal_(0.0, 0.08 if "embed" not in pname else 1.0)
            if pname.endswith("bias"):
                p.normal_(0.0, 0.5)
    path = tmp_path / name
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


PROMPT = [1, 17, 250, 3, 99, 41, 300, 7, 8, 120, 64, 5, 211, 33]  # longer than WINDOW


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path, name):
    path, hf = make_family_dir(tmp_path, name)
    model = load_model(path, device="cpu", dtype="float32")
    assert model.config.family == name.split("-")[0]
    ours = model.forward_logits(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-4, f"{name}: max relative error {err:.2e}"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_through_the_paged_engine_matches_transformers(tmp_path, name):
    """Paged prefill (in chunks of 5 tokens: a chunk after a prefix longer than the
    window), then paged decode, against transformers' own generate."""
    path, hf = make_family_dir(tmp_path, name, seed=1)
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=4,
        kv_cache_mib=4,
        max_num_batched_tokens=5,
        max_num_seqs=2,
        max_model_len=256,
    )
    out = llm.generate([PROMPT, PROMPT[:9]], SamplingParams(max_tokens=12, temperature=0))
    for prompt, o in zip([PROMPT, PROMPT[:9]], out):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
            )[0, len(prompt) :].tolist()
        assert list(o.token_ids) == ref, name


def test_family_switches_from_the_configs(tmp_path):
    """Each family's config sets the few switches it differs from Llama by."""
    got = {}
    for name in ("qwen2", "qwen3", "mistral", "gemma3"):
        path, _ = make_family_dir(tmp_path, name)
        got[name] = ModelConfig.from_hf_dir(path)
    assert got["qwen2"].attention_bias and not got["qwen2"].qk_norm
    assert got["qwen2"].layer_windows == ()  # use_sliding_window is false
    assert got["qwen3"].qk_norm and got["qwen3"].head_dim == 32
    assert got["mistral"].layer_windows == (WINDOW,) * 3
    g = got["gemma3"]
    assert g.sandwich_norms and g.qk_norm and g.hidden_act == "gelu_tanh"
    assert g.layer_windows == (WINDOW, WINDOW, 0) and g.local_rope_theta == 10000.0
    assert g.embedding_scale == pytest.approx(8.0) and g.attention_scale == pytest.approx(24**-0.5)


@pytest.mark.parametrize(("preset", "family"), [("qwen3-8b", "qwen3"), ("gemma-3-1b", "gemma3")])
def test_family_presets_read_as_their_family(preset, family):
    from pagedllm.presets import preset_dir

    c = ModelConfig.from_hf_dir(preset_dir(preset))
    assert c.family == family
    if family == "gemma3":  # Gemma-3-1B: 26 layers, every 6th global
        assert [i for i, w in enumerate(c.layer_windows) if w == 0] == [5, 11, 17, 23]
        assert set(c.layer_windows) == {0, 512} and c.head_dim == 256


def test_a_family_weight_in_a_llama_file_is_an_error(tmp_path):
    """A Qwen2 bias under a Llama config is a weight the model would drop: refused."""
    path, _ = make_family_dir(tmp_path, "qwen2")
    cfg = path / "config.json"
    import json

    data = json.loads(cfg.read_text())
    data["architectures"], data["model_type"] = ["LlamaForCausalLM"], "llama"
    cfg.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"q_proj\.bias.*same family"):
        load_model(path, device="cpu", dtype="float32")
