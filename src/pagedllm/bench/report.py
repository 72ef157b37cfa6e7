"""Print a benchmark's result: a human table, then exactly one JSON line, last.

Owns: the record's field names (`docs/benchmarks.md` lists them) and the
table's layout. Does not own: any measurement.

`ratio` is always "how many times better ours is": ours/peer for tokens/s,
peer/ours for time to first token. Above 1 means pagedllm wins.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from typing import Any

from pagedllm.bench.result import BenchResult

Row = tuple[str, Callable[[BenchResult], Any], str, str | None]  # label, getter, format, better


def _ms(v: float | None) -> float | None:
    return None if v is None else 1e3 * v


ROWS: dict[str, list[Row]] = {
    "throughput": [
        ("requests", lambda r: r.requests, "d", None),
        ("output tokens", lambda r: r.output_tokens, "d", None),
        ("wall time (s)", lambda r: r.seconds, ".2f", "lower"),
        ("output tokens/s", lambda r: r.tokens_per_s, ".1f", "higher"),
        ("median time to first token (ms)", lambda r: _ms(r.ttft_s), ".1f", "lower"),
        ("median time per output token (ms)", lambda r: _ms(r.tpot_s), ".2f", "lower"),
        ("host time per step (ms)", lambda r: r.host_time_per_step_ms, ".3f", None),
        ("engine steps", lambda r: r.notes.get("steps"), "d", None),
        ("peak active requests", lambda r: r.notes.get("peak_active_requests"), "d", None),
        ("admission waits", lambda r: r.notes.get("admission_waits"), "d", None),
    ],
    "latency": [
        ("decode tokens/s (1 / TPOT)", lambda r: r.tokens_per_s, ".1f", "higher"),
        ("tokens/s incl. prefill", lambda r: r.tokens_per_s_incl_prefill, ".1f", "higher"),
        ("time to first token (ms)", lambda r: _ms(r.ttft_s), ".2f", "lower"),
        ("time per output token (ms)", lambda r: _ms(r.tpot_s), ".3f", "lower"),
        ("achieved GB/s", lambda r: r.achieved_gbps, ".1f", "higher"),
        ("host time per step (ms)", lambda r: r.host_time_per_step_ms, ".3f", None),
    ],
    "ttft": [
        ("median time to first token (ms)", lambda r: _ms(r.ttft_s), ".2f", "lower"),
        ("fastest run (ms)", lambda r: _ms(min(r.ttft_runs_s, default=None)), ".2f", "lower"),
        ("slowest run (ms)", lambda r: _ms(max(r.ttft_runs_s, default=None)), ".2f", "lower"),
        ("prefill tokens/s", lambda r: r.notes.get("prefill_tokens_per_s"), ".0f", "higher"),
        ("host time per step (ms)", lambda r: r.host_time_per_step_ms, ".3f", None),
    ],
}


def headline_ratio(workload: str, ours: BenchResult, peer: BenchResult | None) -> float | None:
    if peer is None:
        return None
    if workload == "ttft":
        return _div(peer.ttft_s, ours.ttft_s)
    return _div(ours.tokens_per_s, peer.tokens_per_s)


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def build_record(
    workload: str,
    ours: BenchResult,
    peer: BenchResult | None,
    context: dict[str, Any],
) -> dict[str, Any]:
    """The JSON line: context (commit, device, model...), our figures at top level, the peer's."""
    ratio = headline_ratio(workload, ours, peer)
    record: dict[str, Any] = {
        "engine": ours.engine,
        "version": ours.version,
        "commit": context.get("commit", "unknown"),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": context.get("device"),
        "dtype": context.get("dtype"),
        "threads": context.get("threads"),  # torch CPU (intra-op) threads
        "omp_wait_policy": context.get("omp_wait_policy"),
        "model": context.get("model"),
        "workload": workload,
        "workload_description": context.get("workload_description"),
    }
    record.update(ours.to_json())
    for key in ("bandwidth_gbps", "bandwidth_source", "bytes_per_token", "floor_tokens_per_s"):
        if key in context:
            record[key] = context[key]
    if ours.achieved_gbps is not None and context.get("bandwidth_gbps"):
        record["bandwidth_fraction"] = round(ours.achieved_gbps / context["bandwidth_gbps"], 4)
    record["peer"] = None if peer is None else peer.to_json()
    record["ratio"] = None if ratio is None else round(ratio, 3)
    record["ratio_of"] = (
        ("ttft peer/ours" if workload == "ttft" else "tokens_per_s ours/peer")
        if peer is not None
        else None
    )
    record["command"] = context.get("command")
    record["options"] = context.get("options")
    return record


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def format_table(workload: str, ours: BenchResult, peer: BenchResult | None, context: dict) -> str:
    lines = [
        f"pagedllm bench {workload}: {context.get('model')} on {context.get('device')}, "
        f"{context.get('dtype')}, commit {context.get('commit')}",
        f"torch CPU threads: {context.get('threads')} "
        f"(OMP_WAIT_POLICY={context.get('omp_wait_policy') or 'unset'})",
        f"workload: {context.get('workload_description')}",
    ]
    if "bandwidth_gbps" in context:
        lines.append(
            f"roofline: {context['bytes_per_token'] / 1e6:.1f} MB read per token at "
            f"{context['bandwidth_gbps']:.1f} GB/s ({context['bandwidth_source']}) -> floor "
            f"{context['floor_tokens_per_s']:.1f} tokens/s"
        )
    header = f"{'':<36}{'pagedllm':>14}"
    if peer is not None:
        header += f"{'transformers':>14}{'speed-up':>10}"
        lines.append("speed-up: how many times better pagedllm is (> 1: pagedllm wins)")
    lines += ["", header]
    for label, get, spec, better in ROWS[workload]:
        a = get(ours)
        row = f"{label:<36}{_fmt(a, spec):>14}"
        if peer is not None:
            b = get(peer)
            gain = None
            if better == "higher":
                gain = _div(a, b)
            elif better == "lower":
                gain = _div(b, a)
            row += f"{_fmt(b, spec):>14}{'-' if gain is None else f'{gain:.2f}x':>10}"
        lines.append(row)
    ratio = headline_ratio(workload, ours, peer)
    if ratio is not None:
        what = (
            "time to first token"
            if workload == "ttft"
            else ("decode tokens/s" if workload == "latency" else "output tokens/s")
        )
        lines.append(f"\npagedllm is {ratio:.2f}x transformers on {what}")
    if ours.achieved_gbps is not None and context.get("bandwidth_gbps"):
        frac = ours.achieved_gbps / context["bandwidth_gbps"]
        lines.append(f"pagedllm reads memory at {100 * frac:.1f}% of the ceiling")
    return "\n".join(lines)


def emit(record: dict[str, Any], table: str, json_path: str | None) -> None:
    """Table first, then the JSON line last on stdout; also write it to `json_path`."""
    print(table)
    print(json.dumps(record), flush=True)
    if json_path:
        write_json(record, json_path)


def write_json(record: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(record) + "\n")
