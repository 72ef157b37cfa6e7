"""The server's start and end (issue 33, items 3 and 5; issue 34): a shutdown
ends the requests in flight cleanly (a stream with an error event and [DONE],
any other request with a 503) and exits 0; so does a dead engine core, and
the server then exits 1; a client that leaves a non-streamed request aborts it
without a traceback; a bad or busy address is refused in one line before the
model loads.

In-process servers (server_helpers) on SmolLM2, and `python -m pagedllm serve`
itself on a tiny random model directory (tiny_models).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from server_helpers import MODEL, Server, free_port  # noqa: E402

JSON = {"content-type": "application/json"}
SHUTDOWN = "shutting down"


def wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.02)


def open_stream(
    port: int, body: dict
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), JSON)
    r = conn.getresponse()
    assert r.status == 200
    return conn, r


def events(r: http.client.HTTPResponse) -> list[str]:
    """The data of every event left in a stream, to its end."""
    return [line[6:].strip().decode() for line in r if line.startswith(b"data: ")]


def assert_ended_cleanly(stream_events: list[str], refused: pytest.ExceptionInfo) -> None:
    assert stream_events[-1] == "[DONE]"
    error = json.loads(stream_events[-2])["error"]
    assert error["code"] == 503 and SHUTDOWN in error["message"]
    assert refused.value.status_code == 503
    assert refused.value.body["type"] == "server_error"
    assert SHUTDOWN in refused.value.body["message"]


# ------------------------------------------------------------ item 3
def test_shutdown_ends_requests_in_flight_with_an_error_event_and_a_503(smollm2):
    lines: list[str] = []
    s = Server(
        smollm2,
        app_options={"access_log": lines.append},
        server_options={"shutdown_timeout": 0.3},
    )
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        long = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 1000}
        conn, stream = open_stream(s.port, {**long, "ignore_eos": True})
        plain = pool.submit(s.client().completions.create, **long, extra_body={"ignore_eos": True})
        s.wait_for(lambda g: g.running == 2, "both requests run")
        t0 = time.time()
        s.server.should_exit = True  # what SIGTERM does
        rest = events(stream)
        with pytest.raises(openai.InternalServerError) as refused:
            plain.result(timeout=30)
        assert_ended_cleanly(rest, refused)
        s._t.join(10)
        assert not s._t.is_alive() and time.time() - t0 < 5
        conn.close()
    finally:
        pool.shutdown()
        s.stop()
    posts = [line for line in lines if '"POST /v1/completions"' in line]
    assert len(posts) == 2 and all(line.endswith(" ended at shutdown") for line in posts), posts
    assert not any("client closed" in line for line in lines)


def test_a_client_leaving_a_non_streamed_request_aborts_it_without_a_traceback(smollm2):
    lines: list[str] = []
    s = Server(smollm2, app_options={"access_log": lines.append})
    errors: list[logging.LogRecord] = []
    catch = logging.Handler(logging.ERROR)
    catch.emit = errors.append  # type: ignore[method-assign]
    logging.getLogger("uvicorn.error").addHandler(catch)
    try:
        body = {"prompt": "Tell a long story.", "max_tokens": 500, "ignore_eos": True}
        for _ in range(2):
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(body), JSON)
            s.wait_for(lambda g: g.running == 1, "the request runs")
            conn.close()  # the client goes away
            s.wait_for(lambda g: g.running == g.waiting == g.pages_used == 0, "it is aborted")
            wait_for(lambda: s.app.state.in_flight.count == 0, "its place is free again")
        wait_for(lambda: len(lines) == 2, "two access lines")
    finally:
        logging.getLogger("uvicorn.error").removeHandler(catch)
        s.stop()
    assert not errors, [e.getMessage() for e in errors]
    assert all('" 499 ' in line and line.endswith(" client closed") for line in lines), lines


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama with 8,192 positions: a long request runs for seconds."""
    from tiny_models import make_tiny_llama_dir

    path, _ = make_tiny_llama_dir(
        tmp_path_factory.mktemp("tiny") / "tiny", max_position_embeddings=8192
    )
    return path


def serve(args: list[str]) -> subprocess.Popen:
    """`pagedllm serve` in a process group of its own (with its engine core)."""
    cmd = [sys.executable, "-m", "pagedllm", "serve", *args]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


@contextlib.contextmanager
def two_requests_in_flight(tiny_dir, *args: str):
    """`pagedllm serve` on the tiny model with a stream and a plain request
    running (8,000 tokens each). Yields a dict: `proc`, `url`, `stream` (its
    response) and `plain` (the plain request's future); once the server has
    exited, `output` holds what it printed."""
    port = free_port()
    proc = serve(["--port", str(port), "--model", str(tiny_dir), *args])
    pool = concurrent.futures.ThreadPoolExecutor(1)
    run: dict = {"proc": proc, "url": f"http://127.0.0.1:{port}"}
    try:
        url = run["url"]
        wait_for(lambda: _healthy(url, proc), "serve came up", timeout=60)
        long = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8000}
        conn, run["stream"] = open_stream(port, {**long, "ignore_eos": True})
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        run["plain"] = pool.submit(
            client.completions.create, **long, extra_body={"ignore_eos": True}
        )
        wait_for(lambda: "pagedllm_requests_running 2.0" in _get(url + "/metrics"), "both run")
        yield run
        conn.close()
    finally:
        pool.shutdown()
        try:
            run["output"] = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            run["output"] = proc.communicate()[0]


def test_sigterm_ends_requests_in_flight_cleanly_and_exits_0(tiny_dir):
    """The command itself: SIGTERM (to its process group) with a stream and a
    plain request in flight and --shutdown-timeout 1: the stream gets an error
    event and [DONE], the plain one a 503; exit 0, no traceback, no "client
    closed"."""
    with two_requests_in_flight(tiny_dir, "--shutdown-timeout", "1") as run:
        # To the whole group, as `timeout` or a service manager sends it: the engine
        # core gets it too, and must leave the stopping to the HTTP process.
        os.killpg(run["proc"].pid, signal.SIGTERM)
        rest = events(run["stream"])
        with pytest.raises(openai.InternalServerError) as refused:
            run["plain"].result(timeout=30)
        assert_ended_cleanly(rest, refused)
    output = run["output"]
    assert run["proc"].returncode == 0, output
    assert "Traceback" not in output and "client closed" not in output, output
    posts = [line for line in output.splitlines() if '"POST /v1/completions"' in line]
    assert len(posts) == 2 and all(line.endswith(" ended at shutdown") for line in posts), output


def test_a_killed_engine_core_ends_every_request_and_the_server_exits_1(tiny_dir):
    """kill -9 of the engine-core process: /health answers 503 naming the cause
    within a second, a stream in flight gets an error event and [DONE], a plain
    request a 503 in OpenAI's shape, and `pagedllm serve` exits 1 with one line."""
    with two_requests_in_flight(tiny_dir) as run:
        os.kill(_core_pid(run["proc"].pid), signal.SIGKILL)
        t0 = time.time()
        with pytest.raises(urllib.error.HTTPError) as health:
            wait_for(lambda: _get(run["url"] + "/health") is None, "health stays 200", timeout=1)
        assert time.time() - t0 < 1.0 and health.value.code == 503
        assert "killed by SIGKILL" in health.value.read().decode()
        rest = events(run["stream"])
        assert rest[-1] == "[DONE]"
        assert "killed by SIGKILL" in json.loads(rest[-2])["error"]["message"]
        with pytest.raises(openai.APIStatusError) as refused:
            run["plain"].result(timeout=30)
        assert refused.value.status_code == 503 and refused.value.body["type"] == "server_error"
    output = run["output"]
    assert run["proc"].returncode == 1, output
    assert output.rstrip().splitlines()[-1] == (
        "pagedllm serve: error: the engine core stopped: the engine core was killed by SIGKILL"
    )
    assert "Traceback" not in output, output


def _core_pid(server_pid: int) -> int:
    """The engine-core process: the server's child (a spawned Python)."""
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    raise AssertionError(f"no engine-core process among {children}")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _healthy(url: str, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, proc.communicate()[0]
    try:
        return json.loads(_get(url + "/health")) == {"status": "ok"}
    except (urllib.error.URLError, ConnectionError):
        return False


# ------------------------------------------------------------ item 5
@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["--port", "70000"], 2, "argument --port: must be a port number from 1 to 65535"),
        (["--host", "256.1.1.1"], 2, "argument --host: must be an IPv4 or IPv6 address"),
        (["--host", "192.0.2.1"], 2, "argument --host: 192.0.2.1 is not an address of this"),
        (["--port", "BUSY"], 1, "is already in use"),
    ],
)
def test_a_bad_or_busy_address_is_refused_in_one_line_before_the_model_loads(
    tmp_path, args, code, words
):
    """The model named does not exist: an error about the address, not about the
    model, shows the address was checked first."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args = [str(busy.getsockname()[1]) if a == "BUSY" else a for a in args]
        t0 = time.time()
        proc = serve([*args, "--model", str(tmp_path / "no-such-model")])
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == code, output
    errors = [line for line in output.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("pagedllm serve: error: "), output
    assert words in errors[0]
    assert "Traceback" not in output and "serving" not in output
    assert time.time() - t0 < 10
