"""Fuzzing both model loaders against the reference readers of the same bytes.

Owns: the property that a damaged model file either loads as exactly the model
that the reference readers (the `safetensors` and `gguf` packages) see in the
same bytes, or fails with a `ValueError`: never another exception, a hang, or
an allocation out of proportion to the file.

Each case starts from a valid tiny Llama (an HF directory of config.json +
model.safetensors with F32/F16/BF16 tensors; a GGUF with F32/F16/BF16/Q8_0/
Q4_0/Q4_1 tensors, or a GGUF of K-quants that is no model) and mutates it:
bytes overwritten or flipped in the header, the metadata and the tensor table;
declared lengths, counts, types, shapes, offsets changed field by field;
JSON header edits (dtype, shape, offsets, names, padding); config.json and GGUF
metadata values replaced; the file truncated or extended. Then, for every case:

- our reader (`SafetensorsFile`, `GGUFFile`) and `load_model` give a ValueError
  or a result; any other exception fails the test;
- when our reader accepts a file, the reference reader must accept it too, and
  every tensor must be bitwise equal to the reference's (NaNs compare equal to
  NaNs: the payload bits of a NaN made from garbage bytes are the converter's
  choice, not the file's);
- when `load_model` accepts, every weight of the model equals the weight built
  from the reference reader's tensors and metadata;
- each case runs under a 30 s alarm and may raise the process's peak memory by
  at most 512 MiB (a declared 2**40-element tensor must be refused by the size
  checks, not allocated).

Where our readers are stricter than the reference (unsupported dtypes, the
packed GGUF layout llama.cpp requires, repeated JSON keys), ours refusing is
fine; the reverse is a bug. The default run is derandomized (`ci` profile,
tests/conftest.py); the `slow` copies search at random. Inputs a search found
failing are kept as explicit `@example`s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import signal
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")

from pagedllm.config import ModelConfig  # noqa: E402
from pagedllm.model import Linear, LlamaModel, build_model, load_model  # noqa: E402
from pagedllm.tokenizer import Tokenizer  # noqa: E402
from pagedllm.weights import GGUFFile, SafetensorsFile  # noqa: E402
from pagedllm.weights.gguf import IGNORED_TENSORS, hf_name, unpermute_qk  # noqa: E402
from tiny_models import make_tiny_llama  # noqa: E402

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
MAX_MODEL_LEN = 32  # bounds the RoPE table whatever context length a mutation declares
CASE_SECONDS = 30
CASE_MEMORY_KIB = 512 * 1024
DEFAULT_EXAMPLES = 600  # per format: 1,200 cases in the default run
TOKENIZER_EXAMPLES = 150  # tokenizer.json cases in the default run (~10 ms each)
SEARCH_EXAMPLES = 10_000  # per format, in the slow search

# Integers worth writing into a length, count, offset or dimension field.
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 9, 15, 16, 31, 32, 33, 63, 64, 127, 255, 256, 1000]
INTERESTING += [2**16, 2**24, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62]
INTERESTING += [2**63 - 1, 2**63, 2**64 - 1]
FLOAT_BITS = [0x7FC00000, 0x7F800000, 0xFF800000, 0x80000000, 0xBF800000, 0x00000001]


# ----- shared checks --------------------------------------------------------------------------


@contextmanager
def bounded_case() -> Iterator[None]:
    """A case may not hang (alarm) nor allocate out of proportion (peak RSS growth)."""

    def timeout(signum: int, frame: object) -> None:
        raise TimeoutError(f"case ran longer than {CASE_SECONDS} s")

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    old = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < CASE_MEMORY_KIB, f"peak memory grew by {grown // 1024} MiB in one case"


def accepts(fn: Callable[[], Any]) -> Any | None:
    """fn()'s result, or None when it raises ValueError; any other exception propagates."""
    try:
        return fn()
    except ValueError:
        return None


def assert_same_values(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Equal dtype, shape and bits; a NaN matches any NaN (see the module docstring)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, what
    if ours.numel() == 0:
        return
    if ours.is_floating_point():
        a, b = ours.float().reshape(-1), ref.float().reshape(-1)
        same = (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())
        assert bool(same.all()), what
    else:
        assert torch.equal(ours, ref), what


def model_tensors(model: LlamaModel) -> dict[str, torch.Tensor]:
    """Every weight by name, matrices in HF's (out, in) layout."""
    out = {"embed": model.embed_tokens, "norm": model.norm, "lm_head": model.lm_head.weight}
    for i, layer in enumerate(model.layers):
        for field in layer.__dataclass_fields__:
            w = getattr(layer, field)
            if w is not None:  # another family's weights (a Qwen2 bias, Gemma's norms)
                out[f"{i}.{field}"] = w.weight if isinstance(w, Linear) else w
    out["rope"] = model.cos_sin_cache
    return out


def assert_same_model(ours: LlamaModel, ref: LlamaModel) -> None:
    assert ours.config == ref.config
    a, b = model_tensors(ours), model_tensors(ref)
    assert a.keys() == b.keys()
    for name in a:
        assert_same_values(a[name], b[name], name)


def json_values() -> st.SearchStrategy[Any]:
    """Values a corrupted config.json could hold at any key."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(INTERESTING),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0.5, 64.0, -1.0, 1e-300]),
        st.text(max_size=6),
        st.sampled_from(["LlamaForCausalLM", "llama", "llama3", "no", "silu"]),
    )
    return st.one_of(
        scalars,
        st.lists(scalars, max_size=3),
        st.dictionaries(st.sampled_from(["rope_type", "factor", "type", "x"]), scalars, max_size=3),
    )


# ===== safetensors ============================================================================

ST_NAMES = [
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.2.mlp.up_proj.weight",
    "model.layers.01.mlp.up_proj.weight",
    "model.rotary_emb.inv_freq",
    "lm_head.weight",
    "model.embed_tokens.weight",
    "x",
    "",
]
CONFIG_KEYS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "max_position_embeddings",
    "architectures",
    "model_type",
    "bos_token_id",
    "eos_token_id",
]


@cache
def st_base() -> tuple[str, dict[str, Any], bytes]:
    """(config.json text, parsed JSON header, data bytes) of a valid tiny HF checkpoint."""
    model, cfg = make_tiny_llama(
        seed=5,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    state = {
        name: t.detach().to(dtypes[i % 3]).contiguous()
        for i, (name, t) in enumerate(sorted(model.state_dict().items()))
    }
    blob = safetensors_torch.save(state, metadata={"format": "pt"})
    n = int.from_bytes(blob[:8], "little")
    return json.dumps(cfg), json.loads(blob[8 : 8 + n]), blob[8 + n :]


def st_bytes(header: dict[str, Any], data: bytes, pad: int, hlen_delta: int) -> bytes:
    """A safetensors file from a header dict, as the writer lays it out (compact JSON,
    space-padded to 8), with the length field moved by `hlen_delta`."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8 + pad)
    n = max(0, min(len(raw) + hlen_delta, 2**64 - 1))
    return struct.pack("<Q", n) + raw + data


def edit_header(header: dict[str, Any], edit: tuple) -> None:
    names = [k for k in header if k != "__metadata__"]
    kind = edit[0]
    if kind == "meta":
        header["__metadata__"] = edit[1]
        return
    if not names:
        return
    name = names[edit[1] % len(names)]
    entry = header[name]
    if kind == "dtype":
        entry["dtype"] = edit[2]
    elif kind == "shape":
        entry["shape"] = edit[2]
    elif kind == "offsets":
        entry["data_offsets"] = [edit[2], edit[3]]
    elif kind == "shift":
        begin, end = entry["data_offsets"]
        entry["data_offsets"] = [begin + edit[2], end + edit[2]]
    elif kind == "swap":  # two tensors trade places: shapes no longer match their bytes
        other = header[names[edit[2] % len(names)]]
        entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
    elif kind == "drop":
        del header[name]
    elif kind == "rename":
        header[edit[2]] = header.pop(name)


def apply_bytes(blob: bytes, edits: list[tuple[str, int, int]], region: int) -> bytearray:
    """Byte edits inside blob[:region]: "set" a byte, "xor" one, or replace the pos-th
    ASCII digit with another digit (which keeps JSON valid and moves a number)."""
    out = bytearray(blob)
    region = min(region, len(out))
    for kind, pos, value in edits:
        if kind == "digit":
            digits = [i for i in range(region) if 48 <= out[i] <= 57]
            if digits:
                out[digits[pos % len(digits)]] = 48 + value % 10
        elif region:
            pos %= region
            out[pos] = value if kind == "set" else out[pos] ^ (value or 1)
    return out


def safetensors_case(
    json_edits: list[tuple],
    config_edits: list[tuple[str, Any]],
    byte_edits: list[tuple[str, int, int]],
    pad: int,
    hlen_delta: int,
    cut: int | None,
    tail: bytes,
) -> None:
    config_text, base_header, data = st_base()
    header = json.loads(json.dumps(base_header))
    for edit in json_edits:
        edit_header(header, edit)
    blob = st_bytes(header, data, pad, hlen_delta)
    blob = apply_bytes(blob, byte_edits, len(blob) - len(data))  # the length and the header
    if cut is not None:
        blob = blob[: cut % (len(blob) + 1)]
    blob = bytes(blob) + tail
    cfg = json.loads(config_text)
    for key, value in config_edits:
        cfg[key] = value
    with tempfile.TemporaryDirectory() as d, bounded_case():
        path = Path(d) / "model.safetensors"
        path.write_bytes(blob)
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        check_safetensors_reader(path, blob)
        check_safetensors_model(Path(d), blob)


def check_safetensors_reader(path: Path, blob: bytes) -> None:
    f = accepts(lambda: SafetensorsFile(path))
    if f is None:
        return
    with f:
        # We accepted: the reference must accept and see the very same tensors.
        ref = safetensors_torch.load(blob)
        with safetensors_torch.safe_open(str(path), framework="pt") as ref_file:
            ref_metadata = ref_file.metadata() or {}
        assert f.metadata == ref_metadata
        assert sorted(f.keys()) == sorted(ref)
        for name in f.keys():
            assert_same_values(f.get_tensor(name), ref[name], name)


def check_safetensors_model(directory: Path, blob: bytes) -> None:
    model = accepts(
        lambda: load_model(directory, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    )
    if model is None:
        return
    config = ModelConfig.from_hf_dir(directory)
    expected = build_model(
        config,
        safetensors_torch.load(blob),
        torch.device("cpu"),
        torch.float32,
        max_model_len=MAX_MODEL_LEN,
    )
    assert_same_model(model, expected)


json_ints = st.one_of(st.sampled_from(INTERESTING), st.integers(-3, 70_000), st.just(-0.0))
st_json_edits = st.lists(
    st.one_of(
        st.tuples(
            st.just("dtype"),
            st.integers(0, 99),
            st.sampled_from(["F32", "F16", "BF16", "I8", "F64", "U16", "BOOL", "f32", ""]),
        ),
        st.tuples(st.just("shape"), st.integers(0, 99), st.lists(json_ints, max_size=4)),
        st.tuples(st.just("offsets"), st.integers(0, 99), json_ints, json_ints),
        st.tuples(st.just("shift"), st.integers(0, 99), st.integers(-66, 66)),
        st.tuples(st.just("swap"), st.integers(0, 99), st.integers(0, 99)),
        st.tuples(st.just("drop"), st.integers(0, 99)),
        st.tuples(st.just("rename"), st.integers(0, 99), st.sampled_from(ST_NAMES)),
        st.tuples(
            st.just("meta"),
            st.one_of(st.none(), st.dictionaries(st.text(max_size=3), json_values(), max_size=2)),
        ),
    ),
    max_size=3,
)
st_config_edits = st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), json_values()), max_size=2)
st_byte_edits = st.lists(
    st.tuples(st.sampled_from(["set", "xor", "digit"]), st.integers(0, 10**6), st.integers(0, 255)),
    max_size=4,
)
st_hlen = st.one_of(st.integers(-9, 9), st.sampled_from([2**20, 2**40, 2**64 - 1, -(2**20)]))
st_cut = st.integers(0, 10**6)
st_tail = st.binary(min_size=1, max_size=9)


def cases(damage: dict[str, tuple[st.SearchStrategy, Any]]) -> st.SearchStrategy[dict]:
    """Cases with one kind of damage (half of them), or several at once: a case that piles
    on every kind is nearly always refused, and the comparisons with the reference need
    cases that still parse. `damage` maps each argument to (strategy, undamaged value)."""
    kinds = list(damage)

    def build(active: list[str]) -> st.SearchStrategy[dict]:
        return st.fixed_dictionaries(
            {k: damage[k][0] if k in active else st.just(damage[k][1]) for k in kinds}
        )

    one = st.sampled_from(kinds).map(lambda k: [k])
    several = st.lists(st.sampled_from(kinds), min_size=2, max_size=4, unique=True)
    return st.one_of(one, several).flatmap(build)


SAFETENSORS_CASES = cases(
    {
        "json_edits": (st_json_edits, []),
        "config_edits": (st_config_edits, []),
        "byte_edits": (st_byte_edits, []),
        "pad": (st.integers(1, 9), 0),
        "hlen_delta": (st_hlen, 0),
        "cut": (st_cut, None),
        "tail": (st_tail, b""),
    }
)
SAFE = dict(json_edits=[], config_edits=[], byte_edits=[], pad=0, hlen_delta=0, cut=None, tail=b"")


@settings(max_examples=DEFAULT_EXAMPLES)
@given(case=SAFETENSORS_CASES)
@example(case={**SAFE, "pad": 1, "hlen_delta": -1})  # the length one byte short (issue 10)
def test_fuzz_safetensors_loader(case: dict[str, Any]) -> None:
    safetensors_case(**case)


@pytest.mark.slow
@settings(settings.get_profile("search"), max_examples=SEARCH_EXAMPLES)
@given(case=SAFETENSORS_CASES)
def test_fuzz_safetensors_loader_search(case: dict[str, Any]) -> None:
    safetensors_case(**case)


# ===== GGUF ===================================================================================

GGUF_MODEL_TYPES = {  # GGUF name suffix -> ggml type written for it
    "token_embd.weight": Q.Q8_0,
    "output.weight": Q.Q4_1,
    "output_norm.weight": Q.F32,
    "attn_norm.weight": Q.F32,
    "ffn_norm.weight": Q.BF16,
    "attn_q.weight": Q.Q4_0,
    "attn_k.weight": Q.Q8_0,
    "attn_v.weight": Q.F16,
    "attn_output.weight": Q.BF16,
    "ffn_gate.weight": Q.Q4_1,
    "ffn_up.weight": Q.Q8_0,
    "ffn_down.weight": Q.F32,
}
GGUF_KV: dict[str, tuple[str, Any]] = {
    "llama.embedding_length": ("u32", 32),
    "llama.feed_forward_length": ("u32", 64),
    "llama.attention.head_count": ("u32", 4),
    "llama.attention.head_count_kv": ("u32", 2),
    "llama.block_count": ("u32", 2),
    "llama.context_length": ("u32", 128),
    "llama.rope.freq_base": ("f32", 10000.0),
    "llama.attention.layer_norm_rms_epsilon": ("f32", 1e-5),
    "tokenizer.ggml.model": ("str", "gpt2"),
    "tokenizer.ggml.pre": ("str", "gpt2"),
    "tokenizer.ggml.tokens": ("arr_str", [f"t{i}" for i in range(60)] + ["t", "0", "1", "<s>"]),
    "tokenizer.ggml.token_type": ("arr_i32", [1] * 63 + [3]),
    "tokenizer.ggml.merges": ("arr_str", ["t 0", "t 1"]),
    "tokenizer.ggml.bos_token_id": ("u32", 63),
    "tokenizer.ggml.add_bos_token": ("bool", True),
}


def encode(qtype: Any, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A random weight of torch `shape` in `qtype`, as GGUFWriter.add_tensor takes it:
    float arrays for F32/F16, else bytes of shape (*shape[:-1], bytes per row)."""
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # gguf-py cannot quantize these: random blocks
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(math.prod(shape) // block, size), dtype=np.uint8)
        for off in {Q.Q6_K: (208,)}.get(qtype, (0, 2)):  # small finite f16 scales
            scales = rng.uniform(-0.05, 0.05, blocks.shape[0]).astype(np.float16)
            blocks[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(*shape[:-1], -1)
    w = rng.standard_normal(shape).astype(np.float32)
    return gguf.quants.quantize(w, qtype)


@cache
def gguf_tensors(base: str) -> dict[str, tuple[Any, np.ndarray]]:
    """name -> (type, encoded data) of a base file, in table order."""
    rng = np.random.default_rng(7)
    if base == "zoo":  # no model: one tensor of each K-quant, and more float types
        specs = {"k4": (Q.Q4_K, (2, 256)), "k5": (Q.Q5_K, (512,)), "k6": (Q.Q6_K, (2, 256))}
        specs |= {"h": (Q.F16, (3, 5)), "b": (Q.BF16, (7,)), "s": (Q.F32, (1,))}
        return {n: (q, encode(q, shape, rng)) for n, (q, shape) in specs.items()}
    hidden, inter, vocab, d = 32, 64, 64, 8
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "output.weight": (vocab, hidden),
    }
    for i in range(2):
        for part, shape in [
            ("attn_norm.weight", (hidden,)),
            ("ffn_norm.weight", (hidden,)),
            ("attn_q.weight", (4 * d, hidden)),
            ("attn_k.weight", (2 * d, hidden)),
            ("attn_v.weight", (2 * d, hidden)),
            ("attn_output.weight", (hidden, 4 * d)),
            ("ffn_gate.weight", (inter, hidden)),
            ("ffn_up.weight", (inter, hidden)),
            ("ffn_down.weight", (hidden, inter)),
        ]:
            shapes[f"blk.{i}.{part}"] = shape
    out = {}
    for name, shape in shapes.items():
        qtype = GGUF_MODEL_TYPES[name.split(".", 2)[-1] if name.startswith("blk") else name]
        out[name] = (qtype, encode(qtype, shape, rng))
    return out


def add_kv(w: Any, key: str, kind: str, value: Any) -> None:
    if kind == "u32":
        w.add_uint32(key, value % 2**32)
    elif kind == "i32":
        w.add_int32(key, (value + 2**31) % 2**32 - 2**31)
    elif kind == "u64":
        w.add_uint64(key, value % 2**64)
    elif kind == "f32":
        w.add_float32(key, value)
    elif kind == "str":
        w.add_string(key, value)
    elif kind == "bool":
        w.add_bool(key, value)
    elif kind == "arr_str":
        w.add_key_value(key, list(value), V.ARRAY, sub_type=V.STRING)
    elif kind == "arr_i32":
        w.add_key_value(key, list(value), V.ARRAY, sub_type=V.INT32)
    elif kind == "arr_u32":
        w.add_key_value(key, list(value), V.ARRAY, sub_type=V.UINT32)


@lru_cache(maxsize=64)
def gguf_file(base: str, kv_edits: tuple, tensor_edits: tuple) -> bytes:
    """A GGUF written by gguf.GGUFWriter: the base, with metadata and tensor-list edits."""
    kv = dict(GGUF_KV) if base == "model" else {"llama.attention.head_count": ("u32", 2)}
    for key, kind, value in kv_edits:
        if kind == "drop":
            kv.pop(key, None)
        else:
            kv[key] = (kind, value)
    tensors = dict(gguf_tensors(base))
    names = list(tensors)
    for kind, index, new_name in tensor_edits:
        name = names[index % len(names)]
        if name not in tensors:
            continue
        if kind == "drop":
            del tensors[name]
        elif kind == "rename" and new_name not in tensors:
            tensors[new_name] = tensors.pop(name)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "w.gguf"
        w = gguf.GGUFWriter(str(path), arch="llama")
        for key, (kind, value) in kv.items():
            add_kv(w, key, kind, value)
        for name, (qtype, data) in tensors.items():
            if qtype in (Q.F32, Q.F16):
                w.add_tensor(name, data)  # the writer takes the type from the dtype
            else:
                w.add_tensor(name, data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


@lru_cache(maxsize=64)
def gguf_fields(blob: bytes) -> tuple[list[tuple[int, int, str]], int]:
    """Every fixed-size field of a valid file's header as (offset, size, category), and
    where its data begins: found through gguf-py's reader, independent of ours."""
    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(blob)
        f.flush()
        try:
            reader = gguf.GGUFReader(f.name)
        except Exception:  # metadata edits made it unreadable (alignment 0): no fields
            return [], len(blob)
        start = np.lib.array_utils.byte_bounds(reader.data)[0]
        fields = []

        def add(parts: list[np.ndarray], category: str) -> None:
            for part in parts:  # strings' bytes are uint8; every other part is fields
                if part.dtype.itemsize in (4, 8) and part.dtype != np.uint8:
                    offset = np.lib.array_utils.byte_bounds(part)[0] - start
                    for k in range(min(part.size, 4)):  # a few elements of an array
                        size = part.dtype.itemsize
                        fields.append((offset + k * size, size, category))

        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                add(field.parts, "counts")
            elif name == "tokenizer.ggml.tokens":
                add(field.parts[:5], "kv")  # the key, the types, the count, a few lengths
            else:
                add(field.parts, "kv")
        for tensor in reader.tensors:
            add(tensor.field.parts, "tensor")
        return fields, reader.data_offset


def gguf_case(
    base: str,
    kv_edits: list[tuple[str, str, Any]],
    tensor_edits: list[tuple[str, int, str]],
    field_edits: list[tuple[str, int, str, int]],
    byte_edits: list[tuple[str, int, int]],
    cut: int | None,
    tail: bytes,
) -> None:
    blob = gguf_file(base, tuple(kv_edits), tuple(tensor_edits))
    fields, data_offset = gguf_fields(blob)
    out = bytearray(blob)
    for category, index, kind, value in field_edits:
        chosen = [f for f in fields if f[2] == category] or fields
        if not chosen:
            break
        offset, size, _ = chosen[index % len(chosen)]
        if kind == "add":  # the old value nudged (a length one short, an offset moved)
            value += int.from_bytes(out[offset : offset + size], "little")
        elif kind == "float":  # a float32 special value (NaN, inf, -0.0, -1.0, ...)
            value = FLOAT_BITS[value % len(FLOAT_BITS)]
        out[offset : offset + size] = (value % 2 ** (8 * size)).to_bytes(size, "little")
    out = apply_bytes(bytes(out), byte_edits, data_offset)
    if cut is not None:
        out = out[: cut % (len(out) + 1)]
    blob = bytes(out) + tail
    with tempfile.TemporaryDirectory() as d, bounded_case():
        path = Path(d) / "m.gguf"
        path.write_bytes(blob)
        check_gguf_reader(path)
        check_gguf_model(path)
        accepts(lambda: Tokenizer.from_gguf(path))  # a tokenizer, or a ValueError


def same_metadata(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) and isinstance(theirs, float):
        return ours == theirs or (math.isnan(ours) and math.isnan(theirs))
    return ours == theirs


def flatten(value: Any) -> Any:
    """gguf-py flattens arrays of arrays; so do we, to compare."""
    if isinstance(value, list) and any(isinstance(v, list) for v in value):
        return [x for v in value for x in (flatten(v) if isinstance(v, list) else [v])]
    return value


def reference_tensor(tensor: Any) -> torch.Tensor:
    """gguf-py's reading of one tensor: dequantized float32, torch shape."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(reversed([int(d) for d in tensor.shape]))
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)


def check_gguf_reader(path: Path) -> None:
    g = accepts(lambda: GGUFFile(path))
    if g is None:
        return
    with g:
        reader = gguf.GGUFReader(str(path))  # we accepted: the reference must too
        fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        assert set(g.metadata) == set(fields)
        for key, field in fields.items():
            theirs = field.contents()
            ours = flatten(g.metadata[key])
            if isinstance(ours, list):
                assert len(ours) == len(theirs), key
                assert all(same_metadata(a, b) for a, b in zip(ours, theirs)), key
            else:
                assert same_metadata(ours, theirs), key
        assert g.tensor_names == [t.name for t in reader.tensors]
        for t in reader.tensors:
            info = g.tensor_info(t.name)
            assert (info.offset, info.nbytes, info.type_name) == (
                t.data_offset,
                t.n_bytes,
                t.tensor_type.name,
            )
            assert info.shape == tuple(reversed([int(d) for d in t.shape]))
            if info.supported:
                assert_same_values(g.load_tensor(t.name), reference_tensor(t), t.name)


def check_gguf_model(path: Path) -> None:
    model = accepts(
        lambda: load_model(path, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    )
    if model is None:
        return
    # The same model from gguf-py's reading: its metadata, its dequantized tensors.
    reader = gguf.GGUFReader(str(path))
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    state = {}
    for t in reader.tensors:
        if t.name in IGNORED_TENSORS:
            continue
        w = reference_tensor(t)
        heads = metadata["llama.attention.head_count"]
        if t.name.endswith(".attn_q.weight"):
            w = unpermute_qk(w, heads)
        elif t.name.endswith(".attn_k.weight"):
            w = unpermute_qk(w, metadata.get("llama.attention.head_count_kv", heads))
        state[hf_name(t.name)] = w
    config = ModelConfig.from_gguf_metadata(metadata, source=str(path))
    config = dataclasses.replace(config, tie_word_embeddings="lm_head.weight" not in state)
    expected = build_model(
        config, state, torch.device("cpu"), torch.float32, max_model_len=MAX_MODEL_LEN
    )
    assert_same_model(model, expected)


GGUF_KEYS = [*GGUF_KV, "llama.vocab_size", "general.alignment", "llama.rope.scaling.type"]
GGUF_KEYS += ["llama.attention.key_length", "llama.rope.scaling.factor"]
gguf_kv_values = st.one_of(
    st.tuples(st.just("u32"), st.sampled_from(INTERESTING)),
    st.tuples(st.just("i32"), st.integers(-(2**31), 2**31 - 1)),
    st.tuples(st.just("u64"), st.sampled_from(INTERESTING)),
    st.tuples(
        st.just("f32"),
        st.one_of(st.floats(width=32), st.sampled_from([0.0, -1.0, 1e-5, 1e4, 8.0])),
    ),
    st.tuples(st.just("str"), st.sampled_from(["llama", "gpt2", "llama3", "qwen2", "", "é"])),
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(
        st.just("arr_u32"),
        st.lists(st.sampled_from(INTERESTING[:20]), min_size=1, max_size=3).map(tuple),
    ),
    st.tuples(
        st.just("arr_i32"), st.lists(st.integers(-2, 70), min_size=1, max_size=70).map(tuple)
    ),
    st.tuples(
        st.just("arr_str"),
        st.lists(st.sampled_from(["t", "t0", "a b", ""]), min_size=1, max_size=3).map(tuple),
    ),
    st.tuples(st.just("drop"), st.none()),
)
st_field = st.sampled_from(["counts", "kv", "tensor", "tensor"])  # which field table
st_kv_edits = st.lists(
    st.builds(lambda k, kv: (k, *kv), st.sampled_from(GGUF_KEYS), gguf_kv_values), max_size=2
)
st_tensor_edits = st.lists(
    st.tuples(
        st.sampled_from(["drop", "rename"]),
        st.integers(0, 99),
        st.sampled_from(["blk.2.attn_q.weight", "blk.01.ffn_up.weight", "x", "rope_freqs.weight"]),
    ),
    max_size=2,
)
st_field_edits = st.lists(
    st.one_of(
        st.tuples(st_field, st.integers(0, 10**4), st.just("set"), st.sampled_from(INTERESTING)),
        st.tuples(st_field, st.integers(0, 10**4), st.just("add"), st.integers(-40, 40)),
        st.tuples(st_field, st.integers(0, 10**4), st.just("float"), st.integers(0, 5)),
    ),
    max_size=3,
)
GGUF_CASES = cases(
    {
        "base": (st.just("zoo"), "model"),
        "kv_edits": (st_kv_edits, []),
        "tensor_edits": (st_tensor_edits, []),
        "field_edits": (st_field_edits, []),
        "byte_edits": (st_byte_edits, []),
        "cut": (st_cut, None),
        "tail": (st_tail, b""),
    }
)
GOOD = dict(
    base="model", kv_edits=[], tensor_edits=[], field_edits=[], byte_edits=[], cut=None, tail=b""
)


@settings(max_examples=DEFAULT_EXAMPLES)
@given(case=GGUF_CASES)
# a tensor's type changed in the table (issue 10): token_embd's Q8_0 bytes read as Q4_0
@example(case={**GOOD, "field_edits": [("tensor", 4, "set", int(Q.Q4_0))]})
@example(case={**GOOD, "kv_edits": [("llama.block_count", "u32", 1)]})  # a layer left over
def test_fuzz_gguf_loader(case: dict[str, Any]) -> None:
    gguf_case(**case)


@pytest.mark.slow
@settings(settings.get_profile("search"), max_examples=SEARCH_EXAMPLES)
@given(case=GGUF_CASES)
def test_fuzz_gguf_loader_search(case: dict[str, Any]) -> None:
    gguf_case(**case)


# ===== tokenizer.json =========================================================================
# Issue 33 item 9: a damaged tokenizer.json gave a TypeError, a KeyError, a regex error,
# or (an id of 10**9) a 16 GB table. Any value at any place of a valid file, or a key
# removed: a ValueError naming the file, or a tokenizer that encodes and decodes.


@cache
def tokenizer_base() -> str:
    """A valid tokenizer directory as JSON: file name -> that file's document."""
    from pagedllm.tokenizer.bytelevel import BYTE_TO_CHAR

    vocab = {c: i for i, c in enumerate(BYTE_TO_CHAR)}
    vocab.update({"ab": 256, "Ġa": 257})
    tokenizer = {
        "added_tokens": [
            {"id": 258, "content": "<s>", "special": True},
            {"id": 259, "content": "<x>", "special": False, "lstrip": True},
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "\\d"}, "behavior": "Isolated"},
                {"type": "Digits", "individual_digits": True},
                {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
            ],
        },
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>"}}, {"Sequence": {"id": "A"}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [258]}},
        },
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": vocab, "merges": ["a b", ["Ġ", "a"]]},
    }
    config = {
        "bos_token": {"content": "<s>"},
        "eos_token": "<x>",
        "add_bos_token": True,
        "chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}"}],
    }
    return json.dumps(
        {
            "tokenizer.json": tokenizer,
            "tokenizer_config.json": config,
            "generation_config.json": {"eos_token_id": [258, 259]},
        }
    )


def json_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON document (the model's vocabulary by a few keys only)."""
    out = [prefix]
    if isinstance(node, dict):
        keys = list(node)
        if prefix[1:] == ("model", "vocab"):
            keys = ["a", "b", "ab", "Ġa"]
        for k in keys:
            out += json_paths(node[k], (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += json_paths(v, (*prefix, i))
    return out


TOKENIZER_PATHS = json_paths(json.loads(tokenizer_base()))[1:]  # not the directory itself
st_tokenizer_edits = st.lists(
    st.tuples(
        st.sampled_from(TOKENIZER_PATHS),
        st.one_of(st.just(DROP_KEY := object()), json_values(), st.sampled_from(INTERESTING)),
    ),
    min_size=1,
    max_size=3,
)


def tokenizer_case(edits: list[tuple[tuple, Any]]) -> None:
    files: dict[str, Any] = json.loads(tokenizer_base())
    for path, value in edits:
        node = files
        try:
            for key in path[:-1]:
                node = node[key]
            if value is DROP_KEY:
                del node[path[-1]]
            else:
                node[path[-1]] = value
        except (KeyError, IndexError, TypeError):  # an earlier edit removed the place
            pass
    with tempfile.TemporaryDirectory() as d, bounded_case():
        for name, doc in files.items():
            (Path(d) / name).write_text(json.dumps(doc))
        try:
            tok = Tokenizer.from_model_path(d)
        except (ValueError, FileNotFoundError) as e:  # FileNotFoundError: tokenizer.json dropped
            message = str(e)
            assert message.startswith(d) and "\n" not in message, message
            return
        for text in ("ab 1 a<s><x>", "", "Ġ\x00é"):
            ids = tok.encode(text, add_special_tokens=True)
            assert isinstance(tok.decode(ids), str)
        if tok.chat_template is not None:
            try:
                tok.encode_chat([{"role": "user", "content": "a<s>"}])
            except ValueError:  # a template that fails to render says so
                pass


@settings(max_examples=TOKENIZER_EXAMPLES)
@given(edits=st_tokenizer_edits)
@example(edits=[(("tokenizer.json", "model", "merges"), [123, None])])  # issue 33 item 9
@example(edits=[(("tokenizer.json", "added_tokens", 0, "id"), 10**9)])
@example(edits=[(("tokenizer.json",), [1, 2])])
def test_fuzz_tokenizer_json_loader(edits: list[tuple[tuple, Any]]) -> None:
    tokenizer_case(edits)


@pytest.mark.slow
@settings(settings.get_profile("search"), max_examples=SEARCH_EXAMPLES)
@given(edits=st_tokenizer_edits)
def test_fuzz_tokenizer_json_loader_search(edits: list[tuple[tuple, Any]]) -> None:
    tokenizer_case(edits)


# ----- the base files are what they claim ----------------------------------------------------


def test_base_files_load_and_match_the_references() -> None:
    """Unmutated, both bases load as models equal to the references' (else the fuzz
    above would only ever see ValueErrors)."""
    config_text, header, data = st_base()
    with tempfile.TemporaryDirectory() as d:
        blob = st_bytes(header, data, 0, 0)
        (Path(d) / "model.safetensors").write_bytes(blob)
        (Path(d) / "config.json").write_text(config_text)
        check_safetensors_reader(Path(d) / "model.safetensors", blob)
        assert load_model(Path(d), device="cpu", max_model_len=MAX_MODEL_LEN) is not None
        check_safetensors_model(Path(d), blob)
    blob = gguf_file("model", (), ())
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.gguf"
        path.write_bytes(blob)
        check_gguf_reader(path)
        assert load_model(path, device="cpu", max_model_len=MAX_MODEL_LEN) is not None
        check_gguf_model(path)
        assert Tokenizer.from_gguf(path).encode("t") == [60]
