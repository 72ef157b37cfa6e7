"""Print a benchmark's result: a human table, then exactly one JSON line, last.

Owns: the record's field names (`docs/benchmarks.md` lists them) and the
table's layout. Does not own: any measurement.

`ratio` is always "how many times better ours is": ours/peer for tokens/s,
peer/ours for time to first token. Above 1 means pagedllm wins.

`prefix` and `pages` compare pagedllm with itself under other settings: their
record holds the same context fields, then "runs" (one entry per setting: the
setting, then the figures of a throughput record).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path
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
    record = _context_fields(workload, ours, context)
    record.update(ours.to_json())
    for key in (
        "bandwidth_gbps",
        "bandwidth_source",
        "bytes_per_token",
        "floor_tokens_per_s",
        "plot",  # throughput --plot DIR: where the run's pictures are
    ):
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


def _context_fields(workload: str, ours: BenchResult, context: dict[str, Any]) -> dict[str, Any]:
    return {
        "engine": ours.engine,
        "version": ours.version,
        "commit": context.get("commit", "unknown"),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": context.get("device"),
        "dtype": context.get("dtype"),
        "weights": context.get("weights"),  # "packed": a CPU GGUF's kept quantized
        "threads": context.get("threads"),  # torch CPU (intra-op) threads
        "omp_wait_policy": context.get("omp_wait_policy"),
        "model": context.get("model"),
        "workload": workload,
        "workload_description": context.get("workload_description"),
    }


def build_runs_record(
    workload: str,
    runs: list[tuple[dict[str, Any], BenchResult]],
    context: dict[str, Any],
    headline: dict[str, Any],
) -> dict[str, Any]:
    """The JSON line of a comparison of our own settings (`prefix`, `pages`).

    Context fields, then `headline` (the figures the command is about), then
    "runs": each setting (e.g. {"prefix_caching": true}) with that run's figures.
    """
    record = _context_fields(workload, runs[0][1], context)
    record.update(headline)
    record["runs"] = [{**setting, **result.to_json()} for setting, result in runs]
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
    lines = _header_lines(workload, context)
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


def _header_lines(workload: str, context: dict) -> list[str]:
    return [
        f"pagedllm bench {workload}: {context.get('model')} on {context.get('device')}, "
        f"{context.get('dtype')}{' (weights packed)' if context.get('weights') == 'packed' else ''}, "
        f"commit {context.get('commit')}",
        f"torch CPU threads: {context.get('threads')} "
        f"(OMP_WAIT_POLICY={context.get('omp_wait_policy') or 'unset'})",
        f"workload: {context.get('workload_description')}",
    ]


def _pct(v: float | None) -> float | None:
    return None if v is None else 100 * v


PREFIX_ROWS: list[Row] = [
    ("requests", lambda r: r.requests, "d", None),
    ("prompt tokens", lambda r: r.notes.get("prompt_tokens"), "d", None),
    ("prompt tokens computed", lambda r: r.notes.get("prefill_tokens"), "d", "lower"),
    ("output tokens", lambda r: r.output_tokens, "d", None),
    ("wall time (s)", lambda r: r.seconds, ".2f", "lower"),
    ("output tokens/s", lambda r: r.tokens_per_s, ".1f", "higher"),
    ("total tokens/s (prompt + output)", lambda r: r.total_tokens_per_s, ".1f", "higher"),
    (
        "prefix cache hit rate (%)",
        lambda r: _pct(r.notes.get("prefix_cache_hit_rate")),
        ".1f",
        None,
    ),
    ("prefix cache hit tokens", lambda r: r.notes.get("prefix_cache_hit_tokens"), "d", None),
    ("median time to first token (ms)", lambda r: _ms(r.ttft_s), ".1f", "lower"),
    ("engine steps", lambda r: r.notes.get("steps"), "d", None),
    ("admission waits", lambda r: r.notes.get("admission_waits"), "d", None),
    ("preemptions", lambda r: r.notes.get("preemptions"), "d", None),
]


def format_prefix_table(on: BenchResult, off: BenchResult, context: dict) -> str:
    """Prefix caching on beside off; "on/off": how many times better caching makes each row."""
    lines = _header_lines("prefix", context)
    if context.get("reusable_share") is not None:
        lines.append(
            f"a prefix cache can reuse at most {100 * context['reusable_share']:.1f}% of the "
            "prompt tokens here (the shared prefix's full pages, in every request but the first)"
        )
    lines += ["", f"{'':<36}{'caching on':>14}{'caching off':>14}{'on/off':>10}"]
    for label, get, spec, better in PREFIX_ROWS:
        a, b = get(on), get(off)
        gain = _div(a, b) if better == "higher" else _div(b, a) if better == "lower" else None
        lines.append(
            f"{label:<36}{_fmt(a, spec):>14}{_fmt(b, spec):>14}"
            f"{'-' if gain is None else f'{gain:.2f}x':>10}"
        )
    ratio = _div(on.tokens_per_s, off.tokens_per_s)
    if ratio is not None:
        lines.append(f"\nprefix caching makes output tokens/s {ratio:.2f}x")
    return "\n".join(lines)


PAGES_COLUMNS: list[tuple[str, Callable[[BenchResult], Any], str, int]] = [
    ("output tok/s", lambda r: r.tokens_per_s, ".1f", 14),
    ("wall (s)", lambda r: r.seconds, ".2f", 10),
    ("adm. waits", lambda r: r.notes.get("admission_waits"), "d", 12),
    ("preemptions", lambda r: r.notes.get("preemptions"), "d", 13),
    ("peak pages", lambda r: r.notes.get("pages_peak_used"), "d", 12),
    ("of", lambda r: r.notes.get("pages_total"), "d", 7),
    ("peak MiB", lambda r: r.notes.get("pages_peak_used_mib"), ".2f", 10),
]


def format_pages_table(runs: list[tuple[dict[str, Any], BenchResult]], context: dict) -> str:
    """One row per (page size, admission policy)."""
    lines = _header_lines("pages", context)
    lines.append(
        f"page pool: --kv-cache-mib {context.get('kv_cache_mib'):g} (the same bytes for every "
        "page size; peak pages and MiB are the engine's peak over the run)"
    )
    header = f"{'page size':>10}  {'admission':<12}"
    header += "".join(f"{name:>{width}}" for name, _, _, width in PAGES_COLUMNS)
    lines += ["", header]
    for setting, r in runs:
        row = f"{setting['block_size']:>10}  {setting['admission']:<12}"
        row += "".join(f"{_fmt(get(r), spec):>{width}}" for _, get, spec, width in PAGES_COLUMNS)
        lines.append(row)
    best_setting, best = max(runs, key=lambda sr: sr[1].tokens_per_s or 0.0)
    lines.append(
        f"\nfastest: page size {best_setting['block_size']}, {best_setting['admission']} "
        f"admission, {best.tokens_per_s:.1f} output tokens/s"
    )
    if context.get("plot"):
        lines.append(f"plot of pages in use per step: {context['plot']}")
    return "\n".join(lines)


def emit(record: dict[str, Any], table: str, json_path: str | None) -> None:
    """Table first, then the JSON line last on stdout; also write it to `json_path`."""
    print(table)
    print(json.dumps(record), flush=True)
    if json_path:
        write_json(record, json_path)


# A file larger than this is no record of ours (one is a few KiB; `pages` about 10).
_RECORD_MAX_BYTES = 1 << 20


def is_bench_record(text: str) -> bool:
    """Whether `text` is one record that `pagedllm bench` wrote (its "command" says so)."""
    try:
        record = json.loads(text)
    except ValueError:
        return False
    command = record.get("command") if isinstance(record, dict) else None
    return isinstance(command, str) and command.startswith("pagedllm bench")


def check_json_path(path: str) -> None:
    """Raise ValueError unless `--json PATH` may be written: a new file, an empty one,
    or one that holds an earlier record of `pagedllm bench` (replaced, as a rerun
    replaces its figures). Anything else there would be lost, so it is refused."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"--json {path}: is a directory; give a file path")
    if not p.parent.is_dir():
        raise ValueError(f"--json {path}: no such directory ({p.parent})")
    if not p.exists():
        return
    if not p.is_file():
        raise ValueError(f"--json {path}: not a regular file; give a file path")
    size = p.stat().st_size
    if size == 0:
        return
    try:
        text = p.read_text(encoding="utf-8") if size <= _RECORD_MAX_BYTES else ""
    except (OSError, UnicodeDecodeError):
        text = ""
    if not is_bench_record(text):
        raise ValueError(
            f"--json {path}: the file exists and is not a pagedllm bench record "
            f"({size:,} bytes); writing the record would replace it: give a new path, "
            "or move the file away first"
        )


def write_json(record: dict[str, Any], path: str) -> None:
    """Write the record as one line to `path`, replacing an earlier record there (never
    another file: `check_json_path`; the record is on stdout already when this refuses)."""
    check_json_path(path)
    with open(path, "w") as f:
        f.write(json.dumps(record) + "\n")
