"""What guards the server against clients (issue 33, items 7 and 8): the API
key on every route that does work (/v1/*, /tokenize, /detokenize; the scheme
`Bearer` in any case), large texts tokenized off the event loop, and timeouts
for connections that never finish their headers or their body, or sit idle.

A real uvicorn on a loopback port serving SmolLM2 on the CPU (server_helpers),
with short timeouts so each test takes about a second.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import random
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from server_helpers import MODEL, Server  # noqa: E402

JSON = {"content-type": "application/json"}
TIMEOUT = 0.5  # the header, body and keep-alive timeouts of the server below


@pytest.fixture(scope="module")
def server(smollm2):
    s = Server(
        smollm2,
        api_key="sesame",
        app_options={"body_timeout": TIMEOUT},
        server_options={"header_timeout": TIMEOUT, "keep_alive_timeout": TIMEOUT},
    )
    yield s
    s.stop()


def post(server: Server, path: str, body, authorization: str | None = "Bearer sesame"):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = dict(JSON)
    if authorization is not None:
        headers["authorization"] = authorization
    conn.request("POST", path, json.dumps(body), headers)
    r = conn.getresponse()
    reply = r.status, json.loads(r.read() or b"null")
    conn.close()
    return reply


def closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes `sock` (reading whatever it sends first)."""
    t0 = time.perf_counter()
    sock.settimeout(10)
    while sock.recv(4096):
        pass
    return time.perf_counter() - t0


# ------------------------------------------------------------ item 7
@pytest.mark.parametrize(
    ("path", "body"), [("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1, 2]})]
)
def test_tokenize_and_detokenize_need_the_key_in_any_case_of_bearer(server, path, body):
    assert post(server, path, body, authorization=None)[0] == 401
    assert post(server, path, body, authorization="Bearer wrong")[0] == 401
    assert post(server, path, body, authorization="Basic sesame")[0] == 401
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert post(server, path, body, authorization=f"{scheme} sesame")[0] == 200
    status, reply = post(server, path, body, authorization=None)
    assert reply["error"]["type"] == "authentication_error"


def test_the_official_client_and_the_open_routes(server):
    assert [m.id for m in server.client("sesame").models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").models.list()
    for path in ("/health", "/version", "/metrics"):  # for load balancers and scrapers
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", path)
        assert conn.getresponse().status == 200
        conn.close()


def test_a_large_text_is_tokenized_off_the_event_loop(server):
    """A 400 kB prompt (~1 s of tokenizing on a laptop CPU) runs on the tokenizer's
    thread: meanwhile the event loop answers at once; a short one stays inline."""
    tok = server.engine.tokenizer
    threads: list[str] = []
    encode = tok.encode

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    rng = random.Random(0)
    big = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(400_000))
    tok.encode = spy
    try:
        assert post(server, "/tokenize", {"prompt": "Hi"})[0] == 200
        assert threads == [server._t.name]  # the event loop's thread
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, server, "/tokenize", {"prompt": big})
            deadline = time.time() + 30
            while len(threads) < 2:  # the big one is being tokenized
                assert time.time() < deadline
                time.sleep(0.005)
            t0 = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            conn.request("GET", "/health")
            assert conn.getresponse().status == 200
            waited = time.perf_counter() - t0
            conn.close()
            status, reply = pending.result()
        assert status == 200 and reply["count"] > 10_000
        assert threads[1].startswith("pagedllm-tokenize")
        assert waited < 0.4, f"/health waited {waited:.2f} s behind the tokenizer"
    finally:
        del tok.encode


# ------------------------------------------------------------ item 8
@pytest.mark.parametrize(
    "sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"], ids=["nothing", "half"]
)
def test_a_connection_that_never_finishes_its_headers_is_closed(server, sent):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(sent)
        assert TIMEOUT * 0.8 < closed_after(sock) < TIMEOUT + 2


def test_a_body_that_never_finishes_gets_a_408(server):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer sesame\r\nContent-Length: 100\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + b'{"prompt": "')
        t0 = time.perf_counter()
        reply = sock.makefile("rb").read()  # to the close
        waited = time.perf_counter() - t0
    assert reply.startswith(b"HTTP/1.1 408 ")
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == 408 and "did not arrive" in error["message"]
    assert TIMEOUT * 0.8 < waited < TIMEOUT + 2


def test_idle_connections_close_and_slow_but_steady_ones_do_not(server):
    # A body in two parts, within the deadline; then the connection idles and closes.
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer sesame\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body[:5])
        time.sleep(TIMEOUT / 3)
        sock.sendall(body[5:])
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200 ")
        assert TIMEOUT * 0.8 < closed_after(sock) < TIMEOUT + 2  # keep-alive
    # A stream read slowly, for longer than every timeout: never cut.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"prompt": "Count:", "max_tokens": 8, "ignore_eos": True, "stream": True}
    conn.request(
        "POST", "/v1/completions", json.dumps(body), {**JSON, "authorization": "Bearer sesame"}
    )
    r = conn.getresponse()
    t0 = time.perf_counter()
    lines = []
    for line in r:
        lines.append(line)
        if line.startswith(b"data: "):
            time.sleep(0.15)
    assert time.perf_counter() - t0 > 2 * TIMEOUT
    assert lines[-2] == b"data: [DONE]\n"
    conn.close()
