"""End to end on the GPU: the Llama-3.2-1B preset with random weights against
transformers' LlamaForCausalLM (same weights), and batched == single greedy.

Run on the GPU machine: `python3 -m pytest -q -m gpu` (scripts/gpu_check.sh).
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def preset_hf_model(dtype, seed=0, num_layers=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.presets import preset_dir

    cfg = json.loads((preset_dir("llama-3.2-1b") / "config.json").read_text())
    if num_layers:
        cfg["num_hidden_layers"] = num_layers
    torch.manual_seed(seed)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype).eval()
    # Spread the weights so logits are peaked (greedy is then not a coin toss).
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.5 if "embed" in name else 0.03)
    return hf, cfg


def ours_from_hf(hf, cfg, dtype):
    from pagedllm.config import ModelConfig
    from pagedllm.model import build_model

    config = ModelConfig.from_hf_dict(cfg)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    return build_model(config, state, torch.device("cuda"), dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def bf16_pair():
    hf, cfg = preset_hf_model(torch.bfloat16)
    return hf, ours_from_hf(hf, cfg, torch.bfloat16)


def test_prefill_logprobs_match_transformers_bf16(bf16_pair):
    hf, ours = bf16_pair
    prompt = torch.randint(0, 128000, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt], device="cuda")).logits[0].float(), -1)
    got = torch.log_softmax(ours.forward_logits(prompt), -1)
    assert rel(got, ref) < 2e-2


def test_paged_decode_logprobs_match_transformers_bf16(bf16_pair):
    """Generate through the engine (prefill, then CUDA-graph decode through the
    pages) and compare each sampled token's log-prob with transformers'
    teacher-forced log-prob of the same token."""
    from pagedllm import LLM, SamplingParams

    hf, ours = bf16_pair
    llm = LLM(model=ours, kv_cache_mib=512, max_model_len=4096, max_num_seqs=8)
    prompts = [
        torch.randint(0, 128000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (17, 130, 700)
    ]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=24, temperature=0, logprobs=1, ignore_eos=True)
    )
    for p, o in zip(prompts, outs):
        ids = p + o.token_ids
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids], device="cuda")).logits[0].float(), -1)
        ref = torch.stack([lp[len(p) - 1 + i, t] for i, t in enumerate(o.token_ids)])
        got = torch.tensor([o.logprobs[i][t] for i, t in enumerate(o.token_ids)], device="cuda")
        assert rel(got, ref) < 2e-2, (got, ref)


def test_batched_equals_single_greedy_fp32():
    """float32 on the GPU (TF32 off), so batch-size-dependent GEMM choices cannot flip
    a greedy pick; the kernels, pages, CUDA graphs and scheduler are all exercised."""
    from pagedllm import LLM, SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    hf, cfg = preset_hf_model(torch.float32, seed=3, num_layers=4)
    ours = ours_from_hf(hf, cfg, torch.float32)
    del hf
    llm = LLM(model=ours, kv_cache_mib=1024, max_model_len=2048, max_num_seqs=16)
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(0, 128000, (n,), generator=g).tolist()
        for n in (5, 16, 33, 100, 250, 1, 64, 17, 400, 9)
    ]
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        for n in (40, 12, 33, 20, 8, 50, 16, 27, 5, 31)
    ]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert batched == alone
    assert len({tuple(t) for t in batched}) == len(batched)  # not degenerate
    st = llm.stats()
    assert st["pages_free"] == st["pages_total"]
