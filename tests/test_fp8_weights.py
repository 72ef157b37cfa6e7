"""FP8 weights (issue 36): checkpoints in the Hub's FP8 formats, and quantizing as we load.

Oracle: transformers' LlamaForCausalLM loading the *dequantized* weights
(weight.float() * scale) from a float32 checkpoint the test writes beside the
FP8 one (tests/fp8_checkpoints.py quantizes with plain torch ops). Our logits
are float32 sums of the same float32 products in another order: within 1e-4.

On the CPU an FP8 checkpoint loads dequantized (plain `Linear`s); the FP8 path
of the GPU (`Fp8Linear`: Q/K/V and gate/up fused with their scales, each rank's
slice of them) is built here too, on the CPU (`fp8_weights=True`), and runs
the reference op, which dequantizes the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8_checkpoints import (
    E4M3,
    ct_config,
    dequantized_reference,
    fp8_method_config,
    per_block,
    per_channel,
    per_tensor,
    write_fp8_checkpoint,
)
from pagedllm import LLM
from pagedllm.config import ModelConfig
from pagedllm.engine_config import EngineConfig
from pagedllm.model import build_model, load_model
from pagedllm.model.linear import Fp8Linear, Linear
from pagedllm.model.loader import (
    dummy_model,
    dummy_weight_bytes,
    holds_fp8_weights,
    weight_bytes,
)
from pagedllm.model.parallel import TensorParallel, shard_weight
from pagedllm.quantization import parse_quantization_config
from pagedllm.weights import load_safetensors_dir
from tiny_models import greedy, hf_greedy, make_tiny_llama

CPU = torch.device("cpu")
PROMPT = [1, 17, 250, 3, 99, 41, 300, 7, 8, 120, 64, 5]
TOL = dict(rtol=1e-4, atol=1e-4)  # float32 against float32, summed in another order


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def write_ct(tmp_path: Path, strategy: str, activations: str = "dynamic", **overrides):
    """A compressed-tensors checkpoint: every projection but layer 1's down_proj (and
    the LM head) per `strategy`; returns (path, config, dequantized state, hf model)."""
    hf, cfg = make_tiny_llama(0, **overrides)
    ignore = ("lm_head", r"re:model\.layers\.1\.mlp\.down_proj")
    how = per_tensor if strategy == "tensor" else per_channel

    def quantize(name, w):
        return None if name == "model.layers.1.mlp.down_proj.weight" else how(w)

    path = tmp_path / f"ct-{strategy}-{activations}"
    deq = write_fp8_checkpoint(
        path,
        hf,
        cfg,
        ct_config(strategy, activations, ignore),
        quantize,
        input_scales=activations == "static",
    )
    return path, cfg, deq, hf


def write_block(tmp_path: Path, block=(32, 32), **overrides):
    """A "fp8"-method checkpoint: every projection per (b0, b1) block (weight_scale_inv)."""
    hf, cfg = make_tiny_llama(0, **overrides)
    path = tmp_path / f"fp8-{block[0]}x{block[1]}"
    deq = write_fp8_checkpoint(
        path,
        hf,
        cfg,
        fp8_method_config(block),
        lambda name, w: per_block(w, *block),
        scale_name="weight_scale_inv",
    )
    return path, cfg, deq, hf


def build(path: Path, fp8_weights: bool | None = None, **kw):
    config = ModelConfig.from_hf_dir(path)
    return build_model(
        config, load_safetensors_dir(path), CPU, torch.float32, fp8_weights=fp8_weights, **kw
    )


# ------------------------------------------------------------------ against transformers
@pytest.mark.parametrize(
    "strategy, activations", [("tensor", "static"), ("channel", "dynamic"), ("channel", "none")]
)
def test_compressed_tensors_checkpoint_equals_transformers_dequantized(
    tmp_path, strategy, activations
):
    path, _, deq, hf = write_ct(tmp_path, strategy, activations)
    reference = dequantized_reference(hf, deq, tmp_path / "reference")
    want = hf_logits(reference, PROMPT)

    model = load_model(path, "cpu", "float32")  # the CPU dequantizes: plain Linears
    assert isinstance(model.layers[0].qkv_proj, Linear)
    torch.testing.assert_close(model.forward_logits(PROMPT), want, **TOL)
    # The GPU's layout on the CPU: FP8 matrices, Q/K/V and gate/up fused with their
    # scales (per tensor -> per row), through the reference fp8_linear.
    fp8 = build(path, fp8_weights=True)
    layer = fp8.layers[0]
    assert isinstance(layer.qkv_proj, Fp8Linear) and layer.qkv_proj.qweight.dtype == E4M3
    assert layer.qkv_proj.scale.shape == (layer.qkv_proj.shape[0],)
    assert isinstance(fp8.layers[1].down_proj, Linear)  # ignored by the 're:' pattern
    torch.testing.assert_close(fp8.forward_logits(PROMPT), want, **TOL)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_block_fp8_checkpoint_equals_transformers_dequantized(tmp_path, kv_heads):
    """32 x 32 blocks: with 2 KV heads every fused part is whole blocks (the scales
    are stacked); with 1, K and V are 16 rows, so the fused Q/K/V is quantized
    again per row (close, not exact); dequantized on the CPU it is exact."""
    path, _, deq, hf = write_block(tmp_path, num_key_value_heads=kv_heads)
    want = hf_logits(dequantized_reference(hf, deq, tmp_path / "reference"), PROMPT)
    torch.testing.assert_close(
        load_model(path, "cpu", "float32").forward_logits(PROMPT), want, **TOL
    )

    fp8 = build(path, fp8_weights=True)
    qkv, gate_up = fp8.layers[0].qkv_proj, fp8.layers[0].gate_up_proj
    assert gate_up.block_size == (32, 32) and gate_up.scale.shape == (2 * 128 // 32, 64 // 32)
    names = [f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up")]
    torch.testing.assert_close(gate_up.weight, torch.cat([deq[n] for n in names]), rtol=0, atol=0)
    if kv_heads == 2:
        assert qkv.block_size == (32, 32)
        torch.testing.assert_close(fp8.forward_logits(PROMPT), want, **TOL)
    else:
        assert qkv.block_size is None  # re-quantized per row: rounded twice
        got = fp8.forward_logits(PROMPT)
        assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_partial_blocks_at_the_edges(tmp_path):
    """Blocks of 48 columns over 64 (and 128) columns: the right-hand ones are partial."""
    path, _, deq, hf = write_block(tmp_path, block=(32, 48), num_key_value_heads=2)
    want = hf_logits(dequantized_reference(hf, deq, tmp_path / "reference"), PROMPT)
    fp8 = build(path, fp8_weights=True)
    assert fp8.layers[0].o_proj.scale.shape == (64 // 32, 2)
    torch.testing.assert_close(fp8.forward_logits(PROMPT), want, **TOL)


def test_fp8_checkpoint_generates_as_transformers_does(tmp_path):
    path, _, deq, hf = write_ct(tmp_path, "channel")
    reference = dequantized_reference(hf, deq, tmp_path / "reference")
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_mib=4)
    out = llm.generate([PROMPT], greedy(8))[0]
    assert out.token_ids == hf_greedy(reference, PROMPT, 8)


# ------------------------------------------------------------------ --quantization fp8
def test_quantizing_as_it_loads(tmp_path):
    """A float32 checkpoint with quantization="fp8": each fused projection's rows get
    their own scale, absmax / 448; the CPU keeps them dequantized in its dtype. The
    embeddings, norms and LM head are untouched."""
    hf, cfg = make_tiny_llama(0)
    path = tmp_path / "dense"
    hf.save_pretrained(path, safe_serialization=True)
    sd = hf.state_dict()
    p = "model.layers.1."
    fused = torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    q, scale, deq = per_channel(fused)

    fp8 = build(path, fp8_weights=True, quantization="fp8")
    qkv = fp8.layers[1].qkv_proj
    assert torch.equal(qkv.qweight.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(qkv.scale, scale[:, 0], rtol=0, atol=0)
    assert fp8.quantization == "fp8" and holds_fp8_weights(fp8)

    cpu = load_model(path, "cpu", "float32", quantization="fp8")
    assert isinstance(cpu.layers[1].qkv_proj, Linear) and not holds_fp8_weights(cpu)
    torch.testing.assert_close(cpu.layers[1].qkv_proj.weight, deq, rtol=0, atol=0)
    torch.testing.assert_close(cpu.lm_head.weight, sd["lm_head.weight"], rtol=0, atol=0)
    torch.testing.assert_close(cpu.embed_tokens, sd["model.embed_tokens.weight"], rtol=0, atol=0)
    # e4m3 keeps 3 mantissa bits: the logits move, a little
    exact = hf_logits(hf, PROMPT)
    got = cpu.forward_logits(PROMPT)
    assert 0 < (got - exact).abs().max() < 0.05 * exact.abs().max()
    torch.testing.assert_close(fp8.forward_logits(PROMPT), got, **TOL)


def test_llm_quantization_setting(tmp_path):
    hf, _ = make_tiny_llama(0)
    path = tmp_path / "dense"
    hf.save_pretrained(path, safe_serialization=True)
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_mib=4, quantization="fp8")
    assert llm.engine.model.quantization == "fp8"
    assert len(llm.generate([PROMPT], greedy(4))[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"quantization='int8' is not one of none, fp8"):
        EngineConfig(quantization="int8")
    plain = load_model(path, "cpu", "float32")
    with pytest.raises(ValueError, match="loaded without FP8 weights") as e:
        LLM(plain, quantization="fp8", kv_cache_mib=4)
    assert "\n" not in str(e.value)


def test_stats_show_the_weight_bytes(tmp_path, capsys):
    from pagedllm.cli import print_stats

    path, *_ = write_ct(tmp_path, "channel")
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_mib=4)
    outs = llm.generate([PROMPT], greedy(2))
    stats = llm.stats()
    # the CPU holds the FP8 projections dequantized, in float32
    assert stats["weight_bytes"] == weight_bytes(llm.engine.model) > 0
    assert stats["weights_fp8"] is False
    print_stats(stats, outs)
    assert "model weights                   0.5 MiB\n" in capsys.readouterr().out
    print_stats({**stats, "weight_bytes": 72_700_000_000, "weights_fp8": True}, outs)
    assert "model weights                   67.7 GiB (FP8 projections)\n" in capsys.readouterr().out


# ------------------------------------------------------------------ tensor parallelism
def _rank_slice(w: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
    n = w.shape[dim] // 2
    return w.narrow(dim, rank * n, n)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind", ["channel", "block"])
@pytest.mark.parametrize("sharded", [False, True])
def test_each_rank_holds_its_slice_of_the_fp8_weights(tmp_path, kind, sharded, rank):
    """Column-parallel q/k/v and gate/up, row-parallel o and down: each rank's FP8
    matrix dequantizes to its slice of the whole one (scales cut along with it), from
    a whole state dict or from one read as the rank's slices (`sharded`)."""
    if kind == "block":
        path, _, deq, _ = write_block(tmp_path, block=(16, 32), num_key_value_heads=2)
    else:
        path, _, deq, _ = write_ct(tmp_path, "channel", num_key_value_heads=2)
    config = ModelConfig.from_hf_dir(path)
    tp = TensorParallel(rank, 2)
    select = (lambda n, t: shard_weight(n, t, tp)) if sharded else None
    state = load_safetensors_dir(path, select=select)
    model = build_model(config, state, CPU, torch.float32, tp=tp, sharded=sharded, fp8_weights=True)
    layer, p = model.layers[0], "model.layers.0."
    qkv = torch.cat([_rank_slice(deq[p + f"self_attn.{x}_proj.weight"], rank, 0) for x in "qkv"])
    gate_up = torch.cat(
        [_rank_slice(deq[p + f"mlp.{x}_proj.weight"], rank, 0) for x in ("gate", "up")]
    )
    exact = dict(rtol=0, atol=0)
    torch.testing.assert_close(layer.qkv_proj.weight, qkv, **exact)
    torch.testing.assert_close(layer.gate_up_proj.weight, gate_up, **exact)
    o, down = deq[p + "self_attn.o_proj.weight"], deq[p + "mlp.down_proj.weight"]
    torch.testing.assert_close(layer.o_proj.weight, _rank_slice(o, rank, 1), **exact)
    torch.testing.assert_close(layer.down_proj.weight, _rank_slice(down, rank, 1), **exact)


def test_tensor_parallel_workers_load_with_the_setting(tmp_path, monkeypatch):
    """Each worker process loads its rank with the engine's quantization setting."""
    from pagedllm.engine import llm_engine
    from pagedllm.runner import tp_workers

    hf, _ = make_tiny_llama(0, num_key_value_heads=2)
    hf.save_pretrained(tmp_path / "dense", safe_serialization=True)
    seen = []
    monkeypatch.setattr(tp_workers, "TPWorkers", lambda size, setup: seen.append(setup))
    config = EngineConfig(
        model=str(tmp_path / "dense"), tensor_parallel_size=2, quantization="fp8", device="cpu"
    )
    llm_engine._start_workers(config, None, 64)
    assert seen[0].quantization == "fp8"


@pytest.mark.slow
def test_fp8_checkpoint_over_two_cpu_ranks_generates_as_transformers_does(tmp_path):
    """Two processes, each dequantizing its slice (scales cut with it): greedy as
    transformers on the dequantized weights."""
    path, _, deq, hf = write_ct(tmp_path, "channel", num_key_value_heads=2)
    reference = dequantized_reference(hf, deq, tmp_path / "reference")
    settings = dict(device="cpu", dtype="float32", kv_cache_mib=4, tensor_parallel_size=2)
    with LLM(str(path), **settings) as two:
        out = two.generate([PROMPT], greedy(8))[0]
    assert out.token_ids == hf_greedy(reference, PROMPT, 8)


def test_rank_slices_that_cut_scale_blocks(tmp_path):
    """K and V of 32 rows in blocks of 32 over 2 ranks: 16 rows each, half a block.
    The CPU dequantizes each slice with the right scales; FP8 kernels cannot take it."""
    path, _, deq, _ = write_block(tmp_path, block=(32, 32), num_key_value_heads=2)
    config = ModelConfig.from_hf_dir(path)
    tp = TensorParallel(1, 2)
    model = build_model(config, load_safetensors_dir(path), CPU, torch.float32, tp=tp)
    k = deq["model.layers.0.self_attn.k_proj.weight"][16:]
    torch.testing.assert_close(model.layers[0].qkv_proj.weight[32:48], k, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"cuts the 32x32 scale blocks of FP8 weight") as e:
        build_model(config, load_safetensors_dir(path), CPU, torch.float32, tp=tp, fp8_weights=True)
    assert "k_proj" in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------ bad checkpoints
def _edit(path: Path, change) -> None:
    """Rewrite model.safetensors with `change(tensors)` applied."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


Q0 = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda t: t.pop(Q0 + ".weight_scale"), f"FP8 weight '{Q0}.weight' has no scale: "),
        (
            lambda t: t.__setitem__(Q0 + ".weight_scale", torch.ones(32, 1)),
            r"has shape \(32, 1\); the \(64, 64\) weight it scales needs one per output channel",
        ),
        (
            lambda t: t.__setitem__(Q0 + ".weight_scale", -torch.ones(64, 1)),
            "not finite and > 0",
        ),
        (
            lambda t: t.__setitem__(Q0 + ".weight", t[Q0 + ".weight"].float()),
            f"weight '{Q0}.weight' is float32, but quantization_config quantizes",
        ),
        (
            lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"].to(E4M3)),
            "tensor 'lm_head.weight' is float8 e4m3; only the decoder layers'",
        ),
        (
            lambda t: t.__setitem__(
                "model.layers.1.mlp.down_proj.weight",
                t["model.layers.1.mlp.down_proj.weight"].to(E4M3),
            ),
            "leaves 'model.layers.1.mlp.down_proj' unquantized",
        ),
        (
            lambda t: t.__setitem__("model.layers.1.mlp.down_proj.weight_scale", torch.ones(1)),
            "'model.layers.1.mlp.down_proj.weight_scale' is a scale of no FP8 weight",
        ),
    ],
)
def test_bad_fp8_checkpoints_get_one_line_errors(tmp_path, change, says):
    path, *_ = write_ct(tmp_path, "channel")
    _edit(path, change)
    with pytest.raises(ValueError, match=says) as e:
        load_model(path, "cpu", "float32")
    assert "\n" not in str(e.value)


def test_block_scale_of_the_wrong_shape(tmp_path):
    path, *_ = write_block(tmp_path)
    _edit(path, lambda t: t.__setitem__(Q0 + ".weight_scale_inv", torch.ones(2, 3)))
    with pytest.raises(ValueError, match=r"needs one per 32x32 block: \(2, 2\)") as e:
        load_model(path, "cpu", "float32")
    assert f"{Q0}.weight_scale_inv" in str(e.value)


def test_static_activations_need_an_input_scale(tmp_path):
    path, *_ = write_ct(tmp_path, "tensor", "static")
    _edit(path, lambda t: t.pop(Q0 + ".input_scale"))
    with pytest.raises(ValueError, match=f"no '{Q0}.input_scale'"):
        load_model(path, "cpu", "float32")


def test_float8_weights_without_a_quantization_config(tmp_path):
    path, *_ = write_ct(tmp_path, "channel")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="is float8 e4m3, but config.json has no quantization_"):
        load_model(path, "cpu", "float32")


def _group_weights(**change):
    qc = ct_config()
    qc["config_groups"]["group_0"]["weights"].update(change)
    return qc


@pytest.mark.parametrize(
    "qc, says",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        (_group_weights(num_bits=4), r"weights.num_bits 4"),
        (_group_weights(type="int"), r"weights.type 'int'"),
        (_group_weights(symmetric=False), "asymmetric weights"),
        (_group_weights(strategy="group", group_size=128), r"weights.strategy 'group'"),
        ({**ct_config(), "format": "pack-quantized"}, "format 'pack-quantized'"),
        ({**ct_config(), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
        ({**fp8_method_config(), "fmt": "e5m2"}, "fmt 'e5m2'"),
        ({**fp8_method_config(), "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
        (
            {**fp8_method_config(), "activation_scheme": "static"},
            "activation_scheme 'static' with weight_block_size",
        ),
    ],
)
def test_unsupported_quantization_is_refused_in_one_line(qc, says):
    with pytest.raises(ValueError, match=says) as e:
        parse_quantization_config(qc, "m/config.json")
    message = str(e.value)
    assert message.startswith("m/config.json: quantization_config: ") and "\n" not in message
    assert "pagedllm reads FP8 checkpoints: compressed-tensors float-quantized" in message


def test_ignore_lists_match_as_vllm_and_transformers_do():
    ct = parse_quantization_config(ct_config(ignore=("lm_head", r"re:.*\.mlp\.down_proj$")), "c")
    assert ct.scheme_for("model.layers.0.self_attn.q_proj").strategy == "channel"
    assert ct.scheme_for("lm_head") is None
    assert ct.scheme_for("model.layers.3.mlp.down_proj") is None
    assert ct.scheme_for("model.layers.3.mlp.gate_proj") is not None
    fp8 = parse_quantization_config(
        {**fp8_method_config(), "modules_to_not_convert": ["model.layers.1", "down_proj"]}, "c"
    )
    assert fp8.scheme_for("model.layers.1.self_attn.q_proj") is None  # a prefix up to a dot
    assert fp8.scheme_for("model.layers.11.self_attn.q_proj").scale_name == "weight_scale_inv"
    assert fp8.scheme_for("model.layers.0.mlp.down_proj") is None  # a suffix


# ------------------------------------------------------------------ reading and showing
def test_our_reader_reads_float8_tensors_as_safetensors_does(tmp_path):
    from safetensors.torch import load_file, save_file

    from pagedllm.weights import SafetensorsFile

    w = (torch.randn(5, 7) * 100).to(E4M3)
    save_file({"w": w, "s": torch.ones(5, 1)}, str(tmp_path / "f.safetensors"))
    with SafetensorsFile(tmp_path / "f.safetensors") as f:
        ours = f.get_tensor("w")
        assert f.dtype_name("w") == "F8_E4M3" and ours.dtype == E4M3
        theirs = load_file(str(tmp_path / "f.safetensors"))["w"]
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


def test_inspect_shows_the_quantization(tmp_path):
    from pagedllm.inspect_model import format_config, inspect_checkpoint

    path, *_ = write_ct(tmp_path, "tensor", "static")
    info = inspect_checkpoint(path)
    q = info["quantization"]
    assert q["method"] == "compressed-tensors" and q["format"] == "float-quantized"
    assert q["ignore"] == ["lm_head", r"re:model\.layers\.1\.mlp\.down_proj"]
    assert q["fp8_projections"]["down_proj"] == [0] and q["fp8_projections"]["q_proj"] == [0, 1]
    assert q["fp8_tensors"] == 13 and q["scale_tensors"] == 26  # weight_scale + input_scale
    assert q["unquantized_projections"] == ["model.layers.1.mlp.down_proj"]
    json.dumps(info, default=str)  # --json
    text = format_config(info)
    assert "one scale per tensor (weight_scale)" in text
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj in all 2 layers" in text
    assert "down_proj in layer 0" in text
    block = inspect_checkpoint(write_block(tmp_path)[0])["quantization"]
    assert "one scale per 32x32 block (weight_scale_inv)" in block["description"]


# ------------------------------------------------------------------ dummy FP8 weights
def test_dummy_fp8_weights_are_made_in_fp8():
    config = ModelConfig.from_hf_dict(make_tiny_llama(0)[1])
    model = dummy_model(config, "cpu", "float32", quantization="fp8", fp8_weights=True)
    gate_up = model.layers[0].gate_up_proj
    assert isinstance(gate_up, Fp8Linear) and isinstance(model.lm_head, Linear)
    std = gate_up.weight.std().item()
    assert 0.015 < std < 0.025 and torch.isfinite(gate_up.weight).all()
    assert torch.isfinite(model.forward_logits(PROMPT)).all()
    # weight_bytes counts what is held: float8 values, float32 scales, the rest in float32
    e, v, L = config.hidden_size, config.vocab_size, config.num_hidden_layers
    matrices = [(64 + 2 * 16, e), (e, 64), (2 * 128, e), (e, 128)]
    per_layer = sum(r * c + 4 * r for r, c in matrices) + 2 * e * 4
    assert weight_bytes(model) == L * per_layer + (2 * v * e + e) * 4
    assert dummy_weight_bytes(config, torch.float32, "cpu", fp8=True) > weight_bytes(model)
    # a decode step reads all of that but the embedding table, of which one row
    from pagedllm.bench.machine import weight_bytes_per_decode_step

    assert weight_bytes_per_decode_step(model) == weight_bytes(model) - (v - 1) * e * 4


def test_llama_70b_fits_one_h200_in_fp8(monkeypatch):
    from pagedllm import memory
    from pagedllm.model.loader import check_dummy_fits
    from pagedllm.presets import preset_dir

    config = ModelConfig.from_hf_dir(preset_dir("llama-3.1-70b"))
    fp8 = dummy_weight_bytes(config, torch.bfloat16, "cuda", fp8=True)
    bf16 = dummy_weight_bytes(config, torch.bfloat16, "cuda")
    # 68.4 GB of float8 layers, 4.2 GB of bf16 embeddings and head, 4.2 GB made on the way
    assert 70e9 < fp8 < 78e9 and bf16 > 140e9
    free = 139 * 2**30  # what an H200 has free before the load
    monkeypatch.setattr(memory, "available_bytes", lambda device: (free, "free GPU memory"))
    cuda = torch.device("cuda")
    check_dummy_fits(config, cuda, torch.bfloat16, fp8=True)
    with pytest.raises(ValueError, match=r"\(or give --quantization fp8\)$"):
        check_dummy_fits(config, cuda, torch.bfloat16)
