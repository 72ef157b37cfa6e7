"""`pagedllm trace`: watch the buffers between a prompt and its next tokens, step by step.

    pagedllm trace "What is a KV cache?"                     # 3 steps, every layer
    pagedllm trace "Hi" "Tell me a joke." --steps 4 --layer 0 --layer 29
    pagedllm trace "Hi" --json | head -1                     # one JSON object per step

For each engine step it prints what each layer made:
1. the scheduler's decision: who was admitted (and how many prompt tokens
   the prefix cache held), who waits and why, who was preempted, each
   running request's pages;
2. the batch the runner built from it: input ids, positions, the slot of
   each new token in the KV cache, sequence lengths, block tables;
3. RoPE's cos/sin at the batch's positions (and, for Gemma 3, those of its
   windowed layers' own RoPE base), then per traced layer the shape and a
   checksum (sum, mean |x|, first values) of each buffer in BUFFERS: the
   norms' outputs, q and k before and after RoPE, v, the attention output,
   the projections, the MLP's gated activation, and the hidden state after
   the layer (the residual stream: transformers' `output_hidden_states[layer
   + 1]`); `--buffer` picks some;
4. each sampled token with its top-5 log-probs. Greedy, unless --temperature
   (with --top-p, --top-k, --min-p, --seed: the generate command's flags,
   `sampling_args.py`).

Every family (Llama, Qwen2, Qwen3, Mistral, Gemma 3) runs the one decoder of
`model/llama.py`, so every family has the same buffers, named after Llama's
layer; BUFFERS says what each holds where a family's layer differs (Qwen2's
q/k/v biases, Qwen3's and Gemma's per-head q/k norms, Gemma's norms after
attention and the MLP and its GeGLU). Each record's "model" says the family,
the MLP's activation and each traced layer's sliding window.

How: the trace runs a normal engine (eager, no CUDA graphs, no async
scheduling, so every kernel runs where Python can see it) and listens at
three places: `Scheduler.schedule` (the plan), `ModelRunner.prepare` (the
batch) and `LlamaModel.tracer` (each layer's tensors). Outside a trace none
of them is touched: `LlamaModel.tracer` stays None and costs one comparison
per layer.

Owns: the trace's records (`trace_steps`, plain dicts) and their printing.
Does not own: anything it observes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from pagedllm.cli_errors import error
from pagedllm.engine_args import add_engine_arguments, engine_config_from_args, positive_int
from pagedllm.sampling_args import add_sampling_arguments, greedy_note, sampling_kwargs
from pagedllm.utils import plural

PROG = "pagedllm trace"
SHOWN = 8  # values shown of each id list
TOP_LOGPROBS = 5
# What LlamaModel.forward hands the tracer, in order: layer -1 is the embedding,
# layer num_layers the final norm (the rows that go to the LM head). The names
# are Llama's; each comment says what the buffer holds in every family, and
# tests/test_trace_families.py checks each against the same point of transformers'
# model of that family.
BUFFERS = (
    "embedding",  # the embedding rows (Gemma 3: times sqrt(E), as its HF model scales them)
    "attn_norm",  # RMSNorm of the residual stream, the input of q/k/v
    # q and k as the QKV matmul made them, before RoPE: plus the bias (Qwen2), after
    # the per-head RMSNorm (Qwen3, Gemma 3)
    "q_raw",
    "k_raw",
    "q",  # after RoPE (Gemma 3's windowed layers: with their own base, "rope_local")
    "k",
    "v",
    # softmax(q k^T * scale) v, per head; scale 1/sqrt(D) (Gemma 3: its
    # query_pre_attn_scalar); a windowed layer attends to its last W positions only
    "attention",
    # the attention's output projected back to the hidden size (Gemma 3: after its
    # post-attention norm, HF's post_attention_layernorm: what the residual adds)
    "o_proj",
    # RMSNorm of the residual stream after the attention, the MLP's input (HF's
    # post_attention_layernorm in Llama; pre_feedforward_layernorm in Gemma 3)
    "mlp_norm",
    "gate_up",  # gate and up projections, side by side
    # act(gate) * up: silu (SwiGLU) in every family but Gemma 3, whose GeGLU is
    # gelu_tanh(gate) * up. The name stays "swiglu" (the tour's chapter 8 and
    # --buffer users know it by that); each record's model.activation says which.
    "swiglu",
    # the MLP's output (Gemma 3: after its post-MLP norm, HF's
    # post_feedforward_layernorm: what the residual adds)
    "down",
    "hidden",  # the residual stream after the layer (transformers' hidden_states[L + 1])
    "final_norm",
)


def summarize(t) -> dict[str, Any]:
    """Shape and a checksum of a tensor: sum, mean |x| and its first values."""
    flat = t.detach().float().reshape(-1)
    return {
        "shape": list(t.shape),
        "sum": round(float(flat.double().sum()), 6),
        "mean_abs": round(float(flat.abs().mean()), 6) if flat.numel() else 0.0,
        "first": [round(float(x), 5) for x in flat[:4].tolist()],
    }


def trace_steps(
    engine,
    prompts: Sequence[Sequence[int]],
    params,
    steps: int,
    layers: Sequence[int] | None = None,
    buffers: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Add `prompts` (token ids) with `params`, run up to `steps` steps, and
    return one record per step (plain values: JSON as it is).

    `layers`: which layers' tensors to record (None: all); `buffers`: which
    of BUFFERS (None: all). The engine should
    run eagerly (no CUDA graphs: a replayed graph calls no Python); async
    scheduling is switched off for the trace (a queued step is planned
    without `schedule`, and its batch would show tokens not yet known)."""
    model, scheduler, runner = engine.model, engine.scheduler, engine.runner
    num_layers = len(model.layers)
    wanted = set(range(num_layers) if layers is None else layers)
    for i in wanted:
        if not 0 <= i < num_layers:
            raise ValueError(f"layer {i} does not exist: the model has layers 0..{num_layers - 1}")
    names = set(BUFFERS if buffers is None else buffers)
    for name in names - set(BUFFERS):
        raise ValueError(f"no buffer {name!r}: choose from {', '.join(BUFFERS)}")
    current: dict[str, Any] = {}
    cfg = model.config
    # What the buffers' names do not say: the family, the MLP's activation (the
    # "swiglu" buffer holds act(gate) * up), and the traced layers' sliding windows.
    about: dict[str, Any] = {"family": cfg.family, "activation": cfg.hidden_act}
    windows = {str(i): cfg.window(i) for i in sorted(wanted) if cfg.window(i)}
    if windows:
        about["windows"] = windows
        if model.local_cos_sin_cache is not None:
            about["local_rope_theta"] = cfg.local_rope_theta

    def on_plan(plan):
        bm = engine.block_manager
        current["scheduler"] = {
            "scheduled": [
                {"request": r.request_id, "new_tokens": n, "computed_before": c}
                for r, n, c in zip(plan.scheduled, plan.num_new_tokens, plan.num_computed_tokens)
            ],
            "admitted": [
                {"request": r.request_id, "cached_prompt_tokens": r.num_computed_tokens}
                for r in plan.admitted
            ],
            "preempted": [r.request_id for r in plan.preempted],
            "waiting": [r.request_id for r in scheduler.waiting],
            "why_waiting": (
                "the head of the queue does not fit in the free pages"
                if plan.admission_wait
                else ("max_num_seqs or the step's token budget" if scheduler.waiting else None)
            ),
            "pages": {str(r.request_id): list(bm.block_table(r)) for r in scheduler.running},
            "pages_free": bm.num_free_blocks,
            "pages_total": bm.num_blocks,
        }

    def on_batch(host):
        positions = [int(p) for p in host.positions]
        cos_sin = model.cos_sin_cache[positions]  # (T, D): cos in the first half, sin after
        half = cos_sin.shape[-1] // 2
        current["batch"] = {
            "input_ids": [int(x) for x in host.input_ids],
            "positions": positions,
            "slot_mapping": [int(x) for x in host.slot_mapping],
            "seq_lens": [int(x) for x in host.seq_lens],
            "cu_seqlens": [int(x) for x in host.cu_seqlens],
            "block_tables": [
                [int(x) for x in row[: -(-int(n) // engine.block_manager.block_size)]]
                for row, n in zip(host.block_tables, host.seq_lens)
            ],
            "logits_rows": [int(x) for x in host.logits_indices],
        }
        current["rope"] = {
            "cos": summarize(cos_sin[:, :half]),
            "sin": summarize(cos_sin[:, half:]),
        }
        if model.local_cos_sin_cache is not None:  # Gemma 3's windowed layers rotate apart
            local = model.local_cos_sin_cache[positions]
            current["rope_local"] = {
                "cos": summarize(local[:, :half]),
                "sin": summarize(local[:, half:]),
            }
        current["layers"] = {}

    def on_tensor(layer: int, name: str, t) -> None:
        if name in names and (layer in (-1, num_layers) or layer in wanted):
            current["layers"].setdefault(str(layer), {})[name] = summarize(t)

    real_schedule, real_prepare = scheduler.schedule, runner.prepare

    def schedule():
        plan = real_schedule()
        on_plan(plan)
        return plan

    def prepare(plan, full):
        host = real_prepare(plan, full)
        host.every_row = True  # the last layer too computes every row (see LlamaModel._layers)
        on_batch(host)
        return host

    requests = [engine.add_request(list(p), params) for p in prompts]
    records: list[dict[str, Any]] = []
    scheduler.schedule, runner.prepare, model.tracer = schedule, prepare, on_tensor
    was_async, engine.async_scheduling = engine.async_scheduling, False
    try:
        for n in range(1, steps + 1):
            if not engine.has_unfinished():
                break
            current.clear()
            outputs = engine.step()
            record = {
                "step": n,
                "num_layers": num_layers,
                "model": about,
                **current,
                "sampled": [],
            }
            for out in outputs:
                state = out.state
                for j, token in enumerate(out.new_token_ids):
                    entry = {"request": out.request.request_id, "token": token}
                    if state is not None and state.logprobs:
                        lp = state.logprobs[len(state.logprobs) - len(out.new_token_ids) + j]
                        top = sorted(lp.items(), key=lambda kv: -kv[1])[:TOP_LOGPROBS]
                        entry["logprob"] = round(lp.get(token, float("nan")), 5)
                        entry["top"] = [[t, round(v, 5)] for t, v in top]
                    if engine.tokenizer is not None:
                        entry["text"] = engine.tokenizer.decode([token])
                        for pair in entry.get("top", []):
                            pair.append(engine.tokenizer.decode([pair[0]]))
                    record["sampled"].append(entry)
                if out.finished:
                    record["sampled"].append(
                        {"request": out.request.request_id, "finished": str(out.finish_reason)}
                    )
            records.append(record)
    finally:
        scheduler.schedule, runner.prepare, model.tracer = real_schedule, real_prepare, None
        engine.async_scheduling = was_async
        for r in requests:
            engine.abort(r, report=False)
        engine.step()  # hand the aborts' outputs back; the pool is empty again
    return records


# ------------------------------------------------------------------ printing
def _ids(values: list) -> str:
    shown = ", ".join(str(v) for v in values[:SHOWN])
    return f"[{shown}{', ...' if len(values) > SHOWN else ''}] ({len(values)})"


def _tensor(s: dict[str, Any]) -> str:
    shape = "x".join(map(str, s["shape"]))
    return f"{shape} sum {s['sum']:.4g} |x| {s['mean_abs']:.4g} first {s['first']}"


def _about(m: dict[str, Any]) -> str:
    """One line on the model: its family, its MLP and its traced layers' windows."""
    act = {"silu": "SwiGLU, silu(gate) * up", "gelu_tanh": "GeGLU, gelu_tanh(gate) * up"}
    line = f"model: {m['family']}; the swiglu buffer is {act.get(m['activation'], m['activation'])}"
    windows = m.get("windows")
    if windows:
        sizes = sorted(set(windows.values()))
        line += (
            f"; windowed: layer{'s' if len(windows) > 1 else ''} {', '.join(windows)} "
            f"(the last {' or '.join(map(str, sizes))} positions"
            + (f", RoPE base {m['local_rope_theta']:g})" if "local_rope_theta" in m else ")")
        )
    return line


def format_record(r: dict[str, Any]) -> str:
    lines = [f"== step {r['step']}"]
    if r["step"] == 1 and "model" in r:
        lines.append(_about(r["model"]))
    sc = r.get("scheduler")
    if sc:
        ran = ", ".join(
            f"r{x['request']} +{x['new_tokens']} (from {x['computed_before']})"
            for x in sc["scheduled"]
        )
        lines.append(f"scheduler: runs {ran}")
        for a in sc["admitted"]:
            lines.append(
                f"  admitted r{a['request']} ({plural(a['cached_prompt_tokens'], 'prompt token')} "
                "from the prefix cache)"
            )
        if sc["preempted"]:
            lines.append(f"  preempted {sc['preempted']} (pages taken back; they recompute)")
        if sc["waiting"]:
            lines.append(f"  waiting {sc['waiting']}: {sc['why_waiting']}")
        pages = "; ".join(f"r{k} {v}" for k, v in sc["pages"].items())
        lines.append(f"  pages: {pages}  ({sc['pages_free']} of {sc['pages_total']} free)")
    b = r.get("batch")
    if b:
        lines.append("batch:")
        for key in ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_rows"):
            lines.append(f"  {key:<13}{_ids(b[key])}")
        lines.append(f"  {'block_tables':<13}{b['block_tables']}")
        lines.append(f"rope at the positions: cos {_tensor(r['rope']['cos'])}")
        lines.append(f"                       sin {_tensor(r['rope']['sin'])}")
        if "rope_local" in r:
            local = r["rope_local"]
            lines.append(f"windowed layers' rope: cos {_tensor(local['cos'])}")
            lines.append(f"                       sin {_tensor(local['sin'])}")
    for layer, tensors in r.get("layers", {}).items():
        label = {"-1": "embedding", str(r.get("num_layers")): "final"}.get(layer, f"layer {layer}")
        for name, s in tensors.items():
            lines.append(f"{label:<10}{name:<11}{_tensor(s)}")
    for e in r["sampled"]:
        if "finished" in e:
            lines.append(f"r{e['request']} finished: {e['finished']}")
            continue
        text = f" {e['text']!r}" if "text" in e else ""
        line = f"sampled r{e['request']}: {e['token']}{text}"
        if "logprob" in e:
            top = ", ".join(
                f"{p[0]}{' ' + repr(p[2]) if len(p) > 2 else ''} {p[1]:.3f}" for p in e["top"]
            )
            line += f" logprob {e['logprob']:.3f}; top-{len(e['top'])}: {top}"
        lines.append(line)
    return "\n".join(lines)


# ------------------------------------------------------------------ command
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Run a few engine steps and print every buffer between the prompt and "
        "the next token (docs/tour/).",
    )
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="one or more prompts")
    p.add_argument("--steps", type=positive_int, default=3, help="steps to run (default 3)")
    p.add_argument(
        "--layer",
        type=int,
        action="append",
        metavar="L",
        help="trace layer L (repeatable; default: every layer)",
    )
    p.add_argument(
        "--buffer",
        action="append",
        metavar="NAME",
        choices=BUFFERS,
        help="record only this buffer (repeatable; default: all): "
        + ", ".join(BUFFERS)
        + " (every family has them all; swiglu is Gemma 3's GeGLU there)",
    )
    p.add_argument("--raw", action="store_true", help="the text as is, without the chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per step instead")
    add_sampling_arguments(p.add_argument_group("sampling (greedy unless --temperature)"))
    add_engine_arguments(p)
    return p


def trace_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = engine_config_from_args(args, parser).replace(
        cuda_graphs=False, async_scheduling=False
    )
    from pagedllm import SamplingParams
    from pagedllm.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config, log=lambda m: print(f"[trace] {m}", file=sys.stderr))
        if config.tensor_parallel_size > 1:
            print(
                f"[trace] tensor parallelism: the buffers below are rank 0's slices (1/"
                f"{config.tensor_parallel_size} of the heads and of the MLP width)",
                file=sys.stderr,
            )
        tok = engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer: trace needs text prompts")
        if args.raw:
            prompts = [tok.encode(p, add_special_tokens=True) for p in args.prompts]
        else:
            prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in args.prompts]
        sampling = sampling_kwargs(args)
        if sampling["temperature"] is None:  # the trace's default: greedy
            sampling["temperature"] = 0.0
            print(f"[trace] {greedy_note(args)}", file=sys.stderr)
        params = SamplingParams(
            max_tokens=args.steps, logprobs=TOP_LOGPROBS, ignore_eos=True, **sampling
        )
        records = trace_steps(engine, prompts, params, args.steps, args.layer, args.buffer)
    except (ValueError, OSError) as e:  # a model that cannot be loaded (missing: OSError)
        return error(PROG, e)
    for record in records:
        print(json.dumps(record) if args.json else format_record(record))
    return 0
