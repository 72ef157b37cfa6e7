"""The peer: Hugging Face transformers on the same model, weights and workload.

Owns: building a transformers `LlamaForCausalLM` that holds exactly our
weights (our fused `qkv_proj` and `gate_up_proj` split back into q/k/v and
gate/up), and running the workloads the transformers way:

- throughput: the continuous-batching manager (`continuous_batching_context_manager`,
  paged KV cache), one `add_request(ids, max_new_tokens=m)` per request, so
  every request keeps its own limit; EOS disabled (`eos_token_id=-1`);
- batch 1 and time to first token: `model.generate` (sdpa, dynamic cache),
  greedy, no EOS, with a streamer that timestamps every new token.

Does not own: our engine, or how the figures are reported. Imports
transformers lazily: the engine never needs it.

Why copy weights instead of loading the file a second time: the peer then
runs the very numbers ours runs (a GGUF is dequantized once, by us), with no
dependency on transformers' GGUF reader (`gguf` is missing on the GPU
machine), and dummy presets need no file at all.
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics
import time
from typing import Any

import torch

from pagedllm.bench.result import BenchResult
from pagedllm.bench.workloads import Workload
from pagedllm.config import ModelConfig
from pagedllm.model import LlamaModel

ENGINE = "transformers"


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def hf_config_dict(c: ModelConfig) -> dict[str, Any]:
    """A `config.json`-style dict for our config. EOS is left out: the peer never stops early."""
    d: dict[str, Any] = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_act="silu",
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=c.bos_token_id if (c.bos_token_id or 0) < c.vocab_size else None,
        eos_token_id=None,
        pad_token_id=0,
    )
    if c.rope_scaling is not None:
        d["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(c.rope_scaling)}
    return d


@torch.no_grad()
def build_hf_model(model: LlamaModel):
    """transformers' LlamaForCausalLM on our device and dtype, holding our weights."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    c = model.config
    hf_config = LlamaConfig(**hf_config_dict(c))
    hf_config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model.dtype)  # parameters are created in the compute dtype
    try:
        with torch.device(model.device):
            hf = LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(previous)
    hf.eval()
    # Split the fused projections back (rows: q, k, v and gate, up).
    sizes = [c.q_size, c.kv_size, c.kv_size]
    for ours, theirs in zip(model.layers, hf.model.layers):
        q, k, v = ours.qkv_proj.weight.split(sizes, dim=0)
        gate, up = ours.gate_up_proj.weight.split([c.intermediate_size] * 2, dim=0)
        pairs = [
            (theirs.input_layernorm.weight, ours.input_norm),
            (theirs.self_attn.q_proj.weight, q),
            (theirs.self_attn.k_proj.weight, k),
            (theirs.self_attn.v_proj.weight, v),
            (theirs.self_attn.o_proj.weight, ours.o_proj.weight),
            (theirs.post_attention_layernorm.weight, ours.post_norm),
            (theirs.mlp.gate_proj.weight, gate),
            (theirs.mlp.up_proj.weight, up),
            (theirs.mlp.down_proj.weight, ours.down_proj.weight),
        ]
        for dst, src in pairs:
            dst.copy_(src)
    hf.model.embed_tokens.weight.copy_(model.embed_tokens)
    hf.model.norm.weight.copy_(model.norm)
    if hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
        hf.lm_head.weight.copy_(model.lm_head.weight)  # untied (tied: the embedding table)
    hf.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0, do_sample=False)
    return hf


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _result(**kw: Any) -> BenchResult:
    return BenchResult(engine=ENGINE, version=transformers_version(), **kw)


def _only_known(fn_or_cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop keyword arguments this transformers version does not take (5.17 vs 5.24)."""
    if dataclasses.is_dataclass(fn_or_cls):
        names = {f.name for f in dataclasses.fields(fn_or_cls)}
    else:
        names = set(inspect.signature(fn_or_cls).parameters)
    return {k: v for k, v in kwargs.items() if k in names}


# ---------------------------------------------------------------- throughput
def run_throughput(
    hf, w: Workload, warmup: Workload, cb_options: dict[str, Any] | None = None
) -> BenchResult:
    """Continuous batching with per-request max_new_tokens; wall of the whole batch."""
    from transformers import GenerationConfig

    device = hf.device
    gen_config = GenerationConfig(
        max_new_tokens=max(w.max_tokens), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        cb_config = ContinuousBatchingConfig(
            **_only_known(ContinuousBatchingConfig, cb_options or {})
        )
    except ImportError:  # an older transformers: its defaults
        cb_config = None
    cm_kwargs: dict[str, Any] = dict(
        generation_config=gen_config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=5,
        warmup=True,
    )
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        cm_kwargs["workload_hints"] = WorkloadHints(
            max_prompt_length=max(len(p) for p in w.prompts),
            max_generated_length=max(w.max_tokens),
            num_requests=w.num_requests,
        )
    except ImportError:  # older transformers: no hints
        pass
    cm = hf.continuous_batching_context_manager
    # no_grad, not inference_mode: transformers' manager updates its tensors from
    # its own thread, outside our inference mode (transformers 5.17 then fails with
    # "Inplace update to inference tensor outside InferenceMode").
    with torch.no_grad(), cm(**_only_known(cm, cm_kwargs)) as manager:
        _cb_run(manager, warmup)  # not timed: first batches allocate
        _sync(device)
        t0 = time.perf_counter()
        outputs = _cb_run(manager, w)
        _sync(device)
        wall = time.perf_counter() - t0
        resolved = getattr(manager, "continuous_batching_config", cb_config)
    stamped = [o for o in outputs if getattr(o, "timestamps", None)]
    ttfts = [o.timestamps[0] - o.created_time for o in stamped]
    tpots = [
        (o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1)
        for o in stamped
        if len(o.timestamps) > 1
    ]
    return _result(
        requests=w.num_requests,
        output_tokens=w.output_tokens,
        seconds=wall,
        tokens_per_s=w.output_tokens / wall,
        ttft_s=statistics.median(ttfts) if ttfts else None,
        tpot_s=statistics.median(tpots) if tpots else None,
        notes={
            "api": "continuous_batching_context_manager + add_request(max_new_tokens=m)",
            "attn_implementation": hf.config._attn_implementation,
            "cb_config": {
                k: getattr(resolved, k, None)
                for k in (
                    "num_blocks",
                    "max_batch_tokens",
                    "max_requests_per_batch",
                    "use_cuda_graph",
                )
            }
            | {"page_size": getattr(resolved, "page_size", getattr(resolved, "block_size", None))},
            "ttft_is": "median over requests, from add_request",
        },
    )


def _cb_run(manager, w: Workload) -> list[Any]:
    """Submit every request with its own limit; wait for all; check their lengths."""
    add = manager.add_request
    extra = _only_known(add, {"eos_token_id": -1, "record_timestamps": True})
    ids = [
        add(list(p), request_id=f"{w.name}-{i}", max_new_tokens=m, **extra)
        for i, (p, m) in enumerate(zip(w.prompts, w.max_tokens))
    ]
    pending, done = set(ids), {}
    while pending:
        r = manager.get_result(timeout=1)
        if r is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped early")
            continue
        if r.request_id in pending and r.is_finished():
            if getattr(r, "error", None):
                raise RuntimeError(f"transformers request {r.request_id} failed: {r.error}")
            pending.discard(r.request_id)
            done[r.request_id] = r
    outputs = [done[i] for i in ids]
    for rid, o, m in zip(ids, outputs, w.max_tokens):
        if len(o.generated_tokens) != m:
            raise RuntimeError(f"transformers {rid} made {len(o.generated_tokens)} tokens, not {m}")
    return outputs


# ------------------------------------------------------------ batch 1 / ttft
class _TokenClock:
    """A generate() streamer that only timestamps: put() #0 is the prompt, then one per token."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        _sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _generate(hf, prompt: list[int], n: int) -> tuple[list[float], float, float]:
    """One greedy generate of exactly n tokens; (token times, t0, wall)."""
    from transformers import GenerationConfig

    device = hf.device
    ids = torch.tensor([prompt], device=device)
    cfg = GenerationConfig(
        max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    clock = _TokenClock(device)
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=cfg, streamer=clock
        )
    _sync(device)
    wall = time.perf_counter() - t0
    if out.shape[1] - len(prompt) != n:
        raise RuntimeError(
            f"transformers generate made {out.shape[1] - len(prompt)} tokens, not {n}"
        )
    return clock.times[1:], t0, wall


def run_latency(hf, w: Workload, warmup: Workload, runs: int) -> BenchResult:
    _generate(hf, warmup.prompts[0], warmup.max_tokens[0])
    n = w.max_tokens[0]
    samples = []
    for _ in range(runs):
        times, t0, wall = _generate(hf, w.prompts[0], n)
        tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
        samples.append((tpot or 0.0, times[0] - t0, wall))
    tpot, ttft, wall = sorted(samples)[len(samples) // 2]
    return _result(
        requests=1,
        output_tokens=n,
        seconds=wall,
        tokens_per_s=1.0 / tpot if tpot else None,
        tokens_per_s_incl_prefill=n / wall,
        ttft_s=ttft,
        tpot_s=tpot or None,
        notes={
            "api": "generate (sdpa, dynamic cache, eager)",
            "runs": runs,
            "tpot_runs_ms": [round(1e3 * s[0], 4) for s in samples],
        },
    )


def run_ttft(hf, w: Workload, warmup: Workload, runs: int) -> BenchResult:
    _generate(hf, warmup.prompts[0], warmup.max_tokens[0])
    _generate(hf, w.prompts[0], 1)  # first long prefill: not timed
    ttfts, walls = [], []
    for _ in range(runs):
        times, t0, wall = _generate(hf, w.prompts[0], 1)
        ttfts.append(times[0] - t0)
        walls.append(wall)
    ttft = statistics.median(ttfts)
    return _result(
        requests=1,
        output_tokens=1,
        seconds=statistics.median(walls),
        tokens_per_s=None,
        ttft_s=ttft,
        ttft_runs_s=ttfts,
        notes={
            "api": "generate(max_new_tokens=1)",
            "runs": runs,
            "prefill_tokens_per_s": round(len(w.prompts[0]) / ttft, 2),
        },
    )
