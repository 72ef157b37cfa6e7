"""The engine core in its own process (engine/core_process.py) and the HTTP
process's client of it (server/core_client.py), without HTTP.

Oracles: the offline `LLM` (the same engine class in one process) for greedy
and seeded tokens and text; the engine's own stop-string rules; the process
table for a core that must exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from pagedllm.engine_config import EngineConfig  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402
from pagedllm.scheduler import RequestRejected  # noqa: E402
from pagedllm.server.core_client import EngineCoreClient, EngineDead  # noqa: E402

QUESTION = [{"role": "user", "content": "Name three colours."}]


def _config(path) -> EngineConfig:
    return EngineConfig(
        model=str(path), kv_cache_mib=32, admission="optimistic", device="cpu", dtype="float32"
    )


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from pagedllm.tokenizer import Tokenizer

    return Tokenizer.from_model_path(smollm2_path)


@pytest.fixture(scope="module")
def client(smollm2_path, tokenizer):
    c = EngineCoreClient(_config(smollm2_path), tokenizer)
    c.start(timeout_s=120)
    yield c
    c.shutdown()
    assert c.process.exitcode == 0


def _run(client: EngineCoreClient, *jobs):
    """Each job (prompt ids, params) through the core, concurrently, on one
    event loop: [(token ids, text, finish reason, stop reason), ...]."""

    async def one(ids, params):
        toks, text = [], []
        out = None
        async for out in client.generate(ids, params):
            toks += out.new_token_ids
            text.append(out.new_text)
        return toks, "".join(text), str(out.request.finish_reason), out.request.stop_reason

    async def go():
        await client.attach()
        try:
            return await asyncio.gather(*(one(ids, p) for ids, p in jobs))
        finally:
            await _idle(client)
            await client.detach()

    return asyncio.run(go())


async def _idle(client: EngineCoreClient, timeout: float = 5.0) -> None:
    """Until the core's last message says that nothing runs and no page is held
    (an abort's final step comes after the handler has left)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        g = client.gauges
        if g is not None and g.running == g.waiting == g.pages_used == 0:
            return
        await asyncio.sleep(0.02)


def test_greedy_and_seeded_outputs_equal_the_offline_llm(client, smollm2, tokenizer):
    from pagedllm import LLM

    ids = tokenizer.encode_chat(QUESTION)
    other = tokenizer.encode("The capital of France is", add_special_tokens=True)
    greedy = SamplingParams(max_tokens=12, temperature=0)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    got = _run(client, (ids, greedy), (other, seeded), (ids, seeded))
    llm = LLM(model=smollm2, tokenizer=tokenizer, kv_cache_mib=32)
    want = llm.generate([ids, other, ids], [greedy, seeded, seeded])
    for (toks, text, reason, _), w in zip(got, want):
        assert toks == w.token_ids
        assert text == w.text
        assert reason == str(w.finish_reason)


def test_stop_strings_are_matched_in_the_client_and_abort_the_core(client, tokenizer, smollm2):
    from pagedllm import LLM

    ids = tokenizer.encode_chat(QUESTION)
    full = _run(client, (ids, SamplingParams(max_tokens=16, temperature=0)))[0][1]
    stop = full.split()[2]  # a word from the middle of the answer
    params = SamplingParams(max_tokens=16, temperature=0, stop=[stop])
    toks, text, reason, stop_reason = _run(client, (ids, params))[0]
    want = LLM(model=smollm2, tokenizer=tokenizer, kv_cache_mib=32).generate([ids], params)[0]
    assert (text, reason, stop_reason) == (want.text, "stop", stop)
    assert stop not in text and full.startswith(text)
    assert client.gauges.pages_used == 0


def test_a_request_too_long_is_rejected_and_the_core_goes_on(client, tokenizer):
    ids = list(range(5, 5 + 20_000))  # past the context (8192)

    with pytest.raises(RequestRejected, match="8192"):
        _run(client, (ids, SamplingParams(max_tokens=4)))
    toks = _run(client, ([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))[0][0]
    assert len(toks) == 4


def test_leaving_a_stream_early_frees_its_pages(client, tokenizer):
    ids = tokenizer.encode_chat(QUESTION)

    async def go():
        await client.attach()
        try:
            params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
            agen = client.generate(ids, params)
            await anext(agen)
            await anext(agen)
            await agen.aclose()  # the handler left: an Abort goes to the core
            await _idle(client)
        finally:
            await client.detach()

    asyncio.run(go())
    g = client.gauges
    assert g.running == 0 and g.pages_used == 0 and g.pages_free == g.pages_total


def _wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_killed_core_ends_every_request_and_names_the_cause(smollm2_path, tokenizer):
    c = EngineCoreClient(_config(smollm2_path), tokenizer)
    c.start(timeout_s=120)
    deaths = []
    c.on_death = deaths.append
    ids = tokenizer.encode_chat(QUESTION)

    async def go():
        await c.attach()
        agen = c.generate(ids, SamplingParams(max_tokens=600, ignore_eos=True))
        await anext(agen)
        t0 = time.monotonic()
        os.kill(c.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDead, match="SIGKILL"):
            async for _ in agen:
                pass
        noticed = time.monotonic() - t0
        with pytest.raises(EngineDead):
            await anext(c.generate(ids, SamplingParams(max_tokens=4)))
        await c.detach()
        return noticed

    noticed = asyncio.run(go())
    assert noticed < 1.0
    assert not c.alive and deaths and "SIGKILL" in deaths[0]
    c.shutdown()


def test_a_core_that_cannot_start_says_why_in_one_line(tmp_path, tokenizer):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 12)
    c = EngineCoreClient(EngineConfig(model=str(bad), device="cpu"), tokenizer)
    with pytest.raises(ValueError) as e:
        c.start(timeout_s=120)
    assert "\n" not in str(e.value) and "model.gguf" in str(e.value)
    assert c.process.exitcode == 1


def test_the_core_exits_when_the_http_process_dies(smollm2_path, tmp_path):
    """The parent (standing in for the HTTP process) starts a core, prints its
    pid, and is killed with SIGKILL: the core must not outlive it."""
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from pagedllm.engine_config import EngineConfig
        from pagedllm.server.core_client import EngineCoreClient
        if __name__ == "__main__":
            c = EngineCoreClient(EngineConfig(model={str(smollm2_path)!r}, kv_cache_mib=8,
                                              device="cpu", dtype="float32"))
            c.start(timeout_s=120)
            print(c.process.pid, flush=True)
            time.sleep(60)
        """
    )
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    core_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    assert _wait_for(lambda: not _alive(core_pid), timeout=10)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_the_core_takes_its_eos_ids_from_the_http_process(smollm2_path):
    """The core loads no tokenizer (`load_tokenizer=False`); the HTTP process sends
    the tokenizer's end-of-turn ids (`EosIds`), and requests added after them stop
    there: the same engine, in this process."""
    import msgspec

    from pagedllm.engine.core_process import EosIds, ToCore
    from pagedllm.engine.llm_engine import LLMEngine

    wire = msgspec.msgpack.Decoder(ToCore).decode(msgspec.msgpack.encode(EosIds([7, 9])))
    assert wire == EosIds([7, 9])
    engine = LLMEngine(_config(smollm2_path), log=lambda m: None, load_tokenizer=False)
    assert engine.tokenizer is None
    params = SamplingParams(max_tokens=6, temperature=0)

    def greedy() -> tuple[list[int], str | None]:
        req = engine.add_request([1, 504, 3287, 30], params, detokenize=False)
        while not req.is_finished:
            engine.step()
        return req.output_token_ids, req.finish_reason

    free, _ = greedy()
    engine.add_eos_token_ids([free[2], 10**9])  # an id past the vocabulary is ignored
    stopped, reason = greedy()
    assert stopped == free[:3] and str(reason) in ("stop", "FinishReason.STOP")
    engine.close()


def test_a_constrained_request_in_the_core_equals_the_offline_llm(client, smollm2, tokenizer):
    """The core loads the tokenizer for the constraint's vocabulary only when the
    first constrained request comes (on a thread, while it steps the others);
    the tokens are the offline LLM's."""
    pytest.importorskip("llguidance")
    from pagedllm import LLM

    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"}},
        "required": ["colour", "n"],
    }
    ids = tokenizer.encode_chat(QUESTION)
    params = SamplingParams(
        max_tokens=40, temperature=0, structured={"json": schema, "whitespace": "compact"}
    )
    plain = SamplingParams(max_tokens=8, temperature=0)
    (toks, text, reason, _), (plain_toks, *_) = _run(client, (ids, params), (ids, plain))
    want = LLM(model=smollm2, tokenizer=tokenizer, kv_cache_mib=32).generate(
        [ids, ids], [params, plain]
    )
    assert toks == want[0].token_ids and reason == "stop"
    assert set(json.loads(text)) == {"colour", "n"}
    assert plain_toks == want[1].token_ids
