"""Pictures of a run (`pagedllm --plot DIR`): the page pool, the scheduler's
timeline and the tokens of each step, from a `StepRecorder`.

    pagedllm --plot out/ "Explain paging." 64 "Explain GQA." 32 "Hi" 16

writes three PNGs in DIR:
- pages.png: the pool after each step, stacked: the pages each request
  holds (one colour per request), free pages that keep a prefix-cache name,
  and free pages;
- timeline.png: one row per request, coloured by phase in each step
  (waiting, prefill, decode), an x where it finished, a red v where it was
  preempted, and grey ticks at the steps where the head of the queue waited
  for pages;
- tokens.png: prompt (prefill) and decode tokens of each step, stacked.

matplotlib is optional (the `plot` extra); it is imported only here, and
`require_matplotlib` is called before the model loads.
Owns: the figures. Does not own: what they show (`engine/timeline.py`).
"""

from __future__ import annotations

from pathlib import Path

from pagedllm.bench.plot import require_matplotlib
from pagedllm.engine.timeline import DECODE, PREFILL, WAITING, StepRecorder

PHASE_COLOURS = {WAITING: "#d9d9d9", PREFILL: "#f28e2b", DECODE: "#4e79a7"}
FILES = ("pages.png", "timeline.png", "tokens.png")
LABELLED_REQUESTS = 24  # above this many requests, no per-request labels or legend


def plot_run(recorder: StepRecorder, directory: str | Path, title: str = "") -> list[Path]:
    """Write the three PNGs; return their paths."""
    plt = require_matplotlib()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    steps = recorder.steps
    if not steps:
        raise ValueError("nothing to draw: the run made no step")
    x = [s.step for s in steps]
    requests = sorted({rid for s in steps for rid in s.phase} | set(recorder.finished_at))
    paths = [out / name for name in FILES]

    # 1. The page pool.
    many = len(requests) > LABELLED_REQUESTS  # a benchmark's hundreds: no legend per request
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    try:
        layers = [[s.pages_held.get(rid, 0) for s in steps] for rid in requests]
        cached = [s.pages_cached for s in steps]
        free = [s.pages_free - s.pages_cached for s in steps]
        colours = plt.cm.tab20.colors
        ax.stackplot(
            x,
            *layers,
            cached,
            free,
            colors=[colours[i % len(colours)] for i in range(len(requests))]
            + ["#bab0ac", "#f2f2f2"],
            labels=([f"request {rid}" for rid in requests] if not many else [None] * len(requests))
            + ["cached (free)", "free"],
        )
        ax.set_xlabel("engine step")
        ax.set_ylabel("pages" + (" (one colour per request)" if many else ""))
        ax.set_ylim(0, steps[0].pages_total)
        ax.set_title(f"The page pool after each step. {title}".strip(), fontsize=9)
        ax.legend(loc="upper right", fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(paths[0])
    finally:
        plt.close(fig)

    # 2. The scheduler's timeline: one row per request, each phase drawn as runs of
    # consecutive steps (hundreds of requests over a thousand steps stay fast).
    runs: dict[int, dict[str, list[tuple[float, int]]]] = {rid: {} for rid in requests}
    for s in steps:
        for rid, ph in s.phase.items():
            spans = runs[rid].setdefault(ph, [])
            if spans and spans[-1][0] + spans[-1][1] == s.step - 0.5:
                spans[-1] = (spans[-1][0], spans[-1][1] + 1)  # extends the run
            else:
                spans.append((s.step - 0.5, 1))
    row = {rid: i for i, rid in enumerate(requests)}
    height = min(1.4 + 0.35 * len(requests), 10.0)
    fig, ax = plt.subplots(figsize=(8, height), dpi=110)
    try:
        for rid, phases in runs.items():
            for ph, spans in phases.items():
                colour = PHASE_COLOURS.get(ph)
                if colour is not None:
                    ax.broken_barh(spans, (row[rid] - 0.35, 0.7), facecolors=colour)
        marker = 3 if many else 7
        for s in steps:
            for rid in s.preempted:
                ax.plot(s.step, row[rid], "v", color="red", markersize=marker)
            if s.admission_wait:
                ax.axvline(s.step, color="grey", alpha=0.3, linewidth=1)
        if not many:
            for rid, step in recorder.finished_at.items():
                ax.plot(step + 0.5, row[rid], "x", color="black", markersize=6)
            ax.set_yticks(range(len(requests)), [f"request {rid}" for rid in requests], fontsize=7)
        else:
            ax.set_ylabel(f"{len(requests)} requests, in arrival order", fontsize=8)
        ax.set_ylim(len(requests) - 0.5, -0.5)  # the first request on top
        ax.set_xlabel("engine step")
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        handles = [Patch(color=colour, label=ph) for ph, colour in PHASE_COLOURS.items()]
        if not many:
            handles.append(
                Line2D([], [], marker="x", color="black", linestyle="", label="finished")
            )
        handles += [
            Line2D([], [], marker="v", color="red", linestyle="", label="preempted"),
            Line2D([], [], color="grey", alpha=0.3, label="head of queue waits for pages"),
        ]
        fig.legend(handles=handles, loc="lower center", fontsize=7, ncol=6, frameon=False)
        ax.set_title(f"The scheduler's timeline. {title}".strip(), fontsize=9)
        fig.tight_layout(rect=(0, 0.5 / fig.get_size_inches()[1], 1, 1))  # room for the legend
        fig.savefig(paths[1])
    finally:
        plt.close(fig)

    # 3. Tokens per step.
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=110)
    try:
        prefill = [s.prefill_tokens for s in steps]
        decode = [s.decode_tokens for s in steps]
        ax.bar(x, prefill, color=PHASE_COLOURS[PREFILL], label="prompt (prefill) tokens")
        ax.bar(x, decode, bottom=prefill, color=PHASE_COLOURS[DECODE], label="decode tokens")
        ax.set_xlabel("engine step")
        ax.set_ylabel("tokens computed")
        ax.set_title(f"Tokens per step. {title}".strip(), fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(paths[2])
    finally:
        plt.close(fig)
    return paths
