"""One helper for the GPU microbenchmarks in scripts/: time a captured CUDA graph.

from graph_timing import replay_us   (scripts/ is on sys.path when a script runs)
"""

from __future__ import annotations

import torch


def replay_us(body, replays: int = 20):
    """(microseconds per replay, body's return value) of `body()` captured in one
    CUDA graph. `body` runs once eagerly first (Triton compiles on first launch),
    then is captured, replayed once to warm up, and timed over `replays`."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays, out
