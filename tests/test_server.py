"""The HTTP server, end to end: a real uvicorn on a loopback port, the default
model (SmolLM2-135M on the CPU), and the official `openai` client, unchanged.

Oracles: the `LLM` API's greedy answer for the same prompt, and the
concatenation of a stream against the non-streamed answer.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from server_helpers import MODEL, Server, free_port  # noqa: E402

QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(smollm2):
    s = Server(smollm2)
    yield s
    s.stop()


class Reply:
    """An HTTP reply as plain values (urllib: no HTTP client package needed)."""

    def __init__(self, status: int, text: str) -> None:
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


def call(method: str, url: str, body=None, raw: bytes | None = None, headers=None) -> Reply:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return Reply(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read().decode())


def get(url: str, **kw) -> Reply:
    return call("GET", url, **kw)


def post(url: str, body=None, **kw) -> Reply:
    return call("POST", url, body, **kw)


def pages_settle(server: Server) -> None:
    """Every page free (or cached) within a few steps of the last request (the
    core's counters, as its last step message gave them)."""
    server.wait_for(
        lambda g: g.pages_used == 0 and g.running == g.waiting == 0, "every page free", 20
    )
    g = server.engine.gauges
    assert g.pages_free == g.pages_total


def test_models_health_version(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert get(server.url + "/health").json() == {"status": "ok"}
    assert "version" in get(server.url + "/version").json()


def test_chat_equals_the_python_api_and_the_stream(server, smollm2):
    client = server.client()
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=16, temperature=0
    )
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=smollm2, kv_cache_mib=16)
    want = llm.chat(QUESTION, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    assert reply.usage.completion_tokens == len(want.token_ids)
    assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    pages_settle(server)


def test_completions_prompts_n_stop_logprobs(server):
    client = server.client()
    out = client.completions.create(
        model=MODEL, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=8, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1] and all(c.text for c in out.choices)
    ids = client.completions.create(
        model=MODEL, prompt=[504, 3575, 282], max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 4
    many = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, n=3, temperature=1.0, seed=5
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    stopped = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"]
    )
    assert " 7" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    lp = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2
    )
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == 3 and all(v <= 0 for v in logprobs.token_logprobs)
    chat_lp = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat_lp.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) >= 2 for c in content)
    pages_settle(server)


def test_64_concurrent_streaming_clients_all_finish_with_their_lengths(server):
    client = server.client()

    def one(i: int) -> tuple[int, int, str]:
        max_tokens = 4 + i % 8
        stream = client.completions.create(
            model=MODEL,
            prompt=f"Count to {i}:",
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, finish, used = "", None, None
        for chunk in stream:
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "length" and text and "\ufffd" not in text
        return max_tokens, used, text

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    assert all(used == want for want, used, _ in results)
    # The same prompt at temperature 0 gives the same text, batched or not.
    alone = client.completions.create(
        model=MODEL,
        prompt="Count to 5:",
        max_tokens=9,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert results[5][2] == alone.choices[0].text
    pages_settle(server)


def test_closed_streams_free_their_pages(server):
    body = {
        "model": MODEL,
        "prompt": "Write a long story about a dragon.",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    for _ in range(8):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        r = conn.getresponse()
        for _ in range(4):
            r.readline()
        conn.close()  # the client goes away mid-stream
    pages_settle(server)
    text = get(server.url + "/metrics").text
    assert "pagedllm_kv_pages_used 0.0" in text
    # The weights' bytes, as the engine counts them (SmolLM2, float32 on the CPU).
    shown = re.search(r"^pagedllm_model_weight_bytes (\S+)$", text, flags=re.M)
    assert shown is not None and float(shown[1]) > 100e6
    assert get(server.url + "/health").status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
        ({"messages": QUESTION, "max_tokens": "ten"}, "max_tokens"),
        ({"messages": QUESTION, "temperature": -1}, "temperature"),
        ({"messages": QUESTION, "top_p": 0}, "top_p"),
        ({"messages": QUESTION, "n": 1000}, "n"),
        ({"messages": QUESTION, "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"messages": QUESTION, "presence_penalty": 5}, "presence_penalty"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": QUESTION, "stop": 7}, "stop"),
        ({"messages": QUESTION, "max_tokens": 10**9}, None),  # over the context
    ],
)
def test_bad_chat_requests_are_400_in_openai_shape(server, body, param):
    r = post(server.url + "/v1/chat/completions", {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"].startswith(param)


def test_malformed_json_unknown_model_and_the_client_errors(server):
    r = post(server.url + "/v1/chat/completions", raw=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["message"]
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=QUESTION, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    # A body over the limit is refused from its Content-Length, before it is read.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("content-type", "application/json")
    conn.putheader("content-length", str(5 << 20))
    conn.endheaders()
    big = conn.getresponse()
    assert big.status == 413 and json.loads(big.read())["error"]["code"] == 413
    conn.close()
    # Unknown fields are ignored, as OpenAI does.
    ok = post(
        server.url + "/v1/completions",
        {"prompt": "Hi", "max_tokens": 2, "frobnicate": True, "user": "me"},
    )
    assert ok.status_code == 200
    assert get(server.url + "/health").status_code == 200


def test_tokenize_and_detokenize(server):
    ids = post(server.url + "/tokenize", {"prompt": "Hello, world!"}).json()["tokens"]
    text = post(server.url + "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text.endswith("Hello, world!")
    bad = post(server.url + "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400
    # With messages: the chat template's ids, as the engine's tokenizer makes them.
    reply = post(server.url + "/tokenize", {"messages": QUESTION}).json()
    assert reply["tokens"] == server.engine.tokenizer.encode_chat(QUESTION)
    assert reply["count"] == len(reply["tokens"])
    assert reply["max_model_len"] == server.engine.max_model_len


@pytest.mark.parametrize(
    "stop",
    [
        [f"s{i}" for i in range(17)],  # more than 16 stop strings
        ["x" * 257],  # a stop string over 256 characters
        "x" * 257,
        [""],  # an empty stop string would stop everywhere
    ],
)
def test_stop_strings_are_bounded(server, stop):
    r = post(server.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stop": stop})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("stop")
    ok = post(
        server.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stop": ["y" * 256]}
    )
    assert ok.status_code == 200


def test_access_log_one_line_per_request_and_prompts_only_when_asked(smollm2):
    lines: list[str] = []
    s = Server(smollm2, app_options={"access_log": lines.append})
    try:
        client = s.client()
        secret = "The password is swordfish."
        # ignore_eos: at the default temperature an early EOS (drawn from the
        # global RNG, whose state earlier tests move) would make out= below 3.
        client.completions.create(
            model=MODEL, prompt=secret, max_tokens=3, extra_body={"ignore_eos": True}
        )
        for _ in client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=4,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            pass
        post(s.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 0})
        deadline = time.time() + 10
        while len(lines) < 3:
            assert time.time() < deadline, lines
            time.sleep(0.02)
        plain, stream, bad = lines
        assert '"POST /v1/completions" 200 in=' in plain and " out=3 " in plain
        assert '"POST /v1/chat/completions" 200' in stream and " out=4 " in stream
        assert stream.split()[-1].startswith("chatcmpl-")
        assert '"POST /v1/completions" 400' in bad
        assert not any("swordfish" in line for line in lines)
    finally:
        s.stop()
    lines.clear()
    s = Server(smollm2, app_options={"access_log": lines.append, "log_requests": True})
    try:
        s.client().completions.create(model=MODEL, prompt=secret, max_tokens=2)
        assert any("swordfish" in line and line.startswith("cmpl-") for line in lines)
    finally:
        s.stop()


def test_the_api_key_guards_v1_only(smollm2):
    s = Server(smollm2, api_key="sesame")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert [m.id for m in s.client("sesame").models.list().data] == [MODEL]
        assert get(s.url + "/health").status_code == 200
        r = get(s.url + "/v1/models")
        assert (
            r.status_code == 401 and json.loads(r.text)["error"]["type"] == "authentication_error"
        )
    finally:
        s.stop()


def test_pagedllm_serve_starts_answers_and_stops_on_sigterm(tmp_path):
    """The command itself: `python -m pagedllm serve` on a free port, then SIGTERM: exit 0."""
    import signal
    import subprocess
    import sys

    from pagedllm.resolve import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), "--kv-cache-mib", "32"]
    cmd += ["--served-model-name", "smol", "--api-key", "k"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(proc, port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        out = client.completions.create(
            model="smol", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output
    access = [line for line in output.splitlines() if "[access]" in line]
    assert any('"POST /v1/completions" 200 in=' in line and " out=3 " in line for line in access)
    assert "Hello" not in output  # no prompt text without --log-requests


def test_serve_random_weights_of_a_models_shape(tmp_path):
    """`--load-format dummy`: an HF directory's shape with random weights (what the
    GPU load test runs with a preset); with no tokenizer it takes token ids."""
    import subprocess
    import sys

    from tiny_models import make_tiny_llama_dir

    model_dir, _ = make_tiny_llama_dir(tmp_path / "tiny")
    for safetensors in model_dir.glob("*.safetensors"):
        safetensors.unlink()  # dummy weights need the config only
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm", "serve", "--port", str(port)]
    cmd += ["--model", str(model_dir), "--load-format", "dummy", "--kv-cache-mib", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(proc, port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.completions.create(
            model="tiny", prompt=[1, 2, 3], max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == 5
        with pytest.raises(openai.BadRequestError, match="token ids"):
            client.completions.create(model="tiny", prompt="text", max_tokens=2)
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "llama-3.2-1b"], "add --load-format dummy"),
        (["--preset", "llama-9", "--load-format", "dummy"], "unknown preset"),
        (["--preset", "llama-3.2-1b", "--model", "x", "--load-format", "dummy"], "not both"),
        (["--load-format", "dummy"], "needs --preset NAME or --model HF_DIRECTORY"),
    ],
)
def test_serve_model_source_usage_errors(capsys, argv, message):
    from pagedllm.server.cli import serve_main

    with pytest.raises(SystemExit) as e:
        serve_main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def _wait_healthy(proc, port: int) -> None:
    deadline = time.time() + 60
    while True:
        try:
            if get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except urllib.error.URLError:
            pass
        assert proc.poll() is None and time.time() < deadline, "serve did not come up"
        time.sleep(0.2)


def test_a_request_larger_than_the_queue_limit_is_a_400(smollm2):
    """n choices over --max-queued-requests could never run: a 400 naming n, not a
    503 "retry later" (a burst past the limit: tests/test_server_requests.py)."""
    s = Server(smollm2, max_queued=2)
    try:
        client = s.client()
        with pytest.raises(openai.BadRequestError, match="at most 2") as refused:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=3)
        assert refused.value.body["param"] == "n"
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=2).choices
    finally:
        s.stop()


@pytest.mark.parametrize(
    ("content", "lowest"),
    [
        ("Translate 'good morning' into Chinese characters.", 0x2E80),  # CJK
        ("日本の首都はどこですか？", 0x2E80),
        ("Reply with five emojis that describe summer.", 0x1F000),  # emoji: 4 bytes each
        ("What do these emojis mean: 🐍🔥🚀?", 0x1F000),
    ],
)
def test_cjk_and_emoji_streams_hold_split_characters_back(server, content, lowest):
    """CJK characters and emoji span several byte-level tokens: a stream never
    shows part of one (no U+FFFD) and adds up to the whole answer."""
    client = server.client()
    messages = [{"role": "user", "content": content}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    text = whole.choices[0].message.content
    assert any(ord(c) >= lowest for c in text), text  # the model answers in kind
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_a_cancellation_flood_frees_every_page(server):
    """200 streaming requests at once; half are closed after a few chunks. The
    others finish with their full length, and every page comes back."""
    body = {"model": MODEL, "max_tokens": 12, "ignore_eos": True, "stream": True}

    def one(i: int) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        payload = json.dumps({**body, "prompt": f"Request {i}: tell me about page tables."})
        conn.request("POST", "/v1/completions", payload, {"content-type": "application/json"})
        r = conn.getresponse()
        tokens = 0
        finish = None
        while True:
            line = r.readline()
            if not line:
                break
            if i % 2 and tokens >= 2:
                break  # the client goes away
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                tokens += 1
                finish = choice["finish_reason"] or finish
        conn.close()
        return -1 if i % 2 else (finish == "length")

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(200)))
    assert all(r is True for r in results[0::2])  # every kept stream ran to its length
    pages_settle(server)
    assert "pagedllm_kv_pages_used 0.0" in get(server.url + "/metrics").text


def test_a_new_request_starts_within_a_few_steps_under_load(server):
    """Handlers hand new requests to the stepping thread through a queue: one
    that waited for the engine's lock would starve while the thread steps
    back to back (it takes the lock again the moment it lets go)."""
    client = server.client()
    long = concurrent.futures.ThreadPoolExecutor(1)
    busy = long.submit(
        client.completions.create,
        model=MODEL,
        prompt="Tell a long story.",
        max_tokens=400,
        extra_body={"ignore_eos": True},
    )
    server.wait_for(lambda g: g.running > 0, "the long request runs")
    for _ in range(3):
        before = server.engine.gauges.steps
        stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True)
        next(iter(stream))
        waited = server.engine.gauges.steps - before
        stream.close()
        assert waited <= 4, f"the first token came {waited} steps after the request"
    assert busy.result().usage.completion_tokens == 400
    long.shutdown()
    pages_settle(server)
