"""The benchmark harness on a tiny random model: CPU, seconds, no downloads.

What is checked: workload 1's draw is docs/gpu.md's (sum(max_tokens) == 133,966);
each workload runs end to end through `bench_main`, printing a table and then
one JSON line with the documented fields; `--peer hf` runs transformers on
the very weights we run (its logits match ours).
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.bench.cli import bench_main
from pagedllm.bench.workloads import (
    THROUGHPUT_SUM_MAX_TOKENS,
    draw_throughput,
    latency_workload,
    ttft_workload,
)

RECORD_FIELDS = {
    "engine",
    "version",
    "commit",
    "date",
    "device",
    "dtype",
    "model",
    "workload",
    "requests",
    "output_tokens",
    "seconds",
    "tokens_per_s",
    "ttft_ms",
    "tpot_ms",
    "achieved_gbps",
    "host_time_per_step_ms",
    "peer",
    "ratio",
    "command",
    "threads",
}
SMALL = ["--threads", "1", "--kv-cache-mib", "4"]
TINY_RUNS = {
    "throughput": ["--num-requests", "6", "--max-prompt-len", "32", "--max-output-len", "8"],
    "latency": ["--prompt-len", "32", "--output-len", "12", "--runs", "2"],
    "ttft": ["--prompt-len", "64", "--runs", "3"],
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny_models import make_tiny_llama_dir

    path, _ = make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))
    return path


def _last_json(out: str) -> dict:
    lines = out.strip().splitlines()
    return json.loads(lines[-1])


# ---------------------------------------------------------------- workloads
def test_throughput_draw_is_the_documented_one():
    w = draw_throughput()
    assert w.num_requests == 256
    assert sum(w.max_tokens) == THROUGHPUT_SUM_MAX_TOKENS == 133_966
    assert all(100 <= len(p) <= 1024 for p in w.prompts)
    assert all(0 <= t <= 10_000 for p in w.prompts for t in p)
    assert w.prompts[0][:3] == draw_throughput(256).prompts[0][:3]  # deterministic


def test_scaled_draw_keeps_the_mix_and_fits_the_vocab():
    full = draw_throughput(16)
    small = draw_throughput(16, max_prompt_len=64, max_output_len=32, vocab_size=512)
    assert all(1 <= len(p) <= 64 for p in small.prompts)
    assert all(1 <= m <= 32 for m in small.max_tokens)
    assert all(0 <= t < 512 for p in small.prompts for t in p)
    # Longer drawn requests stay longer after scaling.
    order = sorted(range(16), key=lambda i: full.max_tokens[i])
    scaled = [small.max_tokens[i] for i in order]
    assert scaled == sorted(scaled)
    assert small.prompts[0] == [t % 512 for t in full.prompts[0][: len(small.prompts[0])]]


def test_batch1_and_ttft_shapes():
    w = latency_workload(128, 512)
    assert len(w.prompts[0]) == 128 and w.max_tokens == [512]
    t = ttft_workload(1024)
    assert len(t.prompts[0]) == 1024 and t.max_tokens == [1]


# ------------------------------------------------------------- end to end
@pytest.mark.parametrize("workload", ["throughput", "latency", "ttft"])
def test_workload_end_to_end_with_hf_peer(workload, tiny_dir, tmp_path, capsys):
    json_path = tmp_path / "out.json"
    argv = [workload, "--model", str(tiny_dir), *SMALL, *TINY_RUNS[workload]]
    argv += ["--peer", "hf", "--json", str(json_path)]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "pagedllm" in out and "transformers" in out and "speed-up" in out
    rec = _last_json(out)
    assert RECORD_FIELDS <= rec.keys()
    assert rec == json.loads(json_path.read_text())
    assert rec["engine"] == "pagedllm" and rec["workload"] == workload
    assert rec["dtype"] == "float32"
    assert rec["threads"] == 1 and "torch CPU threads: 1" in out  # SMALL has --threads 1
    assert rec["command"].startswith(f"pagedllm bench {workload} --model ")
    assert rec["peer"]["engine"] == "transformers"
    assert rec["ratio"] > 0
    if workload == "throughput":
        expected = draw_throughput(6, 32, 8, 512).output_tokens
        assert rec["output_tokens"] == rec["peer"]["output_tokens"] == expected
        assert rec["tokens_per_s"] > 0 and rec["peer"]["tokens_per_s"] > 0
    if workload == "latency":
        assert rec["output_tokens"] == 12
        assert rec["achieved_gbps"] > 0 and rec["peer"]["achieved_gbps"] > 0
        assert rec["bandwidth_gbps"] > 0 and rec["bytes_per_token"] > 0
        assert rec["tpot_ms"] > 0 and rec["ttft_ms"] > 0
    if workload == "ttft":
        assert len(rec["ttft_runs_ms"]) == 3 and rec["ttft_ms"] > 0
        assert len(rec["peer"]["ttft_runs_ms"]) == 3


def test_without_peer_the_record_says_so(tiny_dir, capsys):
    argv = ["latency", "--model", str(tiny_dir), *SMALL, "--prompt-len", "8", "--output-len", "4"]
    assert bench_main(argv) == 0
    rec = _last_json(capsys.readouterr().out)
    assert rec["peer"] is None and rec["ratio"] is None
    assert rec["output_tokens"] == 4


def test_static_batching_throughput(tiny_dir, capsys):
    argv = ["throughput", "--model", str(tiny_dir), *SMALL, *TINY_RUNS["throughput"]]
    assert bench_main([*argv, "--batching", "static"]) == 0
    rec = _last_json(capsys.readouterr().out)
    assert rec["output_tokens"] == draw_throughput(6, 32, 8, 512).output_tokens


def test_preset_needs_dummy_weights(capsys):
    assert bench_main(["latency", "--preset", "llama-3.2-1b"]) == 2
    assert "--load-format dummy" in capsys.readouterr().err


def test_bad_option_is_an_error(capsys):
    assert bench_main(["ttft", "--output-len", "5"]) == 2
    assert bench_main(["latency", "--runs", "0"]) == 2
    assert capsys.readouterr().err.count("pagedllm bench: error: ") == 2


def test_a_model_that_cannot_be_loaded_is_a_failed_run(tmp_path, capsys):
    """Exit 1 and one line, as every pagedllm command (2 is for usage errors)."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    assert bench_main(["latency", "--model", str(bad)]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and lines[0].startswith("pagedllm bench: error: "), err
    assert "Traceback" not in err


# ----------------------------------------------------------------- the peer
def test_hf_peer_holds_our_weights():
    """Our fused q/k/v and gate/up, split back, give transformers our logits."""
    from pagedllm.bench.hf_peer import build_hf_model
    from pagedllm.config import ModelConfig, RopeScaling
    from pagedllm.model import dummy_model

    for tied in (True, False):
        config = ModelConfig(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64),
            tie_word_embeddings=tied,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_ids=(2,),
        )
        ours = dummy_model(config, "cpu", "float32", seed=3, std=0.1)
        hf = build_hf_model(ours)
        ids = [5, 17, 250, 3, 99, 42, 7, 128]
        with torch.no_grad():
            theirs = hf(torch.tensor([ids])).logits[0].float()
        mine = ours.forward_logits(ids)
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_roofline_bytes_read_per_decode_step():
    """Every matrix and norm once, the LM head once (tied or not), one embedding row."""
    from pagedllm.bench.machine import weight_bytes_per_decode_step
    from pagedllm.config import ModelConfig
    from pagedllm.model import dummy_model

    def config(tied: bool) -> ModelConfig:
        return ModelConfig(300, 64, 96, 2, 4, 2, 16, 1e-5, 1e4, None, tied, 256, 1, (2,))

    tied = weight_bytes_per_decode_step(dummy_model(config(True), "cpu", "float32"))
    untied = weight_bytes_per_decode_step(dummy_model(config(False), "cpu", "float32"))
    layer = (64 + 64 * (64 + 2 * 32) + 64 * 64 + 64 + 2 * 96 * 64 + 64 * 96) * 4
    assert tied == untied == 2 * layer + 64 * 4 + 300 * 64 * 4 + 64 * 4
