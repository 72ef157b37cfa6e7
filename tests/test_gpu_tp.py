"""Tensor parallelism on two GPUs (NCCL): TP=2 against TP=1 on the same weights.

Run on the two-GPU machine: `pytest -m gpu2` (it is also part of `-m gpu`,
and skips where there are fewer than two GPUs). A tiny Llama written by the
test, so both engines read the same weights. Float32 first (sharded sums
differ from whole ones only in order: the same greedy tokens, log-probs
within 1e-3), then bf16, where a 16-bit all-reduce may move a prompt
token's log-prob by at most 1.5x what bf16 itself moves it from float32.
"""

from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_llama_dir

pytestmark = [pytest.mark.gpu, pytest.mark.gpu2]

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

PROMPTS = [[5, 9, 13, 2, 7, 7, 30, 11, 4], list(range(40, 140)), [1, 300, 2, 509, 44]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = make_tiny_llama_dir(
        tmp_path_factory.mktemp("tp2") / "m",
        seed=7,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
    )
    return str(path)


def run(model_dir: str, dtype: str, tp: int):
    from pagedllm import LLM, SamplingParams

    sp = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    with LLM(
        model_dir, device="cuda", dtype=dtype, kv_cache_mib=64, tensor_parallel_size=tp
    ) as llm:
        outs = llm.generate(PROMPTS, sp)
        kv_heads = llm.engine.runner.kv_caches[0][0].shape[2]
    return outs, kv_heads


def prompt_logprobs(outs) -> torch.Tensor:
    """Each prompt token's log-prob, all prompts (teacher-forced: no greedy path to part)."""
    return torch.tensor(
        [e[t] for o in outs for t, e in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
    )


def test_two_gpus_equal_one(model_dir):
    f32_one, heads_one = run(model_dir, "float32", 1)
    f32_two, heads_two = run(model_dir, "float32", 2)
    assert heads_two * 2 == heads_one  # each GPU caches half the KV heads
    assert [o.token_ids for o in f32_two] == [o.token_ids for o in f32_one]
    split = (prompt_logprobs(f32_two) - prompt_logprobs(f32_one)).abs().max().item()
    assert split < 1e-3
    # bf16: splitting the sums over two GPUs moves a log-prob by no more than
    # bf16 itself moves it from float32 (on the CPU: 0.057 against 0.071 nats).
    bf16_one, _ = run(model_dir, "bfloat16", 1)
    bf16_two, _ = run(model_dir, "bfloat16", 2)
    own = (prompt_logprobs(bf16_one) - prompt_logprobs(f32_one)).abs().max().item()
    split = (prompt_logprobs(bf16_two) - prompt_logprobs(bf16_one)).abs().max().item()
    assert split <= 1.5 * own, (split, own)
