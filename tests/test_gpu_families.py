"""Every family on the GPU: Triton kernels and CUDA graphs (head_dim 256, sliding
windows, q/k norms, biases, GeGLU) against transformers on the CPU, float32.

Tiny random checkpoints of each family (tests/test_families.py writes them);
prompts longer than the window and longer than a page, so windowed decode skips
whole pages. Run on the GPU machine: `python3 -m pytest -q -m gpu`.
"""

from __future__ import annotations

import pytest
import torch

from test_families import FAMILIES, make_family_dir

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# Gemma 3's own head size (256) with one KV head, as the 270M and 1B models have.
GPU_CASES = {
    **{name: {} for name in FAMILIES},
    "gemma3-d256": dict(head_dim=256, num_attention_heads=4, num_key_value_heads=1),
}


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_family_greedy_on_the_gpu_matches_transformers(tmp_path, case):
    from pagedllm import LLM, SamplingParams

    name = case.split("-d")[0]
    path, hf = make_family_dir(tmp_path, name, seed=3, **GPU_CASES[case])
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 5, 40, 70)
    ]  # one token; shorter than the window; several pages past it
    llm = LLM(
        str(path),
        device="cuda",
        dtype="float32",
        block_size=16,
        max_model_len=256,
        max_num_seqs=8,  # few graph buckets: each family compiles its own kernels
        max_num_batched_tokens=256,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, o in zip(prompts, outs):
        assert list(o.token_ids) == hf_greedy(hf, prompt, 16), (case, len(prompt))
    # Alone (batch 1: the fused RoPE + store + decode-attention kernel) as in a batch.
    alone = llm.generate([prompts[2]], SamplingParams(max_tokens=16, temperature=0))
    assert list(alone[0].token_ids) == list(outs[2].token_ids), case
