"""Tiny random Llama models written by the tests themselves (no downloads).

`make_tiny_llama_dir` saves a transformers `LlamaForCausalLM` with random
weights as an HF directory (config.json + model.safetensors), so the same
weights feed both pagedllm and the transformers oracle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BASE_CONFIG: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
)


def make_tiny_llama(seed: int = 0, **overrides: Any):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {**BASE_CONFIG, **overrides}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    # Larger-than-default weights make logits spread out, so greedy is not degenerate.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
    return model, cfg


def make_tiny_llama_dir(path: Path, seed: int = 0, **overrides: Any):
    """Write a random model to `path`; returns (path, hf_model)."""
    model, _ = make_tiny_llama(seed, **overrides)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def greedy(n: int, **kw: Any):
    """SamplingParams for n greedy tokens, EOS ignored (the engine tests' default)."""
    from pagedllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy generate, EOS disabled."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
