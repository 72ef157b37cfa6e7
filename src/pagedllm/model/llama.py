"""The Llama forward pass over a flat batch of tokens.

Owns: the order of the ops of a Llama decoder (embedding, RMSNorm, fused QKV,
RoPE, GQA attention over the paged cache, SwiGLU, LM head) and the fused
weights it runs on. Does not own: how the batch was built (`runner/`), which
kernel computes each op (`ops/` decides from the device and `ops_mode`), how a
matrix is laid out in memory (`Linear`, in `linear.py`), or sampling.

Two entry points:
- `forward(batch, kv_caches)` -> the final hidden states of the rows in
  `batch.logits_indices`; `compute_logits` turns them into (N, V) logits (in
  the model's dtype; the sampler widens them when a step needs float32).
- `forward_logits(token_ids)` -> (T, V) float32 logits of one whole sequence
  with no cache: the executable spec every faster path is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm import ops
from pagedllm.config import ModelConfig
from pagedllm.model.batch import ForwardBatch
from pagedllm.model.linear import Fp8Linear, Linear
from pagedllm.model.parallel import TensorParallel
from pagedllm.ops.reference import rope_cos_sin_cache

KVCache = tuple[torch.Tensor, torch.Tensor]  # K, V: (NB, BS, Hkv, D) each

# Decode steps of at least this many rows launch the layers' Triton kernels as
# programmatic dependents (see `LlamaModel.chains_kernels`).
PDL_MIN_DECODE_BATCH = 64


@dataclass
class LayerWeights:
    """One decoder layer's weights. The shapes are HF's (out, in); each `Linear`
    stores its matrix in whichever layout its device multiplies fastest (see
    `linear.py`), and `.weight` gives the (out, in) matrix back."""

    input_norm: torch.Tensor  # (E,)
    qkv_proj: Linear  # (H*D + 2*Hkv*D, E): q, k and v stacked at load time
    o_proj: Linear  # (E, H*D)
    post_norm: torch.Tensor  # (E,): the norm before the MLP
    gate_up_proj: Linear  # (2*I, E): gate and up stacked at load time
    down_proj: Linear  # (E, I)
    # What other families add (None: Llama has none of them).
    qkv_bias: torch.Tensor | None = None  # (H*D + 2*Hkv*D,): Qwen2
    q_norm: torch.Tensor | None = None  # (D,): RMSNorm of each query head (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # (D,): and of each key head
    attn_out_norm: torch.Tensor | None = None  # (E,): Gemma 3, on attention's output
    mlp_out_norm: torch.Tensor | None = None  # (E,): Gemma 3, on the MLP's output


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        embed_tokens: torch.Tensor,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: Linear,
        max_positions: int | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        # With `tp`, the config is this rank's (H/N, Hkv/N, I/N heads and width) and the
        # weights are its slices (model/parallel.py); None: the whole model here.
        self.config = config
        self.tp = tp
        self.embed_tokens = embed_tokens  # (V, E)
        self.layers = layers
        self.norm = norm  # (E,)
        # (V, E); when tied, on CUDA its memory is embed_tokens' own (on the CPU, a
        # transposed copy: see linear.py).
        self.lm_head = lm_head
        # Which op implementation runs: "auto", "reference", "triton", or None to read
        # $PAGEDLLM_OPS (see ops/__init__.py). Settable after construction.
        self.ops_mode: str | None = None
        # Whether a matrix is kept quantized on the CPU (model/cpu_packed.py): the
        # loader sets it; the runner then gives a decode step's threads to torch.
        self.packed = False
        # `pagedllm trace` sets this to see the buffers of each layer:
        # tracer(layer_index, name, tensor). None (always, outside a trace): no cost.
        self.tracer = None
        # Whether large bf16 decode steps chain their kernels (`chains_kernels`). The decode
        # graphs' warm-up turns it off for one eager pass per bucket: mixed steps run
        # the same kernels unchained, and must find them compiled too.
        self.chain_batched_decode = True
        self.source_path = None  # the file or directory it was loaded from, if any
        self.device = embed_tokens.device
        self.dtype = embed_tokens.dtype
        self.scale = config.attention_scale  # head_dim ** -0.5, or Gemma's query_pre_attn_scalar
        # Gemma: the embeddings times sqrt(E), rounded to the model's dtype as HF does.
        self.embed_scale = (
            None
            if config.embedding_scale == 1.0
            else torch.tensor(config.embedding_scale, dtype=self.dtype, device=self.device)
        )
        # The RoPE table covers the positions this model will serve: the model's own
        # limit, or fewer when the caller says so (a 1M-position config would
        # otherwise cost 1M * D * 4 bytes before the first token).
        self.max_positions = config.max_position_embeddings
        if max_positions is not None:
            self.max_positions = min(self.max_positions, max_positions)
        self.cos_sin_cache = rope_cos_sin_cache(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling,
            self.max_positions,
            device=self.device,
        )  # (P, D) float32
        # Gemma 3's windowed layers rotate with a RoPE base of their own.
        self.local_cos_sin_cache = None
        if config.local_rope_theta is not None and config.layer_windows:
            self.local_cos_sin_cache = rope_cos_sin_cache(
                config.head_dim, config.local_rope_theta, None, self.max_positions, self.device
            )

    # ------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache] | None) -> torch.Tensor:
        """Hidden states (N, E) after the final norm, for the rows batch.logits_indices."""
        impl = ops.implementation(self.device, self.ops_mode)
        cfg = self.config
        hidden = self._embed(impl, batch.input_ids)  # (T, E)
        if self.embed_scale is not None:  # Gemma
            hidden = hidden * self.embed_scale
        tracer = self.tracer
        if tracer is not None:
            tracer(-1, "embedding", hidden)
        # Our kernels may start while the one before finishes (ops/triton_pdl.py):
        # at batch 1, where every kernel of the layers is ours, and in bf16 decode
        # steps of PDL_MIN_DECODE_BATCH rows and more, after cuBLAS's GEMMs too.
        with ops.kernel_chain(self.chains_kernels(batch)):
            hidden, residual, gathered = self._layers(impl, batch, hidden, kv_caches)

        # 5. Only the rows whose logits are wanted go through the final norm and LM
        #    head. A decode step's rows are its logits rows, in order: no gather
        #    (two kernels fewer in every decode step).
        if not (gathered or batch.is_decode):
            idx = batch.logits_indices
            hidden, residual = hidden[idx], residual[idx]
        out, _ = impl.fused_add_rms_norm(hidden, residual, self.norm, cfg.rms_norm_eps)
        if tracer is not None:  # the rows that go to the LM head
            tracer(len(self.layers), "final_norm", out)
        return out  # (N, E)

    def chains_kernels(self, batch: ForwardBatch) -> bool:
        """Whether this step's layers launch our kernels as programmatic dependents.

        Batch 1: the chain of small kernels gains most (1B 978 -> 1,104 tok/s).
        Batched decode: each norm, RoPE + store and attention kernel after a cuBLAS
        GEMM hides its launch; 8B float8 steps of batch 64-256 ran 1.5-2.7 % faster,
        steps of batch 16-63 1-2 % slower (docs/benchmarks.md, eleventh increment).
        bf16 only, where it was measured and captured: not in float32 (stream capture
        failed there after cuBLAS's float32 GEMMs) nor float16 (not tried), nor under
        tensor parallelism (NCCL kernels in the chain)."""
        if self.tp is not None:
            return False
        c = self.config
        if c.qk_norm or c.sandwich_norms or self.embed_scale is not None:
            # Not measured in a chain yet (Qwen3's and Gemma's extra norms, Gemma's
            # embedding scale, a PyTorch kernel before the chain's first).
            return False
        if batch.num_tokens == 1:
            return True
        return (
            self.chain_batched_decode
            and batch.is_decode
            and batch.num_tokens >= PDL_MIN_DECODE_BATCH
            and self.dtype == torch.bfloat16
        )

    def _layers(
        self, impl, batch: ForwardBatch, hidden: torch.Tensor, kv_caches: list[KVCache] | None
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The decoder layers: (hidden, residual) of the last layer, not yet added,
        and whether they hold only the rows of `batch.logits_indices`.

        The last layer's K/V are needed for every new token (later tokens attend
        to them), but its attention output, o_proj and MLP only for the rows
        whose logits are wanted. When those are one per sequence (its last new
        token: every step but one asking for prompt log-probs), the last layer
        computes only those rows, after it stores every row's K/V: decode
        attention of each sequence's last token over its pages. A lone prompt of
        1,024 tokens skips 1/L of its prefill (L layers); a decode step loses nothing."""
        cfg = self.config
        num_tokens = batch.num_tokens
        q_size, kv_size, d, eps = cfg.q_size, cfg.kv_size, cfg.head_dim, cfg.rms_norm_eps
        tracer = self.tracer
        residual = None
        gather = (
            bool(kv_caches)
            and not batch.is_decode
            and not batch.every_row  # a trace records every row (every rank agrees)
            and batch.logits_indices.shape[0] == batch.num_seqs  # one row per sequence
        )
        last, gathered = len(self.layers) - 1, False
        for i, layer in enumerate(self.layers):
            # 1. Pre-attention norm; the residual add of the previous layer is fused in.
            # 2. One matmul for Q, K and V (+ bias: Qwen2), then views into it.
            qkv_proj = layer.qkv_proj
            if tracer is None and isinstance(qkv_proj, Fp8Linear):
                # One op: its kernel may write the norm's output quantized for FP8.
                qkv, residual = impl.fp8_norm_linear(
                    hidden, residual, layer.input_norm, eps, qkv_proj.qweight, qkv_proj.scale,
                    bias=layer.qkv_bias, block_size=qkv_proj.block_size,
                )  # fmt: skip
            else:
                if residual is None:
                    residual = hidden
                    x = impl.rms_norm(hidden, layer.input_norm, eps)
                else:
                    x, residual = impl.fused_add_rms_norm(hidden, residual, layer.input_norm, eps)
                if tracer is not None:
                    tracer(i, "attn_norm", x)
                qkv = qkv_proj(x, impl, bias=layer.qkv_bias)  # (T, (H + 2Hkv) D); Qwen2: + bias
            q = qkv[:, :q_size].view(num_tokens, -1, d)  # (T, H, D)
            k = qkv[:, q_size : q_size + kv_size].view(num_tokens, -1, d)  # (T, Hkv, D)
            v = qkv[:, q_size + kv_size :].view(num_tokens, -1, d)  # (T, Hkv, D)
            if layer.q_norm is not None:  # Qwen3, Gemma 3: every head normalized on its own
                q = impl.rms_norm(q, layer.q_norm, eps)  # (T, H, D), contiguous
                k = impl.rms_norm(k, layer.k_norm, eps)
            if tracer is not None:  # before RoPE rotates them
                tracer(i, "q_raw", q)
                tracer(i, "k_raw", k)
            # Mistral, Gemma 3's local layers: attend to the last `window` positions only.
            window = cfg.window(i)
            cos_sin = self.cos_sin_cache
            if window and self.local_cos_sin_cache is not None:
                cos_sin = self.local_cos_sin_cache
            # 3. RoPE on q and k; the new K/V go into their KV-cache slots (one kernel
            #    on CUDA); then attention reads the cache through the block tables.
            #    Batch-1 decode does all of that in one kernel on CUDA, RoPE and the
            #    store included (one launch fewer per layer in a chain of small ones;
            #    at batch 256 the two kernels measured faster). Not when traced: the
            #    trace records the rotated q and k.
            kv_cache = kv_caches[i] if kv_caches else None
            if kv_cache is None:
                q, k = impl.apply_rope(q, k, batch.positions, cos_sin)
                attn = self._attention(impl, batch, q, k, v, kv_cache, window)
            elif batch.is_decode and num_tokens == 1 and tracer is None:
                attn = impl.rope_store_decode_attention(
                    q,
                    k,
                    v,
                    batch.positions,
                    cos_sin,
                    *kv_cache,
                    batch.slot_mapping,
                    batch.block_tables,
                    batch.seq_lens,
                    self.scale,
                    max_seq_len=batch.max_seq_len,
                    window=window,
                )
            else:
                q, k = impl.rope_and_store(
                    q, k, v, batch.positions, cos_sin, *kv_cache, batch.slot_mapping
                )
                if i == last and gather:  # the last layer: the logits rows only
                    idx = batch.logits_indices
                    attn = impl.decode_attention(
                        q[idx],
                        *kv_cache,
                        batch.block_tables,
                        batch.seq_lens,
                        self.scale,
                        max_seq_len=batch.max_seq_len,
                        order=batch.decode_order,
                        window=window,
                    )  # (B, H, D)
                    residual = residual[idx]
                    num_tokens, gathered = len(idx), True
                else:
                    attn = self._attention(impl, batch, q, k, v, kv_cache, window)
            if tracer is not None:
                for name, t in (("q", q), ("k", k), ("v", v), ("attention", attn)):
                    tracer(i, name, t)
            hidden = layer.o_proj(attn.view(num_tokens, q_size), impl)  # (T, E)
            if self.tp is not None:  # row-parallel: each rank's product is a partial sum
                self.tp.all_reduce(hidden)
            if layer.attn_out_norm is not None:  # Gemma 3: attention's output normalized
                hidden = impl.rms_norm(hidden, layer.attn_out_norm, eps)
            if tracer is not None:
                tracer(i, "o_proj", hidden)
            # 4. MLP: norm (fused with the residual add), gate/up in one matmul, SwiGLU, down.
            gate_up_proj, down_proj = layer.gate_up_proj, layer.down_proj
            if (
                tracer is None
                and isinstance(gate_up_proj, Fp8Linear)
                and isinstance(down_proj, Fp8Linear)
            ):  # one op: its kernels may hand each projection its input quantized
                hidden, residual = impl.fp8_norm_mlp(
                    hidden, residual, layer.post_norm, eps,
                    gate_up_proj.qweight, gate_up_proj.scale, down_proj.qweight,
                    down_proj.scale, cfg.hidden_act,
                    gate_up_block_size=gate_up_proj.block_size,
                    down_block_size=down_proj.block_size,
                )  # fmt: skip
                act = None
            elif tracer is None:  # gate/up then SwiGLU (GeGLU: Gemma): one GEMV on CUDA for one row
                x, residual = impl.fused_add_rms_norm(hidden, residual, layer.post_norm, eps)
                act = layer.gate_up_proj.then_act_and_mul(x, impl, cfg.hidden_act)  # (T, I)
            else:  # the same ops, with the (T, 2I) gate_up in hand for the trace
                x, residual = impl.fused_add_rms_norm(hidden, residual, layer.post_norm, eps)
                gate_up = layer.gate_up_proj(x, impl)  # (T, 2I)
                gated = impl.silu_and_mul if cfg.hidden_act == "silu" else impl.gelu_tanh_and_mul
                act = gated(gate_up)  # (T, I)
                for name, t in (("mlp_norm", x), ("gate_up", gate_up), ("swiglu", act)):
                    tracer(i, name, t)
            if act is not None:
                hidden = layer.down_proj(act, impl)  # (T, E)
            if self.tp is not None:
                self.tp.all_reduce(hidden)
            if layer.mlp_out_norm is not None:  # Gemma 3: the MLP's output normalized
                hidden = impl.rms_norm(hidden, layer.mlp_out_norm, eps)
            if tracer is not None:
                tracer(i, "down", hidden)
                # the residual stream after this layer (HF's hidden state)
                tracer(i, "hidden", hidden + residual)
        return hidden, residual, gathered

    def _embed(self, impl, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids -> (T, E). Vocabulary-parallel: each rank embeds the ids of its
        rows, zeros for the others, and the all-reduce sums the rows."""
        if self.tp is None:
            return impl.embedding(input_ids, self.embed_tokens)
        start, end = self.tp.vocab_rows(self.config.vocab_size)
        mine = (input_ids >= start) & (input_ids < end)  # (T,)
        hidden = impl.embedding(torch.where(mine, input_ids - start, 0), self.embed_tokens)
        hidden.mul_(mine[:, None].to(hidden.dtype))
        return self.tp.all_reduce(hidden)

    def _attention(
        self,
        impl,
        batch: ForwardBatch,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache | None,
        window: int = 0,
    ) -> torch.Tensor:
        if kv_cache is None:  # no cache: every sequence is attended to whole, from k and v
            return impl.prefill_attention(
                q,
                k,
                v,
                batch.cu_seqlens_q,
                batch.seq_lens,
                self.scale,
                max_q_len=batch.max_q_len,
                window=window,
            )
        k_cache, v_cache = kv_cache  # this step's K/V are in it already (rope_and_store)
        if batch.is_decode:
            return impl.decode_attention(
                q,
                k_cache,
                v_cache,
                batch.block_tables,
                batch.seq_lens,
                self.scale,
                max_seq_len=batch.max_seq_len,
                order=batch.decode_order,
                window=window,
            )
        # A mixed step: its first d sequences have one new token each. The prefill
        # kernel would pad each of those rows to a 64-query tile per head; decode
        # attention reads their pages once per KV head. Prefill attention gets the
        # other sequences only (rows of q are addressed through cu_seqlens_q, so
        # it writes theirs and leaves the first d rows of its output unwritten).
        d = batch.num_decode_seqs
        out = impl.prefill_attention(
            q,
            k,
            v,
            batch.cu_seqlens_q[d:],
            batch.seq_lens[d:],
            self.scale,
            k_cache,
            v_cache,
            batch.block_tables[d:],
            max_q_len=batch.max_q_len,
            window=window,
        )
        if d:
            out[:d] = impl.decode_attention(
                q[:d],
                k_cache,
                v_cache,
                batch.block_tables[:d],
                batch.seq_lens[:d],
                self.scale,
                max_seq_len=batch.max_seq_len,
                order=None if batch.decode_order is None else batch.decode_order[:d],
                window=window,
            )
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, E) -> (N, V) in the model's dtype: the sampler widens them to float32
        only for a step that needs it (a greedy step's argmax is exact on bf16, and
        the widened copy of a batch of 256 rows cost ~0.1 ms per step at a vocabulary
        of 128,256). Vocabulary-parallel: every rank's (N, V/N) gathered."""
        logits = self.lm_head(hidden)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits, self.config.vocab_size)
        cap = self.config.final_logit_softcap
        if cap is not None:  # Gemma 2's soft cap (Gemma 3 sets none)
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ------------------------------------------------------------------
    @torch.inference_mode()
    def forward_logits(self, token_ids: list[int]) -> torch.Tensor:
        """The executable spec: (T, V) float32 logits of one sequence, no cache."""
        return self.compute_logits(self.forward_hidden(token_ids)).float()

    @torch.inference_mode()
    def forward_hidden(self, token_ids: list[int]) -> torch.Tensor:
        """`forward_logits` before the LM head: (T, E) final hidden states of one
        sequence, no cache (a caller scoring a long text makes the logits a few
        rows at a time: scripts/accuracy.py)."""
        if not token_ids:
            raise ValueError("forward_logits needs at least one token")
        t = len(token_ids)
        if t > self.max_positions:
            raise ValueError(
                f"{t} tokens exceed the {self.max_positions} positions this model was loaded "
                "for (the model's max_position_embeddings, or load_model's max_model_len)"
            )
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=dev),
            positions=torch.arange(t, dtype=torch.long, device=dev),
            slot_mapping=None,
            block_tables=None,
            seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32, device=dev),
            logits_indices=torch.arange(t, dtype=torch.long, device=dev),
            is_decode=False,
            max_q_len=t,
            max_seq_len=t,
        )
        return self.forward(batch, None)
