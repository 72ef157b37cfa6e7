"""The CPU decode path's shortcuts against the general reference (issue 38).

Batch-1 decode attention on the CPU takes a path of fewer PyTorch ops
(`reference._decode_attention_one`); it must give what the general, masked
path gives for the same sequence, for every length around a page's edge, an
empty sequence, and half-precision and float8 pages. With more than one
thread, a decode step gives them to numpy's OpenBLAS and a prefill step to
torch (`cpu_threads.threads_for_step`): the runner must switch at the right
steps, and the tokens must be those of the float32 reference loop.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams, cpu_threads
from pagedllm.model import cpu_blas, load_model
from pagedllm.ops import reference as R
from pagedllm.runner import model_runner
from test_reference_ops import naive_attention, paged
from tiny_models import make_tiny_llama_dir


def general_path(q, kc, vc, tables, lens, scale):
    """The masked path for the same rows: a window wider than any sequence changes
    nothing in the result but takes decode_attention's general branch."""
    return R.decode_attention(q, kc, vc, tables, lens, scale, window=1 << 20)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 300])
def test_batch_one_equals_general_path_and_naive(n):
    kc, vc, tables = paged([n], hkv=3, d=16)
    q = torch.randn(1, 9, 16)
    lens = torch.tensor([n], dtype=torch.int32)
    out = R.decode_attention(q, kc, vc, tables, lens, 0.25, max_seq_len=n)
    torch.testing.assert_close(out, general_path(q, kc, vc, tables, lens, 0.25))
    pages = tables[0, : -(-n // 16)].long()
    k, v = kc[pages].flatten(0, 1)[:n], vc[pages].flatten(0, 1)[:n]
    torch.testing.assert_close(out[0], naive_attention(q[0], k, v, 0.25), rtol=1e-5, atol=1e-5)


def test_batch_one_ignores_padding_past_its_pages():
    """Table entries past the sequence's pages may hold anything (even ids past the
    pool): only the pages holding its tokens are read."""
    kc, vc, tables = paged([20], hkv=1, d=8)
    wide = torch.cat([tables, torch.full((1, 3), 10_000, dtype=torch.int32)], dim=1)
    q = torch.randn(1, 2, 8)
    lens = torch.tensor([20], dtype=torch.int32)
    torch.testing.assert_close(
        R.decode_attention(q, kc, vc, wide, lens, 0.5), general_path(q, kc, vc, tables, lens, 0.5)
    )


def test_batch_one_empty_sequence_is_zeros():
    kc, vc, tables = paged([16], hkv=1, d=8)
    q = torch.randn(1, 2, 8)
    out = R.decode_attention(q, kc, vc, tables, torch.tensor([0], dtype=torch.int32), 0.5)
    assert out.shape == q.shape and not out.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, R.FP8_KV_DTYPE])
def test_batch_one_narrow_pages(dtype):
    kc, vc, tables = paged([40], hkv=2, d=16)
    kc, vc = R.to_cache_dtype(kc, dtype), R.to_cache_dtype(vc, dtype)
    q = torch.randn(1, 4, 16, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    lens = torch.tensor([40], dtype=torch.int32)
    out = R.decode_attention(q, kc, vc, tables, lens, 0.25)
    assert out.dtype == q.dtype
    torch.testing.assert_close(out, general_path(q, kc, vc, tables, lens, 0.25))


@pytest.fixture
def two_threads(monkeypatch):
    """The policy's count set to 2 (whatever this machine has), restored after."""
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads, "_applied", 2)
    monkeypatch.setattr(cpu_threads, "_step_mode", None)
    yield
    torch.set_num_threads(before)
    cpu_blas.set_blas_threads(1)
    cpu_threads._step_mode = None


def test_threads_for_step_gives_decode_to_openblas_and_prefill_to_torch(two_threads):
    assert cpu_threads.threads_for_step(True) == (1, 2)
    assert torch.get_num_threads() == 1
    assert cpu_threads.threads_for_step(False) == (2, 1)
    assert torch.get_num_threads() == 2


def test_one_thread_stays_with_torch(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_applied", 1)
    monkeypatch.setattr(cpu_threads, "_step_mode", None)
    assert cpu_threads.threads_for_step(True) == (1, 1)
    assert cpu_threads.threads_for_step(False) == (1, 1)


def test_engine_switches_pools_per_step_and_keeps_greedy_tokens(tmp_path, two_threads, monkeypatch):
    path, _ = make_tiny_llama_dir(tmp_path / "m", seed=3, num_key_value_heads=2)
    model = load_model(path, device="cpu", dtype="float32")
    llm = LLM(model=model, kv_cache_mib=2)
    cpu_threads._applied, cpu_threads._step_mode = 2, None  # the engine applied its policy
    seen = []

    def spy(numpy_projections):
        seen.append(numpy_projections)
        return cpu_threads.threads_for_step(numpy_projections)

    monkeypatch.setattr(model_runner, "threads_for_step", spy)
    prompt = list(range(10, 50))  # 40 rows: more than numpy's 32, so prefill stays on torch
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert seen == [False] + [True] * 5  # the prefill, then five decode steps
    ids = list(prompt)
    for _ in range(6):  # the float32 reference: whole sequence, no cache
        ids.append(int(model.forward_logits(ids)[-1].argmax()))
    assert out[0].token_ids == ids[len(prompt) :]


@pytest.mark.slow  # ~9 s: the reference loop re-reads the whole sequence every token
def test_default_model_greedy_tokens_with_two_threads_equal_the_reference(smollm2, two_threads):
    """SmolLM2 (the default model, float32): 12 greedy tokens decoded by the engine,
    batch-1 attention path and OpenBLAS on 2 threads, equal the reference loop's."""
    llm = LLM(model=smollm2, kv_cache_mib=16)
    cpu_threads._applied, cpu_threads._step_mode = 2, None  # the engine applied its policy
    prompt = [1, 504, 3458, 282, 4649, 314]  # six ids of its vocabulary
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    ids = list(prompt)
    for _ in range(12):
        ids.append(int(smollm2.forward_logits(ids)[-1].argmax()))
    assert out[0].token_ids == ids[len(prompt) :]
