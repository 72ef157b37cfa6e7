"""Prometheus metrics of one server (`GET /metrics`), with `prometheus_client`.

Owns: the latency histograms (time to first token, inter-token latency,
end-to-end) and token counters, observed as outputs arrive in the HTTP
process, and gauges set from the engine core's counters when scraped
(requests running and waiting, KV pages used and free, prefix-cache hit rate,
preemptions, admission waits): the core sends them with every step's message
(`core_process.Gauges`), so a scrape never asks the core anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, gauges: Callable[[], Any]) -> None:
        """`gauges`: the core's latest `Gauges` (None before its first step)."""
        self.gauges = gauges
        r = self.registry = CollectorRegistry()
        p = "pagedllm_"
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Time to first token",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Time between a request's outputs",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Request latency, end to end",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter(
            p + "requests_finished", "Finished requests", ["finish_reason"], registry=r
        )
        self._gauges = {
            name: Gauge(p + name, help_text, registry=r)
            for name, help_text in (
                ("requests_running", "Requests running"),
                ("requests_waiting", "Requests waiting"),
                ("kv_pages_used", "KV pages held by requests"),
                ("kv_pages_free", "KV pages free (cached ones included)"),
                ("kv_pages_total", "KV pages in the pool"),
                ("prefix_cache_hit_rate", "Prompt tokens reused / prompt tokens looked up"),
                ("preemptions", "Requests preempted so far"),
                ("admission_waits", "Steps in which the head of the queue did not fit"),
                (
                    "model_weight_bytes",
                    "Bytes of the model's weights on the device (rank 0's under tensor "
                    "parallelism; FP8 projections at one byte a value plus their scales)",
                ),
            )
        }

    def on_output(self, out: Any, t0: float, last: float | None, now: float) -> None:
        """One output of one request arrived at `now` (request sent at `t0`)."""
        if out.new_token_ids:
            self.generation_tokens.inc(len(out.new_token_ids))
            (self.ttft if last is None else self.itl).observe(now - (t0 if last is None else last))
        if out.finished:
            self.e2e.observe(now - t0)
            self.prompt_tokens.inc(out.request.num_prompt_tokens)
            self.finished.labels(str(out.request.finish_reason)).inc()

    def render(self) -> tuple[bytes, str]:
        g = self.gauges()
        if g is not None:
            for name in self._gauges:
                self._gauges[name].set(getattr(g, _GAUGE_FIELDS.get(name, name)))
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# Gauge name -> core_process.Gauges field, where they differ.
_GAUGE_FIELDS = {
    "requests_running": "running",
    "requests_waiting": "waiting",
    "kv_pages_used": "pages_used",
    "kv_pages_free": "pages_free",
    "kv_pages_total": "pages_total",
    "model_weight_bytes": "weight_bytes",
}
