"""One engine's figures on one workload: what both runners return and the report prints.

Times are seconds here; the report turns them into milliseconds. A figure an
engine cannot give is None, never 0 or -1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class BenchResult:
    engine: str  # "pagedllm" or "transformers"
    version: str
    requests: int
    output_tokens: int
    seconds: float  # wall time of the measured work (median run for batch 1 / ttft)
    tokens_per_s: float | None  # throughput: output tokens / wall; latency: 1 / TPOT
    total_tokens_per_s: float | None = None  # throughput: (prompt + output tokens) / wall
    tokens_per_s_incl_prefill: float | None = None  # batch 1: new tokens / wall of the request
    ttft_s: float | None = None  # time to first token (median for ttft)
    tpot_s: float | None = None  # time per output token after the first
    ttft_runs_s: list[float] = field(default_factory=list)
    achieved_gbps: float | None = None  # batch-1 decode: bytes read per token / TPOT
    host_time_per_step_ms: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)  # engine-specific figures

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("ttft_s", "tpot_s"):
            v = d.pop(key)
            d[key.replace("_s", "_ms")] = None if v is None else round(1e3 * v, 4)
        d["ttft_runs_ms"] = [round(1e3 * v, 4) for v in d.pop("ttft_runs_s")]
        for key in (
            "seconds",
            "tokens_per_s",
            "total_tokens_per_s",
            "tokens_per_s_incl_prefill",
            "achieved_gbps",
        ):
            if d[key] is not None:
                d[key] = round(d[key], 4)
        return d
