"""Model shape presets (config.json files only, never weights) for benchmarks.

`llama-3.2-1b` is Meta's published Llama-3.2-1B-Instruct configuration; with
`--load-format dummy` it gets random weights of exactly that shape.
"""

from __future__ import annotations

from pathlib import Path

PRESETS_DIR = Path(__file__).parent


def preset_dir(name: str) -> Path:
    path = PRESETS_DIR / name
    if not (path / "config.json").is_file():
        known = sorted(p.name for p in PRESETS_DIR.iterdir() if (p / "config.json").is_file())
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(known)}")
    return path
