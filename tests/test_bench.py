"""The benchmark harness on a tiny random model: CPU, seconds, no downloads.

What is checked: workload 1's draw is docs/gpu.md's (sum(max_tokens) == 133,966);
each workload runs end to end through `bench_main`, printing a table and then
one JSON line with the documented fields; `--peer hf` runs transformers on
the very weights we run (its logits match ours). `prefix` reuses the shared
prefix only with prefix caching on; `pages` runs every page size under both
admission policies in a tight pool, and `--plot` draws the pages in use.
"""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from pagedllm.bench.cli import bench_main
from pagedllm.bench.workloads import (
    THROUGHPUT_SUM_MAX_TOKENS,
    draw_throughput,
    fixed_throughput,
    latency_workload,
    prefix_workload,
    reusable_prompt_share,
    ttft_workload,
)
from pagedllm.model_source import ModelSpec, load_model

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


@pytest.fixture
def no_load(monkeypatch):
    """Loading a model fails the test: the options were to be refused first."""

    def boom(*args, **kwargs):
        raise AssertionError("the model was loaded, but the options were bad")

    monkeypatch.setattr("pagedllm.bench.cli.load_model", boom)


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


def test_prefix_workload_shares_one_prefix():
    w = prefix_workload(8, 64, 10, 5, vocab_size=512)
    assert w.num_requests == 8 and all(len(p) == 74 for p in w.prompts)
    assert all(p[:64] == w.prompts[0][:64] for p in w.prompts)
    assert len({tuple(p[64:]) for p in w.prompts}) == 8  # each its own suffix
    assert w.max_tokens == [5] * 8 and all(0 <= t < 512 for p in w.prompts for t in p)
    assert prefix_workload(4, 64, 10, 5, 512).prompts == w.prompts[:4]  # deterministic
    # Full pages of the prefix, in every request but the first, over all prompt tokens.
    assert reusable_prompt_share(w, 64, 16) == 7 * 64 / (8 * 74)
    assert reusable_prompt_share(w, 64, 48) == 7 * 48 / (8 * 74)
    default = prefix_workload()  # the shape
    assert default.num_requests == 256 and len(default.prompts[0]) == 1024 + 100
    assert default.output_tokens == 256 * 128


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


def test_throughput_with_fixed_lengths_is_a_serving_draw(tiny_dir, capsys):
    """--prompt-len/--output-len: every request the same lengths, each prompt its own
    ids (as `vllm bench serve --dataset-name random` draws them)."""
    w = fixed_throughput(5, 12, 3, vocab_size=512)
    assert [len(p) for p in w.prompts] == [12] * 5 and w.max_tokens == [3] * 5
    assert len({tuple(p) for p in w.prompts}) == 5
    argv = ["throughput", "--model", str(tiny_dir), *SMALL, "--num-requests", "5"]
    assert bench_main([*argv, "--prompt-len", "12", "--output-len", "3"]) == 0
    rec = _last_json(capsys.readouterr().out)
    assert rec["output_tokens"] == 15 and "12 prompt tokens" in rec["workload_description"]
    assert bench_main([*argv, "--prompt-len", "12", "--max-output-len", "3"]) == 2
    assert "give one kind" in capsys.readouterr().err


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


# ------------------------------------------------ help and wording (issue 33, item 15)
def test_help_lists_every_workload_serve_included(capsys):
    assert bench_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "{throughput,latency,ttft,prefix,pages,serve}" in out


def test_serve_after_engine_options_says_to_name_it_first(no_load, capsys):
    assert bench_main(["--threads", "1", "serve"]) == 2
    err = capsys.readouterr().err
    assert "pagedllm bench: error: serve is an HTTP client" in err and "name it first" in err


def test_workload_descriptions_agree_in_number():
    assert latency_workload(1, 1).description == "batch 1, prompt 1 token, 1 new token"
    assert latency_workload(2, 3).description == "batch 1, prompt 2 tokens, 3 new tokens"
    assert ttft_workload(1).description == "one request, prompt 1 token, max_tokens 1"
    assert draw_throughput(1).description.startswith("1 request drawn with")
    assert prefix_workload(1, 4, 2, 1).description == (
        "1 request sharing a 4-token prefix, each with its own 2-token suffix, 1 new token"
    )


# ------------------------------------------------------- --json (issue 33, item 12)
@pytest.mark.parametrize(
    "contents", ["my notes\n", '{"tokens_per_s": 1}\n', '{"command": "pagedllm serve"}\n']
)
def test_json_refuses_a_file_that_is_not_a_bench_record(contents, tmp_path, no_load, capsys):
    """A file that holds anything but an earlier record is refused before anything loads,
    and keeps its bytes."""
    path = tmp_path / "notes.json"
    path.write_text(contents)
    assert bench_main(["latency", "--json", str(path)]) == 2
    err = capsys.readouterr().err
    assert "pagedllm bench: error: --json " in err and "not a pagedllm bench record" in err
    assert path.read_text() == contents


def test_json_refuses_a_directory_and_a_missing_directory(tmp_path, no_load, capsys):
    assert bench_main(["latency", "--json", str(tmp_path)]) == 2
    assert bench_main(["latency", "--json", str(tmp_path / "no" / "such.json")]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and "no such directory" in err


def test_json_replaces_an_earlier_record(tiny_dir, tmp_path, capsys):
    """A rerun replaces its own record (and an empty file is written), as documented."""
    path = tmp_path / "latency.json"
    argv = ["latency", "--model", str(tiny_dir), *SMALL, "--prompt-len", "8", "--output-len", "4"]
    path.write_text("")
    assert bench_main([*argv, "--json", str(path)]) == 0
    first = json.loads(path.read_text())
    assert bench_main([*argv, "--runs", "2", "--json", str(path)]) == 0
    second = json.loads(path.read_text())
    assert first["options"].get("runs") is None and second["options"]["runs"] == 2
    assert second == _last_json(capsys.readouterr().out)


def test_write_json_refuses_what_check_json_path_refuses(tmp_path):
    """The last guard: a file that appeared during the run is not overwritten either."""
    from pagedllm.bench import report

    path = tmp_path / "r.json"
    path.write_text("keep me")
    with pytest.raises(ValueError, match="not a pagedllm bench record"):
        report.write_json({"command": "pagedllm bench latency"}, str(path))
    assert path.read_text() == "keep me"
    assert report.is_bench_record('{"command": "pagedllm bench serve --request-rate 4"}')


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


def test_roofline_counts_float8_pages_at_one_byte():
    """With --kv-cache-dtype fp8 the K/V part of a decode step's bytes is 1 byte a value."""
    from pagedllm.bench.machine import decode_bytes_per_token, weight_bytes_per_decode_step
    from pagedllm.config import ModelConfig
    from pagedllm.model import dummy_model

    cfg = ModelConfig(300, 64, 96, 2, 4, 2, 16, 1e-5, 1e4, None, False, 256, 1, (2,))
    model = dummy_model(cfg, "cpu", "float32")
    weights = weight_bytes_per_decode_step(model)
    mean_context = 10 + 8 / 2
    kv_values = 2 * 2 * 2 * 16  # K and V, 2 layers, 2 KV heads, head dim 16
    assert decode_bytes_per_token(model, 10, 8) == weights + kv_values * 4 * mean_context
    assert decode_bytes_per_token(model, 10, 8, 1) == weights + kv_values * mean_context


# ------------------------------------------------------ prefix and pages
CONTEXT_FIELDS = {
    "engine",
    "version",
    "commit",
    "date",
    "device",
    "dtype",
    "threads",
    "model",
    "workload",
    "workload_description",
    "runs",
    "command",
    "options",
}
RUN_FIELDS = {"requests", "output_tokens", "seconds", "tokens_per_s", "total_tokens_per_s", "notes"}
# Two requests at a time: the later ones are admitted after the prefix's pages are written.
PREFIX_TINY = ["--num-requests", "6", "--prefix-len", "48", "--suffix-len", "8"]
PREFIX_TINY += ["--output-len", "4", "--max-num-seqs", "2", "--block-size", "16"]
# 81 tokens of K+V (256 bytes a token) for 6 requests of up to 40 tokens: a tight pool.
PAGES_TINY = ["--num-requests", "6", "--max-prompt-len", "32", "--max-output-len", "8"]
PAGES_TINY += ["--page-sizes", "8,16", "--kv-cache-mib", "0.02", "--threads", "1"]


def test_prefix_end_to_end(tiny_dir, tmp_path, capsys):
    json_path = tmp_path / "prefix.json"
    argv = ["prefix", "--model", str(tiny_dir), *SMALL, *PREFIX_TINY, "--json", str(json_path)]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "caching on" in out and "caching off" in out and "prefix cache hit rate (%)" in out
    assert "total tokens/s (prompt + output)" in out and "a prefix cache can reuse" in out
    rec = _last_json(out)
    assert rec == json.loads(json_path.read_text())
    assert CONTEXT_FIELDS | {"prefix_cache_hit_rate", "ratio", "ratio_of"} <= rec.keys()
    assert rec["workload"] == "prefix" and rec["command"].startswith("pagedllm bench prefix ")
    on, off = rec["runs"]
    assert (on["prefix_caching"], off["prefix_caching"]) == (True, False)
    for run in (on, off):
        assert RUN_FIELDS <= run.keys()
        assert run["requests"] == 6 and run["output_tokens"] == 6 * 4
        assert run["total_tokens_per_s"] > run["tokens_per_s"] > 0
        assert run["notes"]["prompt_tokens"] == 6 * (48 + 8)
    # Caching on reuses the prefix's full pages (at most 3 of them, in 5 requests);
    # caching off computes every prompt token.
    hit = on["notes"]["prefix_cache_hit_tokens"]
    assert 0 < hit <= 5 * 48 and on["notes"]["prefix_cache_hit_rate"] > 0
    assert off["notes"]["prefix_cache_hit_tokens"] == 0
    assert off["notes"]["prefix_cache_hit_rate"] == 0
    assert on["notes"]["prefill_tokens"] < off["notes"]["prefill_tokens"]
    assert rec["prefix_cache_hit_rate"] == on["notes"]["prefix_cache_hit_rate"]
    assert rec["prefix_cache_reusable_share"] == round(5 * 48 / (6 * 56), 4)
    assert rec["ratio"] == round(on["tokens_per_s"] / off["tokens_per_s"], 3)


def test_pages_end_to_end(tiny_dir, capsys):
    argv = ["pages", "--model", str(tiny_dir), *PAGES_TINY]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "page size" in out and "admission" in out and "peak MiB" in out
    assert "--kv-cache-mib 0.02" in out and "fastest: page size" in out
    rec = _last_json(out)
    assert CONTEXT_FIELDS | {"kv_cache_mib", "page_sizes", "fastest", "plot"} <= rec.keys()
    assert rec["kv_cache_mib"] == 0.02 and rec["page_sizes"] == [8, 16] and rec["plot"] is None
    settings = [(r["block_size"], r["admission"]) for r in rec["runs"]]
    assert settings == [(8, "reserve"), (8, "optimistic"), (16, "reserve"), (16, "optimistic")]
    expected = draw_throughput(6, 32, 8, 512).output_tokens
    for run in rec["runs"]:
        notes = run["notes"]
        assert run["output_tokens"] == expected and run["tokens_per_s"] > 0
        assert notes["block_size"] == run["block_size"]
        assert 0 < notes["pages_peak_used"] <= notes["pages_total"]
        assert 0 < notes["pages_peak_used_mib"] <= 0.02
        assert notes["admission_waits"] >= 0 and notes["preemptions"] >= 0
        if run["admission"] == "reserve":
            assert notes["preemptions"] == 0  # a reservation is never taken back
            assert notes["admission_waits"] > 0  # the pool is tight: not everyone fits
    assert rec["fastest"]["tokens_per_s"] == max(r["tokens_per_s"] for r in rec["runs"])


def test_pages_pool_too_small_for_one_request_is_a_failed_run(tiny_dir, capsys):
    argv = ["pages", "--model", str(tiny_dir), *PAGES_TINY[:-4], "--kv-cache-mib", "0.002"]
    assert bench_main(argv) == 1
    err = capsys.readouterr().err
    assert "pagedllm bench: error: --kv-cache-mib 0.002 holds" in err and "Traceback" not in err


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the missing package was found")

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    monkeypatch.setattr("pagedllm.bench.cli.load_model", no_load)
    assert bench_main(["pages", "--plot", str(tmp_path / "p.png")]) == 1
    err = capsys.readouterr().err
    # Issue 33, item 14: the command installs into this interpreter; from a clone the
    # extra is `-e '.[plot]'` (`pip install 'pagedllm[plot]'` did nothing there).
    assert f"{sys.executable} -m pip install matplotlib" in err
    assert "pip install -e '.[plot]'" in err and "pagedllm[plot]" not in err


def test_pages_plot_draws_pages_in_use(tiny_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot extra: pip install matplotlib")
    png = tmp_path / "pages.png"
    argv = ["pages", "--model", str(tiny_dir), *PAGES_TINY, "--plot", str(png)]
    assert bench_main([*argv, "--plot-page-size", "8"]) == 0
    rec = _last_json(capsys.readouterr().out)
    assert rec["plot"] == str(png) and rec["plot_page_size"] == 8
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_throughput_plot_draws_the_runs_pictures(tiny_dir, tmp_path, capsys):
    """`bench throughput --plot DIR`: the three pictures of one more (untimed) run
    of the workload, every request on the timeline; --plot is refused elsewhere."""
    plt = pytest.importorskip("matplotlib.pyplot", reason="the plot extra: pip install matplotlib")
    out = tmp_path / "run"
    argv = ["throughput", "--model", str(tiny_dir), *SMALL, *TINY_RUNS["throughput"]]
    assert bench_main([*argv, "--plot", str(out)]) == 0
    captured = capsys.readouterr()
    assert _last_json(captured.out)["plot"] == str(out)
    for name in ("pages.png", "timeline.png", "tokens.png"):
        assert f"wrote {out / name}" in captured.err
        image = plt.imread(out / name)
        assert image.shape[0] > 200 and image.shape[1] > 500 and image.std() > 0.05
    assert bench_main(["latency", "--model", str(tiny_dir), "--plot", str(out)]) == 2
    assert "--plot applies to pages and throughput only" in capsys.readouterr().err


def test_trace_pages_records_every_step(tiny_dir):
    """The figure of the plot: pages in use after each step, back to 0 at the end."""
    from pagedllm.bench import ours
    from pagedllm.bench.workloads import warmup_workload

    model = load_model(ModelSpec(str(tiny_dir), None, "auto"), "cpu", None)
    settings = {"kv_cache_mib": 0.02, "block_size": 8, "prefix_caching": False}
    llm = ours.build_llm(model, settings, lambda s: None)
    w = draw_throughput(6, 32, 8, 512)
    trace = ours.trace_pages(llm, w, warmup_workload(512))
    # One entry per step of the measured call (the warm-up's steps are not in it).
    assert max(w.max_tokens) <= len(trace) < llm.stats()["steps"]
    assert 0 < max(trace) <= llm.stats()["pages_total"] and trace[-1] == 0


def test_repeated_runs_are_not_served_from_the_prefix_cache(tiny_dir):
    """ttft and latency repeat one prompt: with prefix caching on (the default), each
    run must still prefill all of it, or the figure would time a cache hit."""
    from pagedllm.bench import ours
    from pagedllm.bench.workloads import warmup_workload

    model = load_model(ModelSpec(str(tiny_dir), None, "auto"), "cpu", None)
    for run, w in (
        (ours.run_ttft, ttft_workload(64, 512)),
        (ours.run_latency, latency_workload(48, 4, 512)),
    ):
        llm = ours.build_llm(model, {"kv_cache_mib": 4, "prefix_caching": True}, lambda s: None)
        run(llm, w, warmup_workload(512), 3)
        stats = llm.stats()
        assert stats["prefix_cache_query_tokens"] > 0 and stats["prefix_cache_hit_tokens"] == 0


# ------------------------------------------------- progress bar (issue 33, item 13)
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_measured_run_shows_its_tokens_on_a_terminal_only(tiny_dir, monkeypatch):
    """On a terminal a bar counts the measured run's output tokens; elsewhere (a log
    file) nothing is drawn and the engine is left as it is."""
    from pagedllm.bench import ours
    from pagedllm.bench.workloads import warmup_workload

    model = load_model(ModelSpec(str(tiny_dir), None, "auto"), "cpu", None)
    llm = ours.build_llm(model, {"kv_cache_mib": 1, "block_size": 8}, lambda s: None)
    w, warmup = draw_throughput(6, 32, 8, 512), warmup_workload(512)
    total = w.output_tokens

    log = io.StringIO()  # not a terminal
    monkeypatch.setattr(sys, "stderr", log)
    with ours.progress(llm, w, "pagedllm throughput"):
        assert "step" not in vars(llm.engine)
    assert ours.run_throughput(llm, w, warmup).output_tokens == total
    assert log.getvalue() == ""

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert ours.run_throughput(llm, w, warmup).output_tokens == total
    drawn = terminal.getvalue()
    assert "pagedllm throughput" in drawn and f"0/{total}" in drawn and "tok" in drawn
    assert "step" not in vars(llm.engine)  # the engine's own step again
