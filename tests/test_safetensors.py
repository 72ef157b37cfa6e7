"""Our safetensors reader against the `safetensors` package, and against corrupt files.

Owns: the tests of `pagedllm.weights.safetensors`. The `safetensors` package
writes every fixture and is the oracle for the tensors we read back; corrupt
files are built by hand (byte flips, truncations, hand-written headers) and
must give `ValueError` or a valid parse, never another exception.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load, load_file, save_file

from pagedllm.weights import SafetensorsFile, load_safetensors_dir
from pagedllm.weights.safetensors import MAX_HEADER_BYTES, load_hf_state_dict

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def random_checkpoint(seed: int, n: int = 12) -> dict[str, torch.Tensor]:
    """Tensors of every supported dtype, including scalars and 0-size tensors."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(), (0,), (3, 0), (1,), (7,), (4, 5), (2, 3, 4), (1, 1, 1, 9), (16, 33)]
    out = {}
    for i in range(n):
        shape = shapes[i % len(shapes)]
        dtype = DTYPES[i % len(DTYPES)]
        out[f"model.layers.{i}.w"] = torch.randn(shape, generator=g).to(dtype)
    return out


def assert_bitwise_equal(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(ref)
    for name, r in ref.items():
        o = ours[name]
        assert o.dtype == r.dtype and o.shape == r.shape, name
        # Compare bit patterns, so a NaN or -0.0 would count too.
        assert torch.equal(o.reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8)), name


# ----- agreement with the safetensors package ---------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_single_file_matches_safetensors_package(tmp_path: Path, seed: int) -> None:
    tensors = random_checkpoint(seed)
    path = tmp_path / "model.safetensors"
    metadata = {"format": "pt", "note": "héllo"}
    save_file(tensors, str(path), metadata=metadata)
    ref = load_file(str(path))

    with SafetensorsFile(path) as f:
        assert f.metadata == metadata
        assert sorted(f.keys()) == sorted(ref)
        for name, r in ref.items():
            assert f.shape(name) == tuple(r.shape)
            assert f.dtype(name) == r.dtype
        assert_bitwise_equal({k: f.get_tensor(k) for k in f.keys()}, ref)

    # A file path, the directory holding model.safetensors, and the alias all agree.
    assert_bitwise_equal(load_safetensors_dir(path), ref)
    assert_bitwise_equal(load_safetensors_dir(tmp_path), ref)
    assert_bitwise_equal(load_hf_state_dict(tmp_path), ref)


def test_sharded_checkpoint_matches_safetensors_package(tmp_path: Path) -> None:
    tensors = random_checkpoint(3, n=20)
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:9],
        "model-00002-of-00002.safetensors": names[9:],
    }
    weight_map = {}
    ref: dict[str, torch.Tensor] = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / shard))
        ref.update(load_file(str(tmp_path / shard)))
        weight_map.update({n: shard for n in shard_names})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))

    assert_bitwise_equal(load_safetensors_dir(tmp_path), ref)


def test_dtype_conversion_is_one_copy_off_the_file(tmp_path: Path) -> None:
    tensors = random_checkpoint(4)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    loaded = load_safetensors_dir(path, dtype=torch.float32)
    for name, t in tensors.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], t.float())


def test_get_tensor_is_a_zero_copy_view_that_survives_close(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    w = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    save_file({"w": w}, str(path))
    f = SafetensorsFile(path)
    a, b = f.get_tensor("w"), f.get_tensor("w")
    assert a.data_ptr() == b.data_ptr()  # both view the same mapped bytes
    f.close()  # the views keep the mapping alive
    assert torch.equal(a, w)
    a[0, 0] = -1.0  # copy-on-write: the file on disk is untouched
    assert torch.equal(load_file(str(path))["w"], w)


# ----- named defects ----------------------------------------------------------------------------


def write_raw(path: Path, header: object, data: bytes = b"", header_len: int | None = None) -> Path:
    """A safetensors file from a hand-written header (any JSON value) and data bytes."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def entry(dtype: str = "F32", shape: list = (2,), offsets: list = (0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


BAD_HEADERS = [
    ("not json", b"{not json", "not valid JSON"),
    ("json list", [1, 2], "expected an object"),
    ("nested deep", b"[" * 100_000, "nested too deeply"),
    ("entry not object", {"w": 3}, "expected an object"),
    ("missing dtype", {"w": {"shape": [2], "data_offsets": [0, 8]}}, "missing 'dtype'"),
    ("int8", {"w": entry(dtype="I8", offsets=[0, 2])}, "unsupported dtype 'I8'"),
    ("f64", {"w": entry(dtype="F64", offsets=[0, 16])}, "unsupported dtype 'F64'"),
    ("fp8 e5m2", {"w": entry(dtype="F8_E5M2", offsets=[0, 2])}, "unsupported dtype 'F8_E5M2'"),
    ("made-up dtype", {"w": entry(dtype="Q4")}, "unknown dtype 'Q4'"),
    ("negative dim", {"w": entry(shape=[-2])}, "non-negative ints"),
    ("float dim", {"w": entry(shape=[2.0])}, "non-negative ints"),
    ("bool dim", {"w": entry(shape=[True, 2])}, "non-negative ints"),
    ("shape not list", {"w": entry(shape="2")}, "non-negative ints"),
    ("one offset", {"w": entry(offsets=[0])}, "pair of ints"),
    ("past data end", {"w": entry(offsets=[8, 16])}, "outside the data area"),
    ("begin > end", {"w": entry(offsets=[8, 0])}, "outside the data area"),
    ("span != numel", {"w": entry(shape=[3])}, "needs 12"),
    ("overlap", {"a": entry(), "b": entry(shape=[1], offsets=[4, 8])}, "overlap"),
    ("metadata not str", {"__metadata__": {"k": 1}, "w": entry()}, "__metadata__"),
    (
        "duplicate key",
        b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "w": {}}',
        "duplicate",
    ),
    ("bad utf-8", b'{"\xff": 1}', "not valid JSON"),
    # what the reference (the safetensors package) refuses and Python's json accepts
    ("NaN", b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}', "NaN"),
    (
        "minus zero",
        b'{"w": {"dtype": "F32", "shape": [-0, 2], "data_offsets": [0, 0]}}',
        "non-negative ints",
    ),
    (
        "lone surrogate",
        b'{"\\ud800": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
        "surrogate",
    ),
    ("extra entry key", {"w": {**entry(), "x": 1}}, "unexpected keys ['x']"),
    ("dims overflow u64", {"w": entry(shape=[2**40, 2**40, 0], offsets=[0, 0])}, "64 bits"),
    # the tensors must tile the data area (8 bytes here) exactly
    ("gap at start", {"w": entry(shape=[1], offsets=[4, 8])}, "gap of 4 bytes"),
    (
        "gap between",
        {"a": entry(shape=[1], offsets=[0, 4])},
        "cover 4 bytes but the data area holds 8",
    ),
    ("empty elsewhere", {"a": entry(), "z": entry(shape=[0], offsets=[4, 4])}, "overlap"),
]


@pytest.mark.parametrize(
    ("header", "defect"), [(h, d) for _, h, d in BAD_HEADERS], ids=[i for i, _, _ in BAD_HEADERS]
)
def test_malformed_header_is_refused_by_name(tmp_path: Path, header: object, defect: str) -> None:
    path = write_raw(tmp_path / "bad.safetensors", header, data=bytes(8))
    with pytest.raises(ValueError, match="bad.safetensors") as e:
        SafetensorsFile(path)
    assert defect in str(e.value)


@pytest.mark.parametrize(
    ("blob", "defect"),
    [
        (b"", "too short"),
        (b"\x10\x00\x00", "too short"),
        (struct.pack("<Q", 1000) + b"{}", "past the end"),
        (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "exceeds the limit"),
        (struct.pack("<Q", 2**64 - 1) + b"{}", "exceeds the limit"),
    ],
)
def test_bad_header_length_is_refused(tmp_path: Path, blob: bytes, defect: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(ValueError, match=defect):
        SafetensorsFile(path)


def test_header_length_one_byte_short_is_refused(tmp_path: Path) -> None:
    """The writer pads the JSON with spaces; one byte less still parses, and every tensor
    would then be read one byte off. The safetensors package refuses it; so do we."""
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(6, dtype=torch.float32)}, str(path))
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    assert blob[8 + n - 1 : 8 + n] == b" "  # padding that the JSON parser skips
    short = struct.pack("<Q", n - 1) + blob[8:]
    with pytest.raises(Exception, match="not fully covered"):
        load(short)  # the reference reader
    path.write_bytes(short)
    with pytest.raises(
        ValueError, match="model.safetensors.*cover 24 bytes but the data area holds 25"
    ):
        SafetensorsFile(path)


def test_trailing_bytes_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(2)}, str(path))
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(ValueError, match="cover 8 bytes but the data area holds 9"):
        SafetensorsFile(path)


def test_empty_tensors_at_the_running_offset_are_fine(tmp_path: Path) -> None:
    header = {
        "a": entry(shape=[0], offsets=[0, 0]),
        "w": entry(),
        "z": entry(shape=[0], offsets=[8, 8]),
    }
    path = write_raw(tmp_path / "e.safetensors", header, data=bytes(8))
    assert_bitwise_equal(load_safetensors_dir(path), load(path.read_bytes()))


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(100)}, str(path))
    blob = path.read_bytes()
    path.write_bytes(blob[:-1])
    with pytest.raises(ValueError, match="outside the data area"):
        SafetensorsFile(path)


def test_missing_file_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nope.safetensors"):
        SafetensorsFile(tmp_path / "nope.safetensors")
    with pytest.raises(ValueError, match="neither"):
        load_safetensors_dir(tmp_path)


def _sharded(tmp_path: Path, weight_map: dict[str, str]) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "s1.safetensors"))
    save_file({"b": torch.ones(3)}, str(tmp_path / "s2.safetensors"))
    index = {"weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("weight_map", "defect"),
    [
        ({"a": "s1.safetensors", "b": "s3.safetensors"}, "does not exist"),
        ({"a": "s1.safetensors", "b": "s1.safetensors"}, "'b' is not in 's1.safetensors'"),
        ({"a": "s2.safetensors", "b": "s1.safetensors"}, "index puts it in .s2.safetensors."),
        ({"a": "s1.safetensors", "b": "s2.safetensors", "c": "s2.safetensors"}, "'c' is not in"),
        ({"a": "../s1.safetensors"}, "plain file name"),
    ],
)
def test_inconsistent_shard_index_is_refused(
    tmp_path: Path, weight_map: dict[str, str], defect: str
) -> None:
    _sharded(tmp_path, weight_map)
    with pytest.raises(ValueError, match=defect):
        load_safetensors_dir(tmp_path)


def test_a_shard_that_is_a_fifo_or_a_device_is_refused_unopened(tmp_path: Path) -> None:
    """issue 33 item 9: opening a FIFO waits for a writer, so the shard is named, not read."""
    import os

    _sharded(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    (tmp_path / "s2.safetensors").unlink()
    os.mkfifo(tmp_path / "s2.safetensors")
    with pytest.raises(ValueError, match="shard 's2.safetensors' is a FIFO .*, not a safetensors"):
        load_safetensors_dir(tmp_path)
    with pytest.raises(ValueError, match="s2.safetensors is a FIFO .*, not a safetensors file"):
        SafetensorsFile(tmp_path / "s2.safetensors")
    with pytest.raises(ValueError, match="^/dev/zero is a character device, not a safetensors"):
        SafetensorsFile("/dev/zero")


def test_shard_tensor_missing_from_index_is_refused(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2), "extra": torch.ones(1)}, str(tmp_path / "s1.safetensors"))
    index = {"weight_map": {"a": "s1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'extra' but the index omits it"):
        load_safetensors_dir(tmp_path)


# ----- fuzzing ----------------------------------------------------------------------------------


def read_everything(path: Path) -> None:
    """Parse and touch every tensor; a valid parse must give self-consistent tensors."""
    with SafetensorsFile(path) as f:
        for name in f.keys():
            t = f.get_tensor(name)
            assert tuple(t.shape) == f.shape(name) and t.dtype == f.dtype(name)
            t.sum()  # read every byte


def valid_file_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.safetensors"
        tensors = {
            "a": torch.randn(3, 4),
            "b": torch.randn(5).half(),
            "c": torch.randn(2).bfloat16(),
        }
        save_file(tensors, str(path), metadata={"k": "v"})
        return path.read_bytes()


VALID = valid_file_bytes()
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_blob(blob: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.safetensors"
        path.write_bytes(blob)
        try:
            read_everything(path)
        except ValueError as e:
            assert "fuzz.safetensors" in str(e)


@FUZZ
@given(
    flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(1, 255)), max_size=6),
    cut=st.one_of(st.none(), st.integers(0, len(VALID))),
)
def test_fuzz_byte_flips_and_truncation(flips: list[tuple[int, int]], cut: int | None) -> None:
    blob = bytearray(VALID)
    for pos, xor in flips:
        blob[pos] ^= xor
    check_blob(bytes(blob[:cut]))


json_ints = st.one_of(
    st.integers(-4, 64), st.integers(-(2**70), 2**70), st.booleans(), st.floats(allow_nan=False)
)
entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "F16", "BF16", "I8", "F64", "BOOL", "x", 3]),
        "shape": st.one_of(st.lists(json_ints, max_size=4), json_ints, st.none()),
        "data_offsets": st.one_of(st.lists(json_ints, min_size=0, max_size=3), st.none()),
    }
)
headers = st.dictionaries(
    st.one_of(st.text(max_size=4), st.just("__metadata__")),
    st.one_of(entries, st.dictionaries(st.text(max_size=3), st.text(max_size=3)), st.integers()),
    max_size=5,
)


@FUZZ
@given(
    header=headers,
    data_len=st.integers(0, 96),
    length_delta=st.one_of(st.just(0), st.integers(-8, 8), st.integers(2**20, 2**64 - 1 - 4096)),
)
def test_fuzz_random_headers(header: dict, data_len: int, length_delta: int) -> None:
    raw = json.dumps(header).encode()
    n = max(0, min(len(raw) + length_delta, 2**64 - 1))
    check_blob(struct.pack("<Q", n) + raw + bytes(range(256))[:data_len])


@FUZZ
@given(
    spans=st.lists(
        st.tuples(st.sampled_from(["F32", "F16", "BF16"]), st.integers(0, 6), st.integers(0, 40)),
        max_size=5,
    ),
    data_len=st.integers(0, 64),
)
def test_fuzz_plausible_offsets(spans: list[tuple[str, int, int]], data_len: int) -> None:
    """Well-typed headers whose offsets may overlap or run past the data: the subtle cases."""
    size = {"F32": 4, "F16": 2, "BF16": 2}
    header = {
        f"t{i}": entry(dtype=dt, shape=[n], offsets=[begin, begin + n * size[dt]])
        for i, (dt, n, begin) in enumerate(spans)
    }
    raw = json.dumps(header).encode()
    check_blob(struct.pack("<Q", len(raw)) + raw + bytes(data_len))
