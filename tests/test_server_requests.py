"""The server's answers to what clients send (issue 33, items 1, 2, 4, 6): the
default max_tokens on a KV cache smaller than the context, --max-queued-requests
under a burst, text that is not valid Unicode, and error messages that name
the parameter and nothing of the engine's insides.

A real uvicorn on a loopback port serving SmolLM2 on the CPU (server_helpers),
with a 4 MiB KV cache: fewer tokens than the 8,192 of the context. Oracles: the
block manager's page count, the official `openai` client.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from server_helpers import MODEL, Server  # noqa: E402

SAY_HI = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def server(smollm2):
    s = Server(smollm2, kv_cache_mib=4)
    yield s
    s.stop()


def pool_tokens(server: Server) -> int:
    return server.engine.pool_tokens


def request(server: Server, method: str, path: str, body=None, raw: bytes | None = None, conn=None):
    """(status, headers, parsed JSON) of one request; `conn`: a kept-alive connection."""
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"content-type": "application/json"} if data is not None else {}
    conn.request(method, path, data, headers)
    r = conn.getresponse()
    text = r.read().decode()
    if own:
        conn.close()
    return r.status, dict(r.getheaders()), json.loads(text) if text else None


# ------------------------------------------------------------ item 1
def test_the_readme_chat_example_answers_on_a_pool_smaller_than_the_context(server):
    """No max_tokens: the default is the room left in the context, capped at what
    the pool can ever hold for this prompt, so the request is never refused."""
    assert pool_tokens(server) < server.engine.max_model_len  # the README's situation
    client = server.client()
    reply = client.chat.completions.create(model=MODEL, messages=SAY_HI, temperature=0)
    assert reply.choices[0].message.content
    prompt = reply.usage.prompt_tokens
    assert reply.usage.completion_tokens <= pool_tokens(server) - prompt + 1
    # Made to run to the limit (a long prompt, so that the limit is near): it
    # stops there, with finish_reason "length".
    long_prompt = [{"role": "user", "content": "Say hi to " + "Anna, Bob, Carl, " * 6}]
    longest = client.chat.completions.create(
        model=MODEL, messages=long_prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    prompt = longest.usage.prompt_tokens
    assert pool_tokens(server) - prompt + 1 < 20  # near the end of the pool
    assert longest.choices[0].finish_reason == "length"
    assert longest.usage.completion_tokens == pool_tokens(server) - prompt + 1


# ------------------------------------------------------------ item 2
def test_the_queue_cap_holds_under_a_burst_and_a_503_says_when_to_retry(smollm2):
    """64 streams at once against a cap of 8: exactly 8 run, 56 get a 503 with
    Retry-After (the count includes requests still on their way to the stepping
    thread); a request larger than the cap itself is a 400 naming n."""
    s = Server(smollm2, max_queued=8)
    try:
        statuses: list[tuple[int, dict]] = []
        lock = threading.Lock()
        answered = threading.Barrier(64)
        body = {"prompt": "Count:", "max_tokens": 50, "ignore_eos": True, "stream": True}

        def one(_: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
            conn.request(
                "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
            )
            r = conn.getresponse()  # a stream's headers come with its first token
            with lock:
                statuses.append((r.status, dict(r.getheaders())))
            answered.wait()  # the accepted streams stay open until every request has an answer
            conn.close()

        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            list(pool.map(one, range(64)))
        accepted = [h for status, h in statuses if status == 200]
        refused = [h for status, h in statuses if status == 503]
        assert len(accepted) == 8 and len(refused) == 56
        assert all(h.get("retry-after") == "1" for h in refused)
        # The accepted streams' clients went away: their places are free again.
        deadline = time.time() + 20
        while s.app.state.in_flight.count:
            assert time.time() < deadline, "closed streams still counted"
            time.sleep(0.02)
        # One request that could never fit the cap: not "retry later".
        status, _, reply = request(
            s, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": 8}
        )
        assert status == 200
        status, _, reply = request(
            s, "POST", "/v1/completions", {"prompt": [[1, 2], [3, 4]] * 5, "max_tokens": 2}
        )
        assert status == 400 and reply["error"]["param"] == "prompt"
        assert "at most 8" in reply["error"]["message"]
    finally:
        s.stop()


# ------------------------------------------------------------ item 4
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "a\ud800b"], "max_tokens": 2}, "prompt.1"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 2, "stop": ["\udc00"]}, "stop.0"),
        ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, None),
    ],
)
def test_a_lone_surrogate_is_a_400_and_the_connection_stays_open(server, path, body, param):
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as "\ud800"
    assert b"\\ud800" in raw or b"\\udc00" in raw
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        status, _, reply = request(server, "POST", path, raw=raw, conn=conn)
        assert status == 400, reply
        error = reply["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == (param or "messages.0.content")
        assert "Unicode" in error["message"]
        # The same connection answers the next request: nothing was dropped.
        status, _, ok = request(server, "POST", "/tokenize", {"prompt": "ab"}, conn=conn)
        assert status == 200 and ok["count"] >= 1
    finally:
        conn.close()


# ------------------------------------------------------------ item 6
def test_the_engines_refusals_name_the_parameter_and_not_the_request_counter(server):
    context = server.engine.max_model_len
    cases = [
        # max_tokens over the context: the field to lower
        ("/v1/completions", {"prompt": "Hi", "max_tokens": context}, "max_tokens", "max_model_len"),
        (
            "/v1/chat/completions",
            {"messages": SAY_HI, "max_completion_tokens": context},
            "max_completion_tokens",
            "max_model_len",
        ),
        # within the context, over the whole KV cache
        ("/v1/completions", {"prompt": "Hi", "max_tokens": context - 100}, "max_tokens", "KV"),
        # the prompt itself: over the context, or outside the vocabulary
        ("/v1/completions", {"prompt": [5] * context, "max_tokens": 1}, "prompt", "max_model_len"),
        ("/v1/completions", {"prompt": [10**6], "max_tokens": 1}, "prompt", "vocabulary"),
    ]
    for path, body, param, words in cases:
        status, _, reply = request(server, "POST", path, body)
        assert status == 400, (body, reply)
        error = reply["error"]
        assert error["param"] == param, (body, error)
        assert words in error["message"]
        assert not re.search(r"\brequest \d+", error["message"]), error["message"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "Hi", "stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16"),
        ({"prompt": "Hi", "stop": 7}, "stop", "a list of at most 16 strings"),
        ({"prompt": {"text": "Hi"}}, "prompt", "a list of token ids"),
        ({"prompt": "Hi", "stop": ["x" * 300]}, "stop.0", "at most 256 characters"),
    ],
)
def test_union_fields_are_named_with_the_error_of_the_branch_that_fits(server, body, param, words):
    status, _, reply = request(server, "POST", "/v1/completions", {"max_tokens": 2, **body})
    assert status == 400
    error = reply["error"]
    assert error["param"] == param and words in error["message"], error
    assert "str" not in error["param"] and "constrained" not in error["message"]


def test_an_image_part_and_an_empty_body_say_what_is_wrong(server):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    body = {"messages": [{"role": "user", "content": [image]}]}
    status, _, reply = request(server, "POST", "/v1/chat/completions", body)
    assert status == 400
    error = reply["error"]
    assert error["param"] == "messages.0.content.0.type"
    assert "'text'" in error["message"] and "'image_url'" in error["message"]
    status, _, reply = request(server, "POST", "/v1/chat/completions", raw=b"")
    assert status == 400 and "no body" in reply["error"]["message"]
    status, _, reply = request(server, "POST", "/v1/chat/completions", raw=b"[1, 2]")
    assert status == 400 and "JSON object" in reply["error"]["message"]
    # The official client sees the same: an error that names the field.
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt="Hi", stop=["s"] * 17)
    assert e.value.body["param"] == "stop"
