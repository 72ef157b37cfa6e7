"""`pagedllm trace`: what it prints is what the engine holds and computes.

Oracles: transformers' `output_hidden_states` for the per-layer checksums of a
prefill, its greedy `generate` for the sampled tokens, and the block manager
for the block tables the runner's batch carries.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.cli import main
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine_config import EngineConfig
from pagedllm.model import load_model
from pagedllm.trace import format_record, trace_steps
from tiny_models import greedy, hf_greedy, make_tiny_llama_dir


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path, hf = make_tiny_llama_dir(tmp_path_factory.mktemp("trace") / "m", seed=5)
    return hf.eval(), load_model(path, device="cpu", dtype="float32")


def test_layer_checksums_tokens_and_tables(pair):
    hf, ours = pair
    config = EngineConfig(kv_cache_mib=4, block_size=4, async_scheduling=True)
    engine = LLMEngine(config, ours, log=lambda m: None)
    prompts = [[5, 9, 13, 2, 7, 7, 30, 11, 4], [5, 9, 13, 2, 8]]
    records = trace_steps(engine, prompts, greedy(4, logprobs=5), steps=4)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert ours.tracer is None and not engine.has_unfinished()  # nothing left behind
    assert engine.async_scheduling  # off for the trace only

    # 1. The prefill step's hidden states, layer by layer, against transformers.
    with torch.no_grad():
        states = hf(torch.tensor([prompts[0]]), output_hidden_states=True).hidden_states
    first = records[0]
    want = [s[0].double() for s in states]
    # Both prompts are packed in one batch (the second shares a page with the
    # first); a record sums the whole batch, so one prompt alone is compared.
    assert first["layers"]["0"]["hidden"]["shape"] == [
        sum(map(len, prompts)) - 4,  # the shared page is not computed twice
        ours.config.hidden_size,
    ]
    engine.block_manager.pool.reset_cache()  # the prompt alone computes every token
    alone = trace_steps(engine, prompts[:1], greedy(1), steps=1)[0]
    for layer in range(len(ours.layers) - 1):  # HF's last state is after the final norm
        got = alone["layers"][str(layer)]["hidden"]["sum"]
        assert got == pytest.approx(float(want[layer + 1].sum()), rel=1e-4, abs=1e-3), layer
    assert alone["layers"]["-1"]["embedding"]["sum"] == pytest.approx(
        float(want[0].sum()), rel=1e-5, abs=1e-4
    )

    # 2. The sampled tokens are transformers' greedy tokens, with their top-5.
    sampled: dict[int, list[int]] = {}
    for r in records:
        for e in r["sampled"]:
            if "token" in e:
                sampled.setdefault(e["request"], []).append(e["token"])
                assert len(e["top"]) == 5 and e["top"][0][0] == e["token"]
    for (_, tokens), prompt in zip(sorted(sampled.items()), prompts):  # ids in arrival order
        assert tokens == hf_greedy(hf, prompt, 4)

    # 3. The batch's block tables are the block manager's, and every slot is
    #    the page of its position in that table.
    bs = engine.block_manager.block_size
    for r in records:
        b, pages = r["batch"], r["scheduler"]["pages"]
        ids = [x["request"] for x in r["scheduler"]["scheduled"]]
        assert b["block_tables"] == [
            pages[str(i)][: len(t)] for i, t in zip(ids, b["block_tables"])
        ]
        starts = b["cu_seqlens"]
        for row, table in enumerate(b["block_tables"]):
            for t in range(starts[row], starts[row + 1]):
                pos = b["positions"][t]
                assert b["slot_mapping"][t] == table[pos // bs] * bs + pos % bs
    # The second prompt shares the first's first page (4 tokens): the prefix cache.
    assert first["scheduler"]["admitted"][1]["cached_prompt_tokens"] == 4
    assert "admitted r" in format_record(first) and "layer 0" in format_record(first)


def test_the_command_on_the_default_model(capsys, smollm2):
    code = main(["trace", "Hi", "--steps", "2", "--layer", "0", "--json", "--kv-cache-mib", "16"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and len(out) == 2
    first, second = (json.loads(line) for line in out)
    # the embedding, the one layer asked for and the final norm
    assert set(first["layers"]) == {"-1", "0", "30"}
    assert first["batch"]["positions"] == list(range(len(first["batch"]["input_ids"])))
    assert second["batch"]["input_ids"] == [first["sampled"][0]["token"]]  # decode feeds it back
    assert main(["trace", "Hi", "--layer", "99", "--kv-cache-mib", "16"]) == 1
    assert "layer 99 does not exist" in capsys.readouterr().err


def test_every_buffer_against_transformers_and_the_filter(pair):
    """Each buffer of BUFFERS in layer 0 against the same tensor of transformers'
    layer (forward hooks), and the final norm against its last hidden state."""
    from pagedllm.trace import BUFFERS

    hf, ours = pair
    engine = LLMEngine(EngineConfig(kv_cache_mib=4, block_size=4), ours, log=lambda m: None)
    prompt = [5, 9, 13, 2, 7, 7, 30, 11, 4]
    record = trace_steps(engine, [prompt], greedy(1), steps=1, layers=[0])[0]
    n = len(ours.layers)
    assert set(record["layers"]) == {"-1", "0", str(n)}
    assert list(record["layers"]["0"]) == [
        b for b in BUFFERS if b not in ("embedding", "final_norm")
    ]

    seen: dict[str, torch.Tensor] = {}
    layer = hf.model.layers[0]

    def keep(name, index=None):
        def hook(module, args, out):
            seen[name] = (args[0] if index == "in" else out).detach()

        return hook

    hooks = [
        layer.input_layernorm.register_forward_hook(keep("attn_norm")),
        layer.self_attn.o_proj.register_forward_hook(keep("attention", "in")),
        layer.self_attn.o_proj.register_forward_hook(keep("o_proj")),
        layer.post_attention_layernorm.register_forward_hook(keep("mlp_norm")),
        layer.mlp.down_proj.register_forward_hook(keep("swiglu", "in")),
        layer.mlp.down_proj.register_forward_hook(keep("down")),
        layer.self_attn.v_proj.register_forward_hook(keep("v")),
        layer.self_attn.k_proj.register_forward_hook(keep("k_raw")),
        layer.self_attn.q_proj.register_forward_hook(keep("q_raw")),
    ]
    try:
        with torch.no_grad():
            states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    finally:
        for h in hooks:
            h.remove()
    got = record["layers"]["0"]
    for name, t in seen.items():
        assert got[name]["sum"] == pytest.approx(float(t.double().sum()), rel=1e-4, abs=1e-3), name
        assert got[name]["shape"][0] == len(prompt), name
    # RoPE at position 0 is the identity: the first row of q is q_raw's.
    assert got["q"]["first"] == got["q_raw"]["first"]
    final = record["layers"][str(n)]["final_norm"]
    assert final["shape"] == [1, ours.config.hidden_size]  # only the row the LM head reads
    assert final["sum"] == pytest.approx(
        float(states[-1][0, -1].double().sum()), rel=1e-4, abs=1e-3
    )

    only = trace_steps(engine, [prompt], greedy(1), steps=1, layers=[1], buffers=["k", "swiglu"])
    assert {k: list(v) for k, v in only[0]["layers"].items()} == {"1": ["k", "swiglu"]}
    with pytest.raises(ValueError, match="no buffer 'kk'"):
        trace_steps(engine, [prompt], greedy(1), steps=1, buffers=["kk"])
    assert not engine.has_unfinished() and ours.tracer is None


# ------------------------------------------------- sampling flags (issue 33, item 20)
@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    from test_cli import _write_tiny_model

    return _write_tiny_model(tmp_path_factory.mktemp("trace-tok") / "model")


def _sampled(capsys, model, *flags: str) -> list[tuple[int, int]]:
    """(sampled token, most likely token) of each step of a 4-step trace."""
    argv = ["trace", "Hello there", "--raw", "--steps", "4", "--layer", "0", "--buffer", "q"]
    assert main([*argv, "--json", "--model", str(model), "--kv-cache-mib", "4", *flags]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return [(e["token"], e["top"][0][0]) for r in records for e in r["sampled"] if "token" in e]


HOT = ("--temperature", "5", "--seed", "7")


def test_trace_samples_with_temperature_and_the_seed_repeats_it(tiny_with_tokenizer, capsys):
    """--temperature 5 over 128k tokens: some sampled token is not the most likely one
    (greedy's by chance is ~never); the same seed samples the same tokens again."""
    sampled = _sampled(capsys, tiny_with_tokenizer, *HOT)
    assert len(sampled) == 4 and any(token != top for token, top in sampled)
    assert _sampled(capsys, tiny_with_tokenizer, *HOT) == sampled


def test_trace_top_k_1_samples_the_most_likely_token(tiny_with_tokenizer, capsys):
    sampled = _sampled(capsys, tiny_with_tokenizer, *HOT, "--top-k", "1")
    assert len(sampled) == 4 and all(token == top for token, top in sampled)


def test_trace_checks_the_sampling_flags_before_loading(capsys):
    assert main(["trace", "Hi", "--top-p", "0", "--model", "/no/such/model"]) == 2
    assert "pagedllm trace: error: argument --top-p: must be in (0, 1]" in capsys.readouterr().err


def test_trace_of_a_missing_model_is_one_line(tmp_path, capsys):
    assert main(["trace", "Hi", "--model", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert err.count("pagedllm trace: error: ") == 1 and "Traceback" not in err
