"""The Triton implementation of every op, under the names of `ops/reference.py`.

Owns: nothing but the list; the kernels live in `ops/triton_*.py`. Importing
this module needs `triton` (an ImportError tells the dispatcher in
`ops/__init__.py` that there is no Triton) but no GPU: with
`TRITON_INTERPRET=1` the same kernels run on the CPU.

Signatures are the reference's, host hints included (`max_q_len` of
prefill_attention, `max_seq_len` of decode_attention); decode_attention also
takes a keyword-only `num_splits` that forces the split-KV count (tests, tuning).
"""

from __future__ import annotations

import triton  # noqa: F401  (an ImportError here means "no Triton" to the dispatcher)

from pagedllm.ops.triton_act import gelu_tanh_and_mul, silu_and_mul
from pagedllm.ops.triton_argmax import argmax
from pagedllm.ops.triton_attention import (
    decode_attention,
    prefill_attention,
    rope_store_decode_attention,
)
from pagedllm.ops.triton_fp8 import (
    fp8_linear,
    fp8_linear_act_and_mul,
    fp8_mlp,
    fp8_norm_linear,
    fp8_norm_mlp,
)
from pagedllm.ops.triton_gemv import linear, linear_gelu_tanh_and_mul, linear_silu_and_mul
from pagedllm.ops.triton_kv import embedding, store_kvcache
from pagedllm.ops.triton_norm import fused_add_rms_norm, rms_norm
from pagedllm.ops.triton_rope import apply_rope, rope_and_store

__all__ = [
    "embedding",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "linear",
    "linear_silu_and_mul",
    "linear_gelu_tanh_and_mul",
    "fp8_linear",
    "fp8_linear_act_and_mul",
    "fp8_mlp",
    "fp8_norm_linear",
    "fp8_norm_mlp",
    "apply_rope",
    "store_kvcache",
    "rope_and_store",
    "prefill_attention",
    "decode_attention",
    "rope_store_decode_attention",
    "argmax",
]
