"""The whole engine on the Triton kernels, run by Triton's interpreter on the CPU.

`PAGEDLLM_OPS=triton` forces the kernels; tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU. The reference ops are the oracle.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model import load_model
from pagedllm.ops import implementation_name
from tiny_models import make_tiny_llama_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_llama_dir(
        tmp_path_factory.mktemp("tiny") / "m", seed=4, num_attention_heads=4, num_key_value_heads=2
    )
    return load_model(path, device="cpu", dtype="float32")


@pytest.mark.parametrize(
    ("kv_cache_dtype", "budget"), [("auto", 8192), ("fp8", 8192), ("auto", 12), ("fp8", 12)]
)
def test_engine_on_triton_kernels_matches_reference(tiny, monkeypatch, kv_cache_dtype, budget):
    """float32 model; with "fp8" both sides keep float8 pages, stored and read by
    each implementation's own ops. A 12-token step budget chunks the prompts:
    mixed steps, whose one-token rows take decode attention."""
    prompts = [[5, 9, 11], list(range(20, 53)), [7] * 16]
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1) for n in (9, 5, 18)
    ]
    settings = dict(
        kv_cache_mib=1, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=budget, max_num_seqs=4
    )
    monkeypatch.setenv("PAGEDLLM_OPS", "reference")
    ref = LLM(model=tiny, **settings).generate(prompts, params)
    monkeypatch.setenv("PAGEDLLM_OPS", "triton")
    assert implementation_name("cpu") == "triton"
    got = LLM(model=tiny, **settings).generate(prompts, params)
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        lp_r = torch.tensor([lp[t] for lp, t in zip(r.logprobs, r.token_ids)])
        lp_g = torch.tensor([lp[t] for lp, t in zip(g.logprobs, g.token_ids)])
        assert torch.allclose(lp_g, lp_r, atol=1e-4)
