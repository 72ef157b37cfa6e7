"""Programmatic dependent launch (PDL) for the batch-1 GEMVs: does it help? (GPU)

A batch-1 decode step is a chain of small kernels, each waiting for the one
before. With PDL (Hopper+), a kernel's programs may start while the previous
kernel's last wave still runs: they read their first chunk of W (which never
depends on the previous kernel) and then wait (`gdc_wait`) for its output.

For the layer shapes of Llama-3.2-1B (16 layers) and Llama-3.1-8B (32): the
chain qkv -> o_proj -> gate/up(+SwiGLU) -> down of every layer, each GEMV's
x the previous one's output, captured in one CUDA graph and replayed. Time
per layer with PDL off and on; the same chain with the model's two RMSNorm
kernels (the residual add fused into them, launched with PDL too, as inside
the model's kernel chain) before qkv and gate/up. Outputs must be equal bit
for bit with PDL off and on.

    PYTHONPATH=src python3 scripts/bench_pdl.py
"""

from __future__ import annotations

import json

import torch
from graph_timing import replay_us

from pagedllm import ops
from pagedllm.ops import triton_gemv
from pagedllm.ops.triton_norm import fused_add_rms_norm

SHAPES = [  # name, E, H*D, qkv N, I, layers
    ("1B", 2048, 2048, 3072, 8192, 16),
    ("8B", 4096, 4096, 6144, 14336, 32),
]


def layer_weights(e, hd, n_qkv, inter, layers):
    def w(n, k):
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5

    return [(w(n_qkv, e), w(e, hd), w(2 * inter, e), w(e, inter)) for _ in range(layers)]


def chain(x, weights, norm_w, pdl, mode):
    """mode: "gemv" (GEMVs only) or "norms" (+ the two add-and-norm kernels)."""
    x, residual = x.clone(), torch.zeros_like(x)  # the norms write in place
    with ops.kernel_chain(pdl):  # the norm kernels launch with PDL only inside a chain
        for qkv_w, o_w, gu_w, down_w in weights:
            h = fused_add_rms_norm(x, residual, norm_w, 1e-5)[0] if mode == "norms" else x
            qkv = triton_gemv.gemv(h, qkv_w, pdl=pdl)
            o = triton_gemv.gemv(qkv[:, : o_w.shape[1]], o_w, pdl=pdl)
            h = fused_add_rms_norm(o, residual, norm_w, 1e-5)[0] if mode == "norms" else o
            act = triton_gemv.gemv(h, gu_w, glu=True, pdl=pdl)
            x = triton_gemv.gemv(act, down_w, pdl=pdl)
    return x


def main() -> None:
    results = []
    for name, e, hd, n_qkv, inter, layers in SHAPES:
        weights = layer_weights(e, hd, n_qkv, inter, layers)
        norm_w = torch.ones(e, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, e, device="cuda", dtype=torch.bfloat16)
        for mode in ("gemv", "norms"):
            row = {"shape": name, "mode": mode}
            outs = {}
            for pdl in (False, True, False, True):
                args = (x, weights, norm_w, pdl, mode)
                us, out = replay_us(lambda args=args: chain(*args))
                out = out.clone()
                row.setdefault(f"pdl_{pdl}", []).append(round(us / layers, 2))
                outs[pdl] = out
            row["equal"] = bool(torch.equal(outs[False], outs[True]))
            wbytes = sum(t.numel() * 2 for ws in weights for t in ws)
            best_on = min(row["pdl_True"])
            row["tbps_on"] = round(wbytes / (best_on * layers) / 1e6, 2)
            row["tbps_off"] = round(wbytes / (min(row["pdl_False"]) * layers) / 1e6, 2)
            print(
                f"{name} {mode}: us/layer PDL off {row['pdl_False']} "
                f"({row['tbps_off']} TB/s), on {row['pdl_True']} ({row['tbps_on']} TB/s), "
                f"equal outputs: {row['equal']}"
            )
            results.append(row)
        weights = None
        torch.cuda.empty_cache()
    print(json.dumps({"pdl": results}))


if __name__ == "__main__":
    main()
