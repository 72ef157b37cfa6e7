"""bf16 log-prob error against float32, op by op (GPU machine).

Builds the Llama-3.2-1B preset with transformers' default random init, and
compares against transformers in float32: transformers in bf16, pagedllm with
every op on Triton, every op on the reference, and Triton with one op swapped
back to the reference at a time (which op costs accuracy?).

    PYTHONPATH=src python3 scripts/bf16_error.py
"""

from __future__ import annotations

import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm.config import ModelConfig
from pagedllm.model import build_model
from pagedllm.ops import reference as R
from pagedllm.ops import triton_impl as T
from pagedllm.presets import preset_dir


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a - a.mean(-1, keepdim=True)
    b = b - b.mean(-1, keepdim=True)
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    if os.environ.get("NO_REDUCED_PRECISION") == "1":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    cfg = json.loads((preset_dir("llama-3.2-1b") / "config.json").read_text())
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    # Module.to(bf16) would round RoPE's inv_freq buffer too; keep it float32.
    inv_freq = hf.model.rotary_emb.inv_freq.clone()
    hf.to(torch.bfloat16)
    hf.model.rotary_emb.inv_freq = inv_freq
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    ours = build_model(ModelConfig.from_hf_dict(cfg), state, torch.device("cuda"), torch.bfloat16)
    prompt = torch.randint(0, 128000, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        hf_bf16 = torch.log_softmax(hf(ids).logits[0].float(), -1)
        hf.float()
        hf.model.rotary_emb.inv_freq = inv_freq
        ref = torch.log_softmax(hf(ids).logits[0].float(), -1)
    rows = {"transformers bf16": rel(hf_bf16, ref)}
    hf.to(torch.bfloat16)
    hf.model.rotary_emb.inv_freq = inv_freq
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        rows["transformers bf16 eager attention"] = rel(
            torch.log_softmax(hf(ids).logits[0].float(), -1), ref
        )
        rows["transformers bf16 vs pagedllm bf16"] = rel(
            hf_bf16, torch.log_softmax(ours.forward_logits(prompt), -1)
        )
    if os.environ.get("QUICK") == "1":
        rows["pagedllm triton"] = rel(torch.log_softmax(ours.forward_logits(prompt), -1), ref)
        print(json.dumps(rows))
        return

    def ours_err() -> float:
        return rel(torch.log_softmax(ours.forward_logits(prompt), -1), ref)

    rows["pagedllm triton"] = ours_err()
    ours.ops_mode = "reference"
    rows["pagedllm reference ops"] = ours_err()
    ours.ops_mode = None  # back to $PAGEDLLM_OPS, else auto (Triton on CUDA)
    for name in (
        "rms_norm",
        "fused_add_rms_norm",
        "silu_and_mul",
        "apply_rope",
        "prefill_attention",
    ):
        saved = getattr(T, name)
        setattr(T, name, getattr(R, name))
        rows[f"triton, {name} on reference"] = ours_err()
        setattr(T, name, saved)
    for k, v in rows.items():
        print(f"{k:<48}{v:.4f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
