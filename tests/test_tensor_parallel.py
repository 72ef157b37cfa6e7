"""Tensor parallelism on the CPU: two processes over gloo, each with half of the
model, against the whole model in this process.

Oracle: the same model loaded whole (TP=1), itself proven against transformers
elsewhere (test_model_parity.py). Float32, so the sharded sums may differ from
the whole ones only by summation order.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from pagedllm.model import load_model
from pagedllm.model.parallel import TensorParallel, check_divisible, shard_config, shard_weight
from tiny_models import make_tiny_llama_dir

PROMPTS = [[5, 9, 13, 2, 7, 7, 30, 11, 4], [1, 300, 2, 509, 44], list(range(40, 77))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, paths: list[str], out_dir: str) -> None:
    """One rank: load its shard of each model, run forward_logits and an engine."""
    import torch.distributed as dist

    from pagedllm import SamplingParams
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine_config import EngineConfig

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        result = {}
        for path in paths:
            model = load_model(path, "cpu", "float32", tp=TensorParallel(rank, size))
            logits = model.forward_logits(PROMPTS[0])
            # Every rank runs the same engine steps (the same plan each step), so the
            # collectives inside the forward passes line up: paged prefill + decode.
            engine = LLMEngine(
                EngineConfig(kv_cache_mib=1, block_size=4), model, log=lambda m: None
            )
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
            reqs = [engine.add_request(p, params) for p in PROMPTS]
            while engine.has_unfinished():
                engine.step()
            tokens = [r.output_token_ids for r in reqs]
            k_cache = engine.runner.kv_caches[0][0]
            result[path] = {
                "logits": logits.tolist(),
                "tokens": tokens,
                "kv_heads": k_cache.shape[2],
                "embed_rows": model.embed_tokens.shape[0],
            }
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    untied, _ = make_tiny_llama_dir(root / "untied", seed=3, num_key_value_heads=2, vocab_size=511)
    tied, _ = make_tiny_llama_dir(
        root / "tied", seed=4, num_key_value_heads=2, tie_word_embeddings=True
    )
    return [str(untied), str(tied)]


def whole_model_results(path: str) -> dict:
    from pagedllm import SamplingParams
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine_config import EngineConfig

    model = load_model(path, "cpu", "float32")
    engine = LLMEngine(EngineConfig(kv_cache_mib=1, block_size=4), model, log=lambda m: None)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    reqs = [engine.add_request(p, params) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    return {
        "logits": model.forward_logits(PROMPTS[0]),
        "tokens": [r.output_token_ids for r in reqs],
        "kv_heads": engine.runner.kv_caches[0][0].shape[2],
    }


def test_two_ranks_over_gloo_equal_one(models, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(2, free_port(), models, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for path in models:
        whole = whole_model_results(path)
        for r in ranks:
            got = r[path]
            torch.testing.assert_close(
                torch.tensor(got["logits"]), whole["logits"], rtol=1e-4, atol=1e-4
            )
            assert got["tokens"] == whole["tokens"]
            assert got["kv_heads"] * 2 == whole["kv_heads"]  # each rank caches half the heads
    # Vocabulary-parallel rows: ceil(511 / 2) = 256 per rank, the last one padded.
    assert ranks[0][models[0]]["embed_rows"] == ranks[1][models[0]]["embed_rows"] == 256


def test_shard_weight_slices():
    tp = TensorParallel(1, 2)
    w = torch.arange(6 * 4).reshape(6, 4)
    assert torch.equal(shard_weight("model.layers.0.self_attn.q_proj.weight", w, tp), w[3:])
    assert torch.equal(shard_weight("model.layers.3.mlp.down_proj.weight", w, tp), w[:, 2:])
    assert torch.equal(shard_weight("model.layers.0.input_layernorm.weight", w, tp), w)
    emb = torch.ones(5, 3)  # 5 rows over 2 ranks: 3 each, the last padded with zeros
    got = shard_weight("model.embed_tokens.weight", emb, tp)
    assert got.shape == (3, 3) and got[:2].eq(1).all() and got[2].eq(0).all()
    assert tp.vocab_rows(5) == (3, 6)
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        TensorParallel(2, 2)


def test_indivisible_sizes_are_refused_with_the_choices(models):
    config = load_model(models[0], "cpu", "float32").config  # 4 heads, 2 KV heads, I = 128
    assert shard_config(config, 2).num_key_value_heads == 1
    with pytest.raises(ValueError, match=r"does not divide the model's 2 KV heads.*one of 1, 2"):
        check_divisible(config, 4)
    with pytest.raises(ValueError, match="positive integer"):
        check_divisible(config, 0)


# ---------------------------------------------------------------- the engine
def test_llm_with_two_ranks_equals_one(models):
    """`LLM(..., tensor_parallel_size=2)`: rank 0 here, one worker process; greedy
    tokens and log-probs equal the one-process engine's, each rank caches half
    the KV heads, and close() leaves no process behind."""
    from pagedllm import LLM, SamplingParams

    sp = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=1
    )
    settings = dict(device="cpu", dtype="float32", kv_cache_mib=1, block_size=4)
    one = LLM(models[0], **settings)
    want = one.generate(PROMPTS, sp)
    with LLM(models[0], tensor_parallel_size=2, **settings) as two:
        procs = two.engine.workers.procs
        assert [p.is_alive() for p in procs] == [True]
        pids = [p.pid for p in procs]
        got = two.generate(PROMPTS, sp)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for g, w in zip(got, want):
            assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(
                g.prompt_token_ids
            )
            for gl, wl in zip(
                g.logprobs + g.prompt_logprobs[1:], w.logprobs + w.prompt_logprobs[1:]
            ):
                assert gl.keys() == wl.keys()
                assert all(abs(gl[t] - wl[t]) < 1e-4 for t in gl)
        shape = two.engine.runner.kv_caches[0][0].shape
        assert shape[2] * 2 == one.engine.runner.kv_caches[0][0].shape[2]
        again = two.generate(PROMPTS[:1], sp)  # the prefix cache serves rank 0 and 1 alike
        assert again[0].token_ids == want[0].token_ids
    for pid in pids:  # gone: stopped, reaped, their pipes closed
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    two.close()  # twice is fine
    with pytest.raises(RuntimeError, match="was closed; build a new one"):
        two.generate(PROMPTS[:1], sp)


def test_the_last_layer_shortcut_and_a_trace_agree_across_ranks(models):
    """A prefill step computes its last layer for the logits rows only, on every
    rank alike; a trace (a tracer on rank 0's model only) makes every rank
    compute every row. Both give the one-process engine's tokens and log-probs."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.trace import trace_steps

    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    settings = dict(device="cpu", dtype="float32", kv_cache_mib=1, block_size=4)
    one = LLM(models[0], **settings)
    want = one.generate(PROMPTS, sp)
    want_trace = trace_steps(one.engine, PROMPTS[:1], sp, steps=2)
    with LLM(models[0], tensor_parallel_size=2, **settings) as two:
        got = two.generate(PROMPTS, sp)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for g, w in zip(got, want):
            for gl, wl in zip(g.logprobs, w.logprobs):
                assert gl.keys() == wl.keys()
                assert all(abs(gl[t] - wl[t]) < 1e-4 for t in gl)
        trace = trace_steps(two.engine, PROMPTS[:1], sp, steps=2)
        assert [r["sampled"] for r in trace] == [r["sampled"] for r in want_trace]
        assert two.generate(PROMPTS[:1], sp)[0].token_ids == want[0].token_ids


def test_async_scheduling_with_two_ranks_equals_one(models):
    """Async scheduling with tensor parallelism: a queued decode step's input ids
    are sampled on rank 0 and reach the worker by a broadcast. Greedy tokens and
    log-probs equal the one-process engine run without it."""
    from pagedllm import LLM, SamplingParams

    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    settings = dict(device="cpu", dtype="float32", kv_cache_mib=1, block_size=4)
    want = LLM(models[0], async_scheduling=False, **settings).generate(PROMPTS, sp)
    with LLM(models[0], tensor_parallel_size=2, async_scheduling=True, **settings) as two:
        got = two.generate(PROMPTS, sp)
        alone = two.generate(PROMPTS[:1], sp)  # batch 1: every decode step queued ahead
        stats = two.stats()
    assert stats["async_scheduling"] and stats["steps_planned_ahead"] > 10
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert alone[0].token_ids == want[0].token_ids
    for g, w in zip(got, want):
        for gl, wl in zip(g.logprobs, w.logprobs):
            assert gl.keys() == wl.keys()
            assert all(abs(gl[t] - wl[t]) < 1e-4 for t in gl)


def test_what_cannot_work_is_refused_before_any_process_starts(models):
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine_config import EngineConfig

    config = EngineConfig(model=models[0], device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide .* 2 KV heads"):
        LLMEngine(config, log=lambda m: None)
    model = load_model(models[0], "cpu", "float32")
    with pytest.raises(ValueError, match="give the model's path"):
        LLMEngine(config.replace(tensor_parallel_size=2), model, log=lambda m: None)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)


WORKER_DIES = """
import os, sys, time
from pagedllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", kv_cache_mib=1, tensor_parallel_size=2)
    llm.generate([[5, 9, 13]], SamplingParams(max_tokens=2))
    print(llm.engine.workers.procs[0].pid, flush=True)
    while True:  # keep stepping: the engine must not hang once its worker is gone
        llm.generate([[5, 9, 13]], SamplingParams(max_tokens=4, ignore_eos=True))
        time.sleep(0.01)
"""


def test_a_worker_that_dies_ends_the_engine_loudly(models, tmp_path):
    """SIGKILL the worker mid-run: rank 0 reports the rank and exits 1, no hang."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "dies.py"
    script.write_text(WORKER_DIES)
    proc = subprocess.Popen(
        [sys.executable, str(script), models[0]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        worker = int(proc.stdout.readline())
        os.kill(worker, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "tensor-parallel worker rank 1 exited with code -9" in err


def test_a_rank_of_the_gguf_holds_its_slices(smollm2, smollm2_path):
    """Rank 1 of 3 loading the default GGUF (9 heads, 3 KV heads, I = 1536): its
    weights are the whole model's rows and columns for that rank, no more."""
    part = load_model(smollm2_path, "cpu", "float32", tp=TensorParallel(1, 3))
    whole, c = smollm2, smollm2.config
    d, e = c.head_dim, c.hidden_size
    assert (part.config.num_attention_heads, part.config.num_key_value_heads) == (3, 1)
    qkv = whole.layers[0].qkv_proj.weight  # (q | k | v, E)
    q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size])
    want = torch.cat([q[3 * d : 6 * d], k[d : 2 * d], v[d : 2 * d]])
    assert torch.equal(part.layers[0].qkv_proj.weight, want)
    assert torch.equal(
        part.layers[0].o_proj.weight, whole.layers[0].o_proj.weight[:, 3 * d : 6 * d]
    )
    gate, up = whole.layers[0].gate_up_proj.weight.split(c.intermediate_size)
    i = c.intermediate_size // 3
    assert torch.equal(
        part.layers[0].gate_up_proj.weight, torch.cat([gate[i : 2 * i], up[i : 2 * i]])
    )
    assert torch.equal(
        part.layers[0].down_proj.weight, whole.layers[0].down_proj.weight[:, i : 2 * i]
    )
    v3 = c.vocab_size // 3
    assert torch.equal(part.embed_tokens, whole.embed_tokens[v3 : 2 * v3])
    assert part.embed_tokens.shape == (v3, e) and torch.equal(part.norm, whole.norm)


def test_dummy_weights_are_made_per_rank(models):
    """load_format="dummy" with two ranks: each makes only its slice (the shape
    from config.json), and the engine runs; the same seed gives the same run."""
    from pagedllm import LLM, SamplingParams

    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    settings = dict(device="cpu", dtype="float32", kv_cache_mib=1, load_format="dummy")
    runs = []
    for _ in range(2):
        with LLM(models[1], tensor_parallel_size=2, **settings) as llm:
            whole = llm.engine.model.config  # rank 0's: half the heads and MLP width
            assert (whole.num_attention_heads, whole.intermediate_size) == (2, 64)
            assert llm.engine.model.embed_tokens.shape[0] == 256  # 512 / 2 rows
            runs.append([o.token_ids for o in llm.generate(PROMPTS, sp)])
    assert runs[0] == runs[1] and all(len(t) == 5 for t in runs[0])
    with pytest.raises(ValueError, match="takes its shape from an HF directory"):
        load_model(None, "cpu", load_format="dummy")  # the default model is a .gguf file


def test_the_server_reports_a_dead_worker_on_health(models):
    """pagedllm serve with two ranks: it serves; when the worker dies, /health turns
    503 naming the rank, and new requests are refused (the process stays up)."""
    import os
    import signal
    import time
    import urllib.error
    import urllib.request

    from server_helpers import Server

    server = Server(None, path=models[0], device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        client = server.client()
        done = client.completions.create(  # greedy, EOS ignored: no chance of a short answer
            model="smollm2-test",
            prompt=[5, 9, 13],
            max_tokens=3,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert done.usage.completion_tokens == 3 and done.choices[0].finish_reason == "length"
        with urllib.request.urlopen(server.url + "/health") as r:
            assert r.status == 200
        os.kill(server.engine.ready.worker_pids[0], signal.SIGKILL)
        deadline = time.time() + 20
        while True:
            try:
                urllib.request.urlopen(server.url + "/health").close()
            except urllib.error.HTTPError as e:
                body = e.read().decode()
                assert e.code == 503 and "worker rank 1 exited with code -9" in body
                break
            assert time.time() < deadline, "/health stayed 200"
            time.sleep(0.1)
        import openai

        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="smollm2-test", prompt=[5, 9], max_tokens=2)
        assert refused.value.status_code == 503
    finally:
        server.stop()


def test_a_rank0_failure_mid_step_stops_the_workers_not_the_process(models):
    """Rank 0 raises inside a forward pass the worker had started: the call raises,
    the workers are stopped at once (no watchdog exit later), every later call says
    the engine must be rebuilt, and a new engine works."""
    from pagedllm import LLM, SamplingParams

    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    settings = dict(device="cpu", dtype="float32", kv_cache_mib=1, tensor_parallel_size=2)
    llm = LLM(models[0], **settings)
    failures = []
    llm.engine.workers.on_failure = failures.append
    pids = [p.pid for p in llm.engine.workers.procs]

    def boom(layer, name, t):
        raise RuntimeError("injected on rank 0")

    llm.engine.model.tracer = boom
    with pytest.raises(RuntimeError, match="injected on rank 0"):
        llm.generate(PROMPTS[:1], sp)
    llm.engine.model.tracer = None
    with pytest.raises(RuntimeError, match="out of step: build a new engine"):
        llm.generate(PROMPTS[:1], sp)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert failures == []  # their exit was asked for
    llm.close()
    with LLM(models[0], **settings) as again:
        assert len(again.generate(PROMPTS[:1], sp)[0].token_ids) == 4


def test_an_engine_dropped_without_close_stops_its_workers(models):
    import gc

    from pagedllm import LLM

    llm = LLM(models[0], device="cpu", dtype="float32", kv_cache_mib=1, tensor_parallel_size=2)
    pid = llm.engine.workers.procs[0].pid
    del llm
    gc.collect()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_bad_dtype_is_refused_before_any_process_starts(models):
    import multiprocessing as mp

    from pagedllm import LLM

    with pytest.raises(ValueError, match="dtype"):
        LLM(models[0], device="cpu", dtype="float13", tensor_parallel_size=2)
    assert mp.active_children() == []


def test_bench_runs_a_tensor_parallel_engine(models, capsys):
    """pagedllm bench latency / throughput --tensor-parallel-size 2: every rank loads
    its slice; the record is the run's; what cannot work is a usage error."""
    import json as json_

    from pagedllm.bench.cli import bench_main

    base = ["--model", models[0], "--device", "cpu", "--dtype", "float32", "--threads", "1"]
    base += ["--kv-cache-mib", "1", "--tensor-parallel-size", "2", "--peer", "none"]
    argv = ["latency", *base, "--prompt-len", "8", "--output-len", "4"]
    assert bench_main(argv) == 0
    record = json_.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["output_tokens"] == 4 and record["options"]["tensor_parallel_size"] == 2
    argv = ["throughput", *base, "--num-requests", "4", "--max-prompt-len", "16"]
    assert bench_main([*argv, "--max-output-len", "4"]) == 0
    assert json_.loads(capsys.readouterr().out.strip().splitlines()[-1])["output_tokens"] > 0
    assert bench_main(["pages", *base]) == 2
    assert "with --tensor-parallel-size run throughput" in capsys.readouterr().err
    assert bench_main(["latency", *base[:-2], "--peer", "hf"]) == 2
    assert "add --peer none" in capsys.readouterr().err


def test_the_pool_is_planned_from_the_least_free_memory_of_any_rank():
    """A tensor-parallel engine passes the least free memory of its ranks
    (`TensorParallel.min_over_ranks`, joined by every worker after loading), so
    every rank can hold the same pool; the sentence says so. (A stand-in CUDA
    model: only its config, dtype and device type are read.)"""
    from types import SimpleNamespace

    import torch

    from pagedllm.runner.model_runner import MiB, plan_kv_cache

    model = SimpleNamespace(
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        config=SimpleNamespace(kv_bytes_per_token=lambda itemsize: 1024 * itemsize),
    )
    free = 20 * 1024 * MiB
    spec, why = plan_kv_cache(model, 16, None, 1 << 20, 4096, free_bytes=free, ranks=2)
    per_page = 16 * 2048
    assert spec.num_blocks == (int(free * 0.85) - 2 * 1024 * MiB) // per_page
    assert (
        why
        == "85% of the least free GPU memory of 2 ranks (20.0 GiB free) less 2 GiB for activations"
    )
