"""A picture of where a batch-1 CPU decode step's time goes: one stacked bar per run of
`profile_cpu_decode.py` (its JSON lines), llama.cpp's time per token beside them.

    for a in "--threads 1 --dtype float32" "--threads 1" "--threads 2 --dtype float32" "--threads 2"; do
        .venv/bin/python scripts/profile_cpu_decode.py $a | tail -1
    done > profiles.jsonl
    .venv/bin/python scripts/plot_cpu_decode.py profiles.jsonl --llamacpp 2=108.4 1=76.0 \\
        --out docs/tour/img/cpu_decode_step.png

`--llamacpp THREADS=TOK_S`: llama.cpp's decode tokens/s at that thread count,
drawn as a bar of 1000 / TOK_S ms. Needs matplotlib (`pip install matplotlib`,
the `plot` extra).
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", help="JSON lines of profile_cpu_decode.py")
    ap.add_argument("--llamacpp", nargs="*", default=[], metavar="THREADS=TOK_S")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(args.profiles) if line.strip().startswith("{")]
    labels, parts = [], {"projections": [], "other ops of the forward pass": [], "engine": []}
    for r in rows:
        labels.append(f"{r['weights']}\n{r['threads']} thread{'s' if r['threads'] > 1 else ''}")
        parts["projections"].append(r["projections_ms"])
        parts["other ops of the forward pass"].append(r["other_forward_ms"])
        parts["engine"].append(r["engine_outside_forward_ms"])
    peers = []
    for item in args.llamacpp:
        threads, _, tok_s = item.partition("=")
        peers.append(
            (f"llama.cpp\n{threads} thread{'s' if int(threads) > 1 else ''}", float(tok_s))
        )

    fig, ax = plt.subplots(figsize=(8, 4.2))
    xs = list(range(len(labels)))
    bottom = [0.0] * len(labels)
    for (name, values), color in zip(parts.items(), ("#4c72b0", "#dd8452", "#8c8c8c")):
        ax.bar(xs, values, bottom=bottom, color=color, label=name, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, total in zip(xs, bottom):
        ax.text(x, total + 0.5, f"{total:.1f} ms", ha="center", fontsize=9)
    for i, (label, tok_s) in enumerate(peers):
        x = len(rows) + i
        ms = 1000.0 / tok_s
        ax.bar(
            [x],
            [ms],
            color="#55a868",
            width=0.6,
            label="llama.cpp (whole token)" if i == 0 else None,
        )
        ax.text(x, ms + 0.5, f"{ms:.1f} ms", ha="center", fontsize=9)
        labels.append(label)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("ms per decode step (batch 1)")
    ax.set_title("SmolLM2-135M decode step on a 2-core AMD EPYC: float32 vs packed weights")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
