"""Pictures of a run: the step recorder against the engine's own state, and
the PNGs `pagedllm --plot DIR` writes (opened, checked for size and content)."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.cli import main
from pagedllm.engine.timeline import DECODE, PREFILL, WAITING, StepRecorder
from pagedllm.plots import FILES
from test_engine_online import tiny  # noqa: F401 (the fixture: a GQA tiny model)
from tiny_models import greedy


def test_the_recorder_follows_the_engine(tiny):  # noqa: F811
    page_mib = tiny.config.kv_bytes_per_token(4) * 16 / 2**20
    llm = LLM(model=tiny, kv_cache_mib=7 * page_mib, admission="optimistic", prefix_caching=False)
    rec = llm.engine.recorder = StepRecorder()
    prompts = [list(range(3, 3 + n)) for n in (20, 30, 12)]
    outs = llm.generate(prompts, [greedy(n) for n in (40, 40, 30)], use_tqdm=False)
    assert len(rec.steps) == llm.stats()["steps"]
    ids = sorted({rid for s in rec.steps for rid in s.phase})
    assert len(ids) == 3
    for s in rec.steps:
        # No prefix sharing: every page is held by one request, or free.
        assert sum(s.pages_held.values()) + s.pages_free == s.pages_total
        assert s.pages_cached == 0
        assert set(s.phase.values()) <= {WAITING, PREFILL, DECODE}
    assert rec.steps[0].phase[ids[0]] == PREFILL and rec.steps[-1].pages_free == 7
    # Every token but each request's last was computed at least once (recomputed
    # ones after a preemption count as prompt tokens again).
    computed = sum(s.prefill_tokens + s.decode_tokens for s in rec.steps)
    assert computed >= sum(len(p) + len(o.token_ids) - 1 for p, o in zip(prompts, outs))
    assert any(s.preempted for s in rec.steps)  # the pool is too small for all three
    assert set(rec.finished_at) == set(ids) and max(rec.finished_at.values()) == len(rec.steps)


def test_plot_writes_three_pictures(tmp_path, smollm2):
    plt = pytest.importorskip("matplotlib.pyplot")
    out = tmp_path / "run"
    argv = ["--kv-cache-mib", "6", "--admission", "optimistic", "--plot", str(out)]
    argv += ["Explain paging.", "24", "Explain GQA.", "16", "Hi", "8"]
    assert main(argv) == 0
    for name in FILES:
        path = out / name
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
        image = plt.imread(path)
        assert image.shape[0] > 200 and image.shape[1] > 600
        assert image[..., :3].std() > 0.05  # not a blank canvas
