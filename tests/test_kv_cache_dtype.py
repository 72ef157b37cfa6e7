"""The float8 K/V cache (`kv_cache_dtype="fp8"`) on the CPU, with the reference ops.

The Triton kernels' float8 paths are tested against the same reference under
the interpreter (tests/test_triton_ops.py) and compiled on the GPU
(tests/test_triton_gpu.py, tests/test_gpu_e2e.py).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine_config import EngineConfig
from pagedllm.model import load_model
from pagedllm.ops import reference as ref
from tiny_models import make_tiny_llama_dir

FP8 = torch.float8_e4m3fn


def test_to_cache_dtype_rounds_to_nearest_even_and_saturates():
    # Exactly representable e4m3 values stay; halfway cases go to the even mantissa.
    x = torch.tensor([1.0, 1.0625, 1.1875, -3.25, 448.0, 449.0, 1e4, -1e9, float("inf")])
    got = ref.to_cache_dtype(x, FP8).float()
    want = torch.tensor([1.0, 1.0, 1.25, -3.25, 448.0, 448.0, 448.0, -448.0, 448.0])
    assert torch.equal(got, want)
    # Everything in range: at most half a step (2^-4 relative) from the input.
    y = torch.randn(10000, generator=torch.Generator().manual_seed(0)) * 10
    y = y[y.abs() > 2**-6]  # e4m3's normal range starts at 2^-6
    err = (ref.to_cache_dtype(y, FP8).float() - y).abs() / y.abs()
    assert err.max() <= 2**-4
    # Other dtypes are a plain cast.
    z = torch.randn(8, dtype=torch.float64)
    assert torch.equal(ref.to_cache_dtype(z, torch.float32), z.float())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = make_tiny_llama_dir(tmp_path_factory.mktemp("fp8") / "m", seed=2)
    return load_model(path, device="cpu", dtype="float32"), hf


def _logprobs(llm: LLM, prompts, n):
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5)
    )
    return outs


def test_fp8_pool_holds_four_times_the_float32_tokens(tiny):
    model, _ = tiny
    auto = LLM(model=model, kv_cache_mib=2)
    fp8 = LLM(model=model, kv_cache_mib=2, kv_cache_dtype="fp8")
    assert auto.stats()["kv_cache_dtype"] == "float32"
    assert fp8.stats()["kv_cache_dtype"] == "float8_e4m3fn"
    assert fp8.engine.kv_spec.num_tokens == 4 * auto.engine.kv_spec.num_tokens
    k_cache, _ = fp8.engine.runner.kv_caches[0]
    assert k_cache.dtype == FP8


def test_fp8_cache_stays_close_to_the_full_precision_cache(tiny):
    """Same prompts, greedy, through prefill and paged decode: the log-probs of the
    top-5 candidates move by little, and the picks agree wherever the full-precision
    run has a clear winner (by 0.1 nats)."""
    model, _ = tiny
    prompts = [[5, 9, 11], list(range(20, 90)), [7] * 16]
    full = _logprobs(LLM(model=model, kv_cache_mib=4), prompts, 24)
    fp8 = _logprobs(LLM(model=model, kv_cache_mib=4, kv_cache_dtype="fp8"), prompts, 24)
    diffs, clear, agree = [], 0, 0
    for f, q in zip(full, fp8):
        # Teacher-forcing is not available here, so compare while the tokens agree.
        for i, (tf, tq) in enumerate(zip(f.token_ids, q.token_ids)):
            lp_f, lp_q = f.logprobs[i], q.logprobs[i]
            shared = set(lp_f) & set(lp_q)
            diffs += [abs(lp_f[t] - lp_q[t]) for t in shared]
            top = sorted(lp_f.values(), reverse=True)
            if top[0] - top[1] > 0.1:
                clear += 1
                agree += int(tf == tq)
            if tf != tq:
                break
    # Measured: 33 clear picks, all agreeing; mean difference 0.003, largest 0.026.
    assert clear >= 10 and agree == clear
    assert sum(diffs) / len(diffs) < 0.02 and max(diffs) < 0.1


def test_fp8_prefix_hits_and_preemption_lose_nothing(tiny):
    """Pages written in float8 are reused by prefix hits and re-written after a
    preemption; every page comes back to the pool."""
    model, _ = tiny
    llm = LLM(
        model=model,
        kv_cache_mib=0.2,
        kv_cache_dtype="fp8",
        admission="optimistic",
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    shared = list(range(40, 88))
    prompts = [shared + [i, i + 1] for i in range(6)]
    first = llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    st = llm.stats()
    assert st["prefix_cache_hit_tokens"] > 0
    assert all(len(o.token_ids) == 30 for o in first)
    assert st["pages_free"] == st["pages_total"]


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not one of auto, fp8"):
        EngineConfig(kv_cache_dtype="int8")
