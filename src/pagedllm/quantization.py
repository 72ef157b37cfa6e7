"""A checkpoint's `quantization_config`: the FP8 formats we read, and how each module stores its weight.

Owns: reading and checking config.json's `quantization_config` into a
`QuantizationConfig`, which says for each module name how its weight is stored
(`scheme_for`: float8 e4m3 with which scales, or None: in the model's dtype),
and refusing every other format with one line that says what is supported.
Does not own: the tensors (`weights/fp8.py` checks each scale against its
scheme and dequantizes or fuses them) nor where FP8 weights run
(`model/loader.py`: as FP8 on CUDA, dequantized on the CPU).

The two formats of the Hub's FP8 checkpoints, read as vLLM and transformers read them:

- compressed-tensors (llm-compressor's; `quant_method` "compressed-tensors",
  `format` "float-quantized" or "naive-quantized"). `config_groups`, each with
  `targets` (module names, "re:" regexes matched from the start of the name, or
  a class name: "Linear" is every projection), `weights` (`num_bits` 8, `type`
  "float", `symmetric`, not `dynamic`, `strategy` "tensor", "channel" or "block"
  with `block_structure` [rows, cols]) and `input_activations` (null: weights
  only; `dynamic` true: quantized per token at run time; `dynamic` false with
  `strategy` "tensor": one static `input_scale` per module). `ignore`: modules
  left in the model's dtype (exact names or "re:" regexes; "lm_head" in every
  published checkpoint). Tensors: `weight` (F8_E4M3, (out, in)) and
  `weight_scale` (a float: () or (1,) per tensor, (out, 1) per channel,
  (ceil(out / rows), ceil(in / cols)) per block), and `input_scale` when static.
- "fp8" (transformers' FineGrainedFP8: DeepSeek-V3's and Qwen3's FP8 releases):
  `weight_block_size` [128, 128] and `activation_scheme` "dynamic"; tensors
  `weight` and `weight_scale_inv`, one float32 per block, which multiplies
  despite its name (transformers and vLLM compute W = weight * weight_scale_inv).
  Modules in `ignored_layers` (else `modules_to_not_convert`) are left alone,
  matched as transformers matches them: a name prefix ending at a dot, a regex
  with the same boundary, or a suffix. Without `weight_block_size` (AutoFP8's
  checkpoints, which vLLM reads; transformers would assume 128 x 128 blocks):
  one `weight_scale` per tensor, and an `input_scale` when `activation_scheme`
  is "static".

Whatever the format, W = weight.float() * scale, broadcast per tensor, row or
block. Activations: the GPU kernels quantize each token's row at run time in
every case (a static `input_scale` is checked, not used: one scale per token is
at least as close as one per tensor); the CPU does not quantize them.

Layer 0: stdlib only (`pagedllm inspect` reads it without torch).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NoReturn

QUANT_METHODS = ("compressed-tensors", "fp8")
STRATEGIES = ("tensor", "channel", "block")
ACTIVATIONS = ("dynamic", "static", "none")
# compressed-tensors formats that store FP8 values as float8 tensors, one per weight.
CT_FORMATS = ("float-quantized", "naive-quantized")
SUPPORTED = (
    "pagedllm reads FP8 checkpoints: compressed-tensors float-quantized (8-bit float "
    "weights, symmetric, one scale per tensor, channel or block; activations dynamic, "
    "static per tensor, or none) and quant_method 'fp8' (weight_block_size scales, "
    "activation_scheme dynamic; or AutoFP8's per-tensor scales)"
)
# transformers' module boundary for `modules_to_not_convert` (quantizers_utils.py).
_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


@dataclass(frozen=True)
class Fp8Scheme:
    """How the modules of one config group store their weights: float8 e4m3, scaled
    per `strategy` ("tensor", "channel" or "block" of `block_size` (rows, cols)),
    the scale under `<module>.<scale_name>`; `activations`: "dynamic", "static" (an
    `input_scale` per module) or "none" (weights only)."""

    strategy: str
    block_size: tuple[int, int] | None = None
    activations: str = "dynamic"
    scale_name: str = "weight_scale"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"FP8 strategy {self.strategy!r}: choose one of {STRATEGIES}")
        if (self.strategy == "block") != (self.block_size is not None):
            raise ValueError("an FP8 scheme has a block_size exactly when its strategy is 'block'")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"FP8 activations {self.activations!r}: choose one of {ACTIVATIONS}")

    def describe(self) -> str:
        if self.block_size is not None:
            scales = f"one scale per {self.block_size[0]}x{self.block_size[1]} block"
        else:
            scales = f"one scale per {'output channel' if self.strategy == 'channel' else 'tensor'}"
        acts = {
            "dynamic": "activations quantized per token at run time",
            "static": "a static input_scale per module (the GPU kernels scale per token instead)",
            "none": "activations not quantized (weights only)",
        }[self.activations]
        return f"float8 e4m3 weights, {scales} ({self.scale_name}); {acts}"


@dataclass(frozen=True)
class QuantizationConfig:
    """A checkpoint's FP8 format. `groups`: (targets, scheme) in the file's order (the
    first group whose targets match a module is its scheme); `ignore`: the modules
    left in the model's dtype, as the file lists them."""

    method: str  # one of QUANT_METHODS
    groups: tuple[tuple[tuple[str, ...], Fp8Scheme], ...]
    ignore: tuple[str, ...] = ()
    format: str | None = None  # compressed-tensors' `format`

    def ignores(self, module: str) -> bool:
        """Whether `module` (an HF module name: "lm_head", "model.layers.0.mlp.down_proj")
        is on the file's list of modules left unquantized."""
        if self.method == "compressed-tensors":
            return any(_ct_match(target, module) for target in self.ignore)
        return any(_transformers_skips(key, module) for key in self.ignore)

    def scheme_for(self, module: str, kind: str = "Linear") -> Fp8Scheme | None:
        """How `module` (of class `kind`: "Linear" for the projections and the LM head,
        "Embedding" for the embeddings) stores its weight; None: unquantized."""
        if self.ignores(module):
            return None
        for targets, scheme in self.groups:
            if any(_ct_match(t, module) or t.lower() in kind.lower() for t in targets):
                return scheme
        return None

    def describe(self) -> str:
        """One line: the method, each group's scheme, and what is ignored."""
        method = self.method + (f" ({self.format})" if self.format else "")
        schemes = "; ".join(
            (f"[{', '.join(targets)}] " if len(self.groups) > 1 else "") + scheme.describe()
            for targets, scheme in self.groups
        )
        ignored = f"; not quantized: {', '.join(self.ignore)}" if self.ignore else ""
        return f"{method}: {schemes}{ignored}"


def parse_quantization_config(qc: Any, source: str) -> QuantizationConfig | None:
    """config.json's `quantization_config` (None when absent), checked; anything we do
    not read is a one-line ValueError that names it and says what is supported."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        _fail(source, "quantization_config", qc, "an object")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source)
    if method == "fp8":
        return _fine_grained_fp8(qc, source)
    _refuse(source, f"quant_method {method!r}")


# ------------------------------------------------------------------ the formats
def _compressed_tensors(qc: dict[str, Any], source: str) -> QuantizationConfig:
    for key, what in (
        ("kv_cache_scheme", "kv_cache_scheme (K/V scales: --kv-cache-dtype fp8 runs without)"),
        ("sparsity_config", "sparsity_config (2:4 sparse weights)"),
        ("transform_config", "transform_config (rotated weights)"),
    ):
        if qc.get(key):
            _refuse(source, what)
    fmt = qc.get("format")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        _fail(source, "quantization_config.config_groups", groups, "an object of config groups")
    parsed = []
    for name, group in groups.items():
        key = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            _fail(source, key, group, "an object")
        group_format = group.get("format") or fmt
        if group_format not in CT_FORMATS:
            _refuse(source, f"{key}: format {group_format!r}")
        targets = group.get("targets")
        if (
            not isinstance(targets, list)
            or not targets
            or not all(isinstance(t, str) and t for t in targets)
        ):
            _fail(source, f"{key}.targets", targets, "a list of module names or patterns")
        for t in targets:
            _check_pattern(t, f"{key}.targets", source)
        if group.get("output_activations") is not None:
            _refuse(source, f"{key}: output_activations")
        scheme = _ct_scheme(group.get("weights"), group.get("input_activations"), key, source)
        parsed.append((tuple(targets), scheme))
    ignore = _names(qc.get("ignore"), "quantization_config.ignore", source)
    for t in ignore:
        _check_pattern(t, "quantization_config.ignore", source)
    return QuantizationConfig("compressed-tensors", tuple(parsed), ignore, fmt)


def _ct_scheme(weights: Any, acts: Any, key: str, source: str) -> Fp8Scheme:
    """One config group's `weights` and `input_activations`, as vLLM's
    CompressedTensorsW8A8Fp8 / W8A16Fp8 take them."""
    if not isinstance(weights, dict):
        _refuse(source, f"{key}: a group without 'weights'")
    wkey = f"{key}.weights"
    if weights.get("num_bits") != 8:
        _refuse(source, f"{wkey}.num_bits {weights.get('num_bits')!r}")
    if weights.get("type") != "float":
        _refuse(source, f"{wkey}.type {weights.get('type')!r}")
    if weights.get("symmetric") is not True:
        _refuse(source, f"{wkey}.symmetric {weights.get('symmetric')!r} (asymmetric weights)")
    if weights.get("dynamic", False) is not False:
        _refuse(source, f"{wkey}.dynamic {weights.get('dynamic')!r}")
    strategy = weights.get("strategy")
    if strategy not in STRATEGIES:
        _refuse(source, f"{wkey}.strategy {strategy!r}")
    if weights.get("actorder"):
        _refuse(source, f"{wkey}.actorder {weights.get('actorder')!r}")
    block = None
    if strategy == "block":
        block = _block_size(weights.get("block_structure"), f"{wkey}.block_structure", source)
    elif weights.get("group_size") is not None:
        _refuse(source, f"{wkey}.group_size {weights.get('group_size')!r}")
    if acts is None:
        activations = "none"
    else:
        akey = f"{key}.input_activations"
        if not isinstance(acts, dict):
            _fail(source, akey, acts, "an object or null")
        if acts.get("num_bits") != 8 or acts.get("type") != "float":
            _refuse(
                source,
                f"{akey}: {acts.get('num_bits')!r}-bit {acts.get('type')!r} activations",
            )
        if acts.get("symmetric") is not True:
            _refuse(source, f"{akey}.symmetric {acts.get('symmetric')!r}")
        dynamic = acts.get("dynamic", False)
        if dynamic is True:
            activations = "dynamic"
        elif dynamic is False and acts.get("strategy") == "tensor" and block is None:
            activations = "static"
        elif dynamic is False:
            _refuse(
                source,
                f"{akey}: static activations with strategy {acts.get('strategy')!r}"
                + (" and block weights" if block else ""),
            )
        else:
            _refuse(source, f"{akey}.dynamic {dynamic!r}")
    return Fp8Scheme(strategy, block, activations, "weight_scale")


def _fine_grained_fp8(qc: dict[str, Any], source: str) -> QuantizationConfig:
    if qc.get("fmt", "e4m3") != "e4m3":
        _refuse(source, f"fmt {qc.get('fmt')!r} (float8 e4m3 only)")
    if qc.get("scale_fmt") not in (None, "float"):
        _refuse(source, f"scale_fmt {qc.get('scale_fmt')!r} (float32 scales only)")
    if qc.get("modules_to_convert"):
        _refuse(source, "modules_to_convert (FP8 embeddings)")
    acts = qc.get("activation_scheme", "dynamic")
    if acts not in ("dynamic", "static"):
        _refuse(source, f"activation_scheme {acts!r}")
    block = qc.get("weight_block_size")
    if block is None:  # AutoFP8: one scale per tensor
        scheme = Fp8Scheme("tensor", None, acts, "weight_scale")
    else:
        size = _block_size(block, "quantization_config.weight_block_size", source)
        if acts == "static":
            _refuse(source, "activation_scheme 'static' with weight_block_size")
        scheme = Fp8Scheme("block", size, "dynamic", "weight_scale_inv")
    # vLLM reads ignored_layers, else modules_to_not_convert (transformers' name).
    key = "ignored_layers" if qc.get("ignored_layers") else "modules_to_not_convert"
    ignore = _names(qc.get(key), f"quantization_config.{key}", source)
    for name in ignore:
        try:
            re.compile(name)
        except re.error as e:
            _fail(source, f"quantization_config.{key}", name, f"a module name or regex ({e})")
    return QuantizationConfig("fp8", ((("Linear",), scheme),), ignore)


# ------------------------------------------------------------------ matching
def _ct_match(target: str, module: str) -> bool:
    """compressed-tensors' rule (vLLM's `_is_equal_or_regex_match`): equal, or a "re:"
    regex matching from the start of the name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def _transformers_skips(key: str, module: str) -> bool:
    """transformers' `should_convert_module`, negated: `key` names `module` from its
    start up to a dot (as a regex), or as a suffix."""
    try:
        if re.match(rf"(?:{key}){_BOUNDARY}", module):
            return True
    except re.error:  # checked at parse time; a literal then
        pass
    return module.endswith(key)


# ------------------------------------------------------------------ checks
def _refuse(source: str, what: str) -> NoReturn:
    raise ValueError(f"{source}: quantization_config: {what} is not supported; {SUPPORTED}")


def _fail(source: str, key: str, value: Any, expected: str) -> NoReturn:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise ValueError(f"{source}: {key} is {shown}, expected {expected}")


def _names(value: Any, key: str, source: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        _fail(source, key, value, "a list of module names")
    return tuple(value)


def _check_pattern(target: str, key: str, source: str) -> None:
    if target.startswith("re:"):
        try:
            re.compile(target[3:])
        except re.error as e:
            _fail(source, key, target, f"a valid 're:' regex ({e})")


def _block_size(value: Any, key: str, source: str) -> tuple[int, int]:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        _fail(source, key, value, "two positive integers such as [128, 128]")
    return (value[0], value[1])
