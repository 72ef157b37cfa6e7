"""How far a faster way of holding the weights moves a model: perplexity over a fixed
text and greedy answers to 10 prompts, against a reference way. (CPU or GPU.)

Two loads of the same model, each described by `load_model` keyword arguments
as KEY=VALUE (`--ref dtype=float32`, `--test` with none: the CPU's default,
whose GGUF weights stay packed; on the GPU `--ref` none and `--test
quantization=fp8`). For each:

- **perplexity** over the first `--tokens` (4,000) tokens of
  `scripts/data/perplexity.txt` (prose from the tour's first chapters, code and
  tables removed), one forward pass of the whole text with no cache
  (`forward_logits`): exp(mean negative log-likelihood of each next token);
- **greedy answers**: the first `--new-tokens` (16) tokens greedy-decoded for
  10 fixed chat prompts, through the same no-cache loop (so only the weights
  differ, not the engine); a prompt agrees when all its tokens are equal.

A packed CPU model multiplies every row through its packed kernels here
(`cpu_packed.PACKED_KERNEL_MAX_ROWS` lifted), as decode does: a prompt of more
than 16 rows would otherwise take the dequantized GEMM, and the numbers would
not be decode's.

Issue 38's targets (CPU, default model): perplexity within 1 % of float32, and
at least 8 of 10 answers equal over 16 tokens. Issue 36's (GPU, FP8): 2 %, and
8 of 10.

    .venv/bin/python scripts/accuracy.py --ref dtype=float32 [--test ...] [--model PATH]

`--fp8-activations` (CPU, with `--test ... quantization=fp8`) also rounds
each projection's input as the GPU's FP8 kernels do (ops/triton_fp8.py): one
row as it is (the weight-only GEMV), 2-16 rows per row and 128-column chunk
(the tensor-core GEMV), more per row (`_scaled_mm`); every forward pass here
has more than 16 rows but a 1-token text. So the CPU's float32 figure holds
both roundings the GPU makes, without its bf16.

The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from pagedllm.model import cpu_packed
from pagedllm.model.loader import load_model, resolve_model_path, weight_bytes
from pagedllm.tokenizer import Tokenizer

TEXT = Path(__file__).parent / "data" / "perplexity.txt"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three uses of Python.",
    "Who wrote Hamlet?",
    "How do I boil an egg?",
    "What is 17 times 3?",
    "Give me a name for a cat.",
    "Describe a rainy day.",
    "Why is the sky blue?",
]


def parse_kv(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"give load_model arguments as KEY=VALUE, got {item!r}")
        out[key] = value
    return out


@torch.inference_mode()
def perplexity(model, ids: list[int], rows_per_chunk: int = 256) -> float:
    """One forward pass of the whole text (as `forward_logits`), the logits made
    and scored a few hundred rows at a time: a 262k vocabulary (Gemma) times
    4,000 rows would be 4 GB of float32 at once."""
    dev, t = model.device, len(ids)
    hidden = model.forward_hidden(ids)  # (T, E), the final norm applied
    targets = torch.tensor(ids[1:], device=dev)
    nll = 0.0
    for r0 in range(0, t - 1, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, t - 1)
        logp = torch.log_softmax(model.compute_logits(hidden[r0:r1]).double(), dim=-1)
        nll -= logp.gather(1, targets[r0:r1, None]).sum().item()
    return math.exp(nll / (t - 1))


@torch.inference_mode()
def greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    out: list[int] = []
    for _ in range(new_tokens):
        out.append(int(model.forward_logits(ids + out)[-1].argmax()))
    return out


class Fp8Activations:
    """A projection whose input is first rounded to e4m3 as the GPU's FP8 kernels
    round it (`quantize_activations_reference`), then dequantized: see the module's
    docstring. Wraps a `Linear` of the CPU's dequantized FP8 weights."""

    def __init__(self, inner) -> None:
        self.inner = inner

    @staticmethod
    def rounded(x: torch.Tensor) -> torch.Tensor:
        t, k = x.shape
        if t <= 1:
            return x
        from pagedllm.ops.triton_fp8 import quantize_activations_reference

        group = 128 if t <= 16 else None
        q, scale = quantize_activations_reference(x, group)
        g = group or k
        return (q.float() * scale[:, torch.arange(k) // g]).to(x.dtype)

    def __call__(self, x, impl=None, *args, **kw):
        return self.inner(self.rounded(x), impl, *args, **kw)

    def then_act_and_mul(self, x, impl, act="silu"):
        return self.inner.then_act_and_mul(self.rounded(x), impl, act)

    def then_silu_and_mul(self, x, impl):
        return self.inner.then_silu_and_mul(self.rounded(x), impl)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def round_fp8_activations(model) -> None:
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            setattr(layer, name, Fp8Activations(getattr(layer, name)))


def measure(
    path, kwargs: dict, text_ids: list[int], prompts: list[list[int]], n: int, fp8_act=False
) -> dict:
    t0 = time.perf_counter()
    model = load_model(path, **kwargs)
    if fp8_act:
        round_fp8_activations(model)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    limit = cpu_packed.PACKED_KERNEL_MAX_ROWS
    cpu_packed.PACKED_KERNEL_MAX_ROWS = 1 << 30  # every row through the packed kernels
    try:
        ppl = perplexity(model, text_ids)
        answers = [greedy(model, p, n) for p in prompts]
    finally:
        cpu_packed.PACKED_KERNEL_MAX_ROWS = limit
    return {
        "load_model": kwargs,
        "fp8_activations": fp8_act,
        "weight_bytes": weight_bytes(model),
        "packed": getattr(model, "packed", False),
        "load_s": round(load_s, 2),
        "perplexity": ppl,
        "answers": answers,
        "measure_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF or HF directory (default: SmolLM2)")
    ap.add_argument("--ref", nargs="*", default=["dtype=float32"], metavar="KEY=VALUE")
    ap.add_argument("--test", nargs="*", default=[], metavar="KEY=VALUE")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--fp8-activations", action="store_true", help="the test load only")
    args = ap.parse_args()

    path = resolve_model_path(args.model)
    tok = Tokenizer.from_model_path(path)
    text_ids = tok.encode(TEXT.read_text())[: args.tokens]
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False
        )
        for p in PROMPTS
    ]
    ref = measure(path, parse_kv(args.ref), text_ids, prompts, args.new_tokens)
    test = measure(
        path, parse_kv(args.test), text_ids, prompts, args.new_tokens, args.fp8_activations
    )
    agree = [a == b for a, b in zip(ref["answers"], test["answers"])]
    first_diff = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        for a, b in zip(ref["answers"], test["answers"])
    ]
    change = test["perplexity"] / ref["perplexity"] - 1
    print(f"model {path.name}, {len(text_ids)} tokens of {TEXT.name}, {len(prompts)} prompts")
    print(f"{'':<28}{'reference':>14}{'test':>14}")
    print(f"{'load_model arguments':<28}{str(ref['load_model']):>14}{str(test['load_model']):>14}")
    print(f"{'weight bytes':<28}{ref['weight_bytes']:>14,}{test['weight_bytes']:>14,}")
    print(f"{'perplexity':<28}{ref['perplexity']:>14.4f}{test['perplexity']:>14.4f}")
    print(f"perplexity change: {change * 100:+.3f} %")
    print(f"greedy answers equal over {args.new_tokens} tokens: {sum(agree)} of {len(agree)}")
    print(f"first differing token per prompt: {first_diff}")
    row = {
        "model": str(path),
        "text_tokens": len(text_ids),
        "new_tokens": args.new_tokens,
        "reference": {k: v for k, v in ref.items() if k != "answers"},
        "test": {k: v for k, v in test.items() if k != "answers"},
        "perplexity_change": change,
        "answers_equal": sum(agree),
        "prompts": len(agree),
        "first_differing_token": first_diff,
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
