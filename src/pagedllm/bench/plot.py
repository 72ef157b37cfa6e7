"""`pagedllm bench pages --plot PATH.png`: pages in use over the steps of a run.

Owns: the figure (one line per admission policy, the pool size as a dashed
line). Does not own: the figures it draws (`ours.trace_pages` records them).

matplotlib is optional (`pip install matplotlib`, or in a clone the `plot`
extra: `pip install -e '.[plot]'`); it is imported only here, only for --plot.
"""

from __future__ import annotations

import sys
import textwrap
from typing import Any

# The interpreter that runs pagedllm is the one to install into (a venv's, say).
INSTALL_HINT = (
    f"--plot needs matplotlib, which is not installed: {sys.executable} -m pip install "
    "matplotlib (in a clone of pagedllm: pip install -e '.[plot]')"
)


def require_matplotlib() -> Any:
    """matplotlib.pyplot on the file-only backend, or ValueError saying how to install it.

    Called before the model loads, so a missing package costs no run.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: write files only
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return plt


def plot_pages_in_use(
    path: str,
    traces: dict[str, list[int]],
    *,
    block_size: int,
    pages_total: int,
    page_mib: float,
    title: str,
) -> None:
    """Write a PNG: x the step of the run, y the pages in use after it, one line per trace."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    try:
        for label, used in traces.items():
            ax.plot(range(1, len(used) + 1), used, label=f"{label} ({len(used)} steps)")
        ax.axhline(pages_total, color="grey", linestyle="--", linewidth=1, label="page pool")
        ax.set_xlabel("engine step")
        ax.set_ylabel(f"pages in use ({block_size} tokens, {page_mib:.3g} MiB each)")
        ax.set_ylim(0, pages_total * 1.08)
        ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=8)
        ax.legend(loc="best", title="admission", fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
