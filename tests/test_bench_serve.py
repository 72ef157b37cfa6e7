"""`pagedllm bench serve`, the HTTP load generator: against a real pagedllm
server (uvicorn on a loopback port, SmolLM2-135M on the CPU), and its HTTP and
SSE reading against tiny servers written here that frame a body awkwardly.

Oracles: the draw's sum of max_tokens (every request makes exactly that many
tokens, EOS ignored); numpy.percentile for the percentiles; the events a
server sent, for what the reader gets back however the bytes were split.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import random
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("uvicorn")

from pagedllm.bench import serve_bench, workloads  # noqa: E402
from pagedllm.bench.cli import bench_main  # noqa: E402
from pagedllm.bench.workloads import draw_throughput  # noqa: E402
from server_helpers import MODEL, Server, free_port  # noqa: E402

PROG_ERROR = "pagedllm bench serve: error:"


@pytest.fixture(scope="module")
def server(smollm2):
    s = Server(smollm2)
    yield s
    s.stop()


# ---------------------------------------------------------------- against pagedllm serve
def test_runs_the_draw_at_each_rate(server, capsys, tmp_path):
    path = tmp_path / "serve.json"
    argv = ["--base-url", server.url, "--num-requests", "6", "--max-prompt-len", "32"]
    argv += ["--max-output-len", "8", "--request-rate", "inf,40", "--max-concurrency", "4"]
    assert bench_main(["serve", *argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    record = json.loads(out[-1])
    assert json.loads(path.read_text()) == record
    assert record["bench"] == "serve" and record["model"] == MODEL
    assert record["base_url"] == server.url
    work = draw_throughput(6, 32, 8)
    assert record["workload"]["max_tokens_sum"] == sum(work.max_tokens)
    assert [run["request_rate"] for run in record["runs"]] == ["inf", 40.0]
    for run in record["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0 and run["first_error"] is None
        assert run["output_tokens"] == sum(work.max_tokens)  # exact: EOS is ignored
        assert run["prompt_tokens"] == work.prompt_tokens
        assert run["max_concurrency"] == 4 and 1 <= run["max_concurrency_observed"] <= 4
        assert run["duration_s"] > 0
        assert run["request_throughput"] == pytest.approx(6 / run["duration_s"], rel=1e-3)
        total = (run["prompt_tokens"] + run["output_tokens"]) / run["duration_s"]
        assert run["total_tokens_per_s"] == pytest.approx(total, rel=1e-3)
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = run[metric]
            assert 0 <= s["p50"] <= s["p90"] <= s["p99"], (metric, s)
        for key in ("mean", "p50", "p90", "p99"):  # each request's TTFT <= its E2E
            assert run["ttft_ms"][key] <= run["e2e_ms"][key]
    # The table: a header, then one row per rate, in order.
    header = next(i for i, line in enumerate(out) if "TTFT p50" in line)
    rows = out[header + 1 : -1]
    assert [row.split()[0] for row in rows] == ["inf", "40"]


def test_a_wrong_model_name_fails_at_the_warm_up(server, capsys):
    code = serve_bench.main(["--base-url", server.url, "--model", "nope", "--num-requests", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith(f"{PROG_ERROR} the warm-up request") and "HTTP 404" in err[-1]


# ---------------------------------------------------------------- errors
def test_an_unreachable_server_is_one_line_and_exit_1(capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    assert bench_main(["serve", "--base-url", url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(PROG_ERROR)
    assert f"{url}/v1/models" in err[0] and "--base-url" in err[0]


def test_a_refusing_server_is_one_line_and_exit_1(capsys):
    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"error": {"message": "a missing or wrong API key"}}).encode()
            self.send_response(401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Refuse)
    t = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    t.start()
    try:
        code = serve_bench.main(["--base-url", f"http://127.0.0.1:{httpd.server_port}"])
    finally:
        httpd.shutdown()
        httpd.server_close()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith(PROG_ERROR)
    assert "HTTP 401: a missing or wrong API key" in err[0] and "--api-key" in err[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["--request-rate", "0"],
        ["--request-rate", "1,fast"],
        ["--request-rate", "-inf"],
        ["--request-rate", "nan"],
        ["--base-url", "ftp://example.com"],
        ["--max-concurrency", "0"],
    ],
)
def test_bad_options_are_usage_errors(argv, capsys):
    assert bench_main(["serve", *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(PROG_ERROR)


def test_base_urls():
    e = serve_bench.Endpoint.parse("https://example.com/v1/")  # the openai client's form
    assert (e.port, e.prefix, e.url("/v1/models")) == (443, "", "https://example.com/v1/models")
    e = serve_bench.Endpoint.parse("http://[::1]:8080/api")
    assert (e.host, e.port, e.url("/v1/models")) == ("::1", 8080, "http://[::1]:8080/api/v1/models")


def test_the_api_key_stays_out_of_the_record():
    argv = ["--api-key", "s3cret", "--api=x", "--model", "m"]
    assert serve_bench._quoted(argv) == "--api-key '***' '--api=***' --model m"


# ---------------------------------------------------------------- statistics
@pytest.mark.parametrize(
    "values",
    [[5.0], [1.0, 2.0], [3.0, 1.0, 2.0, 10.0], [random.Random(1).random() for _ in range(101)]],
)
def test_percentile_matches_numpy(values):
    for q in (0, 1, 33.3, 50, 90, 99, 100):
        assert serve_bench.percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_arrivals_are_poisson_at_the_rate():
    times = serve_bench.arrival_times(2000, 50.0, seed=0)
    assert times[0] == 0 and times == sorted(times)
    assert times == serve_bench.arrival_times(2000, 50.0, seed=0)  # seeded
    assert 2000 / times[-1] == pytest.approx(50, rel=0.1)
    assert serve_bench.arrival_times(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------- HTTP and SSE reading
TEXTS = ["héllo", " 日本語", "!", "€"]
EVENTS = [json.dumps({"choices": [{"index": 0, "text": t}]}, ensure_ascii=False) for t in TEXTS]
EVENTS.append(json.dumps({"choices": [], "usage": {"completion_tokens": 4}}))
SSE_BODY = (
    b": a comment, then an event with CRLF line ends\r\n\r\n"
    + f"data: {EVENTS[0]}\r\n\r\n".encode()
    + "".join(f"data: {e}\n\n" for e in EVENTS[1:]).encode()
    + b"data: [DONE]\n\n"
)


def _cuts(body: bytes) -> list[int]:
    """Places to split the body: inside each multi-byte character, inside
    "data:", and between the two newlines that end an event."""
    cuts = set()
    for ch in "é日語€":
        at = body.index(ch.encode())
        cuts.add(at + 1)
    cuts.add(body.index(b"data:", 60) + 3)
    cuts.add(body.index(b"\n\n", 60) + 1)
    return sorted(cuts)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:])]


def _framed(framing: str, body: bytes) -> list[bytes]:
    """The response's bytes, as the pieces the server writes one at a time."""
    head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    if framing == "chunked":
        wire = b""
        for i, piece in enumerate(_split(body, _cuts(body))):
            ext = ";name=value" if i == 1 else ""
            wire += f"{len(piece):x}{ext}\r\n".encode() + piece + b"\r\n"
        wire += b"0\r\n\r\n"
        wire = (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + wire
        # Also cut the wire inside the first chunk-size line, the data and the last chunk.
        n = len(head) + len("Transfer-Encoding: chunked\r\n\r\n")
        return _split(wire, [n + 1, n + 40, len(wire) - 3])
    if framing == "length":
        wire = (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    else:  # up to EOF
        wire = (head + "Connection: close\r\n\r\n").encode() + body
    return _split(wire, [10, *[len(wire) - len(body) + c for c in _cuts(body)]])


@contextlib.asynccontextmanager
async def _serving(pieces: list[bytes]) -> AsyncIterator[int]:
    """A server on a free port that answers every request with `pieces`, one write
    each; yields the port, and waits for its answers to end before closing."""
    answers = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answers.append(asyncio.current_task())
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = [h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
            if length:
                await reader.readexactly(int(length[0].split(b":")[1]))
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.005)  # so the client reads each piece on its own
        except ConnectionError:
            pass  # the client hung up once it had [DONE]
        finally:
            writer.close()

    srv = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with srv:
        yield srv.sockets[0].getsockname()[1]
        await asyncio.gather(*answers)


def _client(port: int) -> serve_bench.Client:
    endpoint = serve_bench.Endpoint.parse(f"http://127.0.0.1:{port}")
    return serve_bench.Client(endpoint, MODEL, {}, ignore_eos=True, timeout_s=10)


@pytest.mark.parametrize("framing", ["chunked", "length", "eof"])
def test_events_come_out_whole_however_the_body_is_split(framing):
    async def go() -> tuple[list[str], serve_bench.RequestResult]:
        async with _serving(_framed(framing, SSE_BODY)) as port:
            client = _client(port)
            response = await serve_bench.http_request(client.endpoint, "GET", "/", {})
            events = [data async for _, data in serve_bench.sse_events(response.chunks())]
            response.close()
            result = await serve_bench.send_completion(client, [1, 2, 3], 4)
        return events, result

    events, result = asyncio.run(go())
    assert events == [*EVENTS, "[DONE]"]
    assert [serve_bench.parse_event(e)[0] for e in events[:4]] == TEXTS
    assert result.ok, result.error
    assert result.output_tokens == 4 and result.ttft is not None and len(result.itl) == 3
    assert 0 < result.ttft <= result.e2e and result.tpot == pytest.approx(
        (result.e2e - result.ttft) / 3
    )


@pytest.mark.parametrize(
    "body, why",
    [
        (b"data: {not json\n\ndata: [DONE]\n\n", "not JSON"),
        (f"data: {EVENTS[0]}\n\n".encode(), "without data: [DONE]"),
        (b'data: {"error": {"message": "engine died"}}\n\n', "engine died"),
    ],
)
def test_a_broken_stream_is_a_failed_request(body, why):
    async def go() -> serve_bench.RequestResult:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
        async with _serving([head + body]) as port:
            return await serve_bench.send_completion(_client(port), [1], 1)

    result = asyncio.run(go())
    assert not result.ok and why in result.error


@pytest.mark.parametrize(
    "pieces, why",
    [
        ([b"HTTP/1.1 100 Continue\r\n\r\n", _framed("chunked", SSE_BODY)[0]], None),
        (
            [
                b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 38\r\n\r\n",
                b'{"error": {"message": "a wrong key"}}\n',
            ],
            "HTTP 401: a wrong key",
        ),
        ([b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n"], "HTTP 503: (no body)"),
        ([b"HTTP/1.1 500 Oops\r\nContent-Length: 99\r\n\r\ncut"], "HTTP 500: (no body)"),
        ([], "closed the connection without an answer"),
        ([b"SSH-2.0-OpenSSH\r\n\r\n"], "not an HTTP response"),
        ([b"HTTP/1.1 200 OK\r\nX: " + b"x" * 70000], "head is over 64 KiB"),
    ],
)
def test_the_completion_reader_reads_heads_as_http_request_does(pieces, why):
    """Interim answers skipped; a status other than 200 and its body's message; no answer."""
    if why is None:  # the 100 Continue, then the rest of the chunked stream
        pieces = [pieces[0], *_framed("chunked", SSE_BODY)]

    async def go() -> serve_bench.RequestResult:
        async with _serving(pieces) as port:
            return await serve_bench.send_completion(_client(port), [1], 4)

    result = asyncio.run(go())
    if why is None:
        assert result.ok and result.output_tokens == 4 and result.events == 6, result.error
    else:
        assert not result.ok and why in result.error, result.error


def test_the_sse_reader_byte_by_byte_equals_all_at_once():
    whole = serve_bench.SSEReader().feed(SSE_BODY)
    reader = serve_bench.SSEReader()
    one_by_one = [e for i in range(len(SSE_BODY)) for e in reader.feed(SSE_BODY[i : i + 1])]
    assert whole == one_by_one == [*EVENTS, "[DONE]"]
    last = serve_bench.SSEReader()  # a last event without its blank line still counts
    assert last.feed(b"data: a\ndata: b") == [] and last.close() == ["a\nb"]


# ---------------------------------------------------------------- the fast paths, exactly
def _sse_reference(pieces: list[bytes]) -> list[str]:
    """The SSE format read line by line, as the reader did before its fast path: the oracle."""
    events, data, buffer = [], [], b""
    for piece in [*pieces, b"\n\n"]:
        *lines, buffer = (buffer + piece).split(b"\n")
        for raw in lines:
            line = raw.removesuffix(b"\r").decode()
            if not line:
                if data:
                    events.append("\n".join(data))
                    data = []
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
    return events


_SSE_LINES = st.sampled_from(
    ["data: {}", 'data: {"a": 1}', "data:x", "data: é", ": comment", "event: e", "id: 7", ""]
)


@given(
    events=st.lists(st.lists(_SSE_LINES, min_size=1, max_size=3), max_size=6),
    crlf=st.lists(st.booleans(), min_size=20, max_size=20),
    cuts=st.lists(st.integers(0, 400), max_size=6),
)
def test_the_sse_fast_path_reads_as_the_lines_do(events, crlf, cuts):
    """Bodies of whole events, split lines, CRLF and LF mixed, comments and
    multi-line data, cut anywhere: the same events as the line-by-line reading."""
    body, k = b"", 0
    for lines in events:
        for line in [*lines, ""]:
            body += line.encode() + (b"\r\n" if crlf[k % len(crlf)] else b"\n")
            k += 1
    pieces = _split(body, sorted(c for c in set(cuts) if 0 < c < len(body)))
    reader = serve_bench.SSEReader()
    got = [e for piece in pieces for e in reader.feed(piece)] + reader.close()
    assert got == _sse_reference(pieces)


def _vllm_event(text: str, finish: str | None = None) -> str:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    choice["stop_reason"] = None
    event = {"id": "cmpl-9", "object": "text_completion", "created": 1, "model": "m"}
    return json.dumps(event | {"choices": [choice], "usage": None}, separators=(",", ":"))


def _pagedllm_event(text: str, model: str = "m", ascii: bool = False) -> str:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
    event = {"id": "cmpl-1", "object": "text_completion", "model": model, "choices": [choice]}
    return json.dumps(event, ensure_ascii=ascii)


def _parse_all(parse, events: list[str]) -> list[object]:
    """Each event's result, or the error it raises, as a value to compare."""
    out = []
    for e in events:
        try:
            out.append(parse(e))
        except serve_bench.HTTPFailure as x:
            out.append(("HTTPFailure", str(x)))
    return out


@given(texts=st.lists(st.text(max_size=4), min_size=1, max_size=12))
def test_the_event_parser_equals_parse_event(texts):
    streams = [
        [_pagedllm_event(t) for t in texts],
        [_pagedllm_event(t, ascii=True) for t in texts],
        [_vllm_event(t) for t in texts] + [_vllm_event("x", "length")],
        # The text also stands in the model's name: the place must be the text's.
        [_pagedllm_event(t, model=texts[0]) for t in texts],
    ]
    for events in streams:
        events = [*events, json.dumps({"choices": [], "usage": {"completion_tokens": 5}})]
        parser = serve_bench.EventParser()
        assert _parse_all(parser.parse, events) == _parse_all(serve_bench.parse_event, events)


def test_the_event_parser_is_exact_off_the_usual_shape():
    base = _pagedllm_event("ab")
    head, tail = base.split('"ab"')
    events = [
        base,
        head + '"cd"' + tail,  # the shortcut: same place, another literal
        head + '"\\u00e9\\n"' + tail,  # escapes in it
        head + '""' + tail,  # an empty text
        head + '"\\x"' + tail,  # not a JSON string: the error parse_event gives
        head + '"a" "b"' + tail,  # two literals: not JSON
        head + '"a\x01"' + tail,  # a control character: not JSON
        head + "5" + tail,  # not a string
        head.replace("cmpl-1", "cmpl-2") + '"ef"' + tail,  # the head moved: parsed in full
        '{"choices": [{"text": "a", "text": "b"}]}',  # json keeps the last
        '{"choices": [{"text": "a", "text": "b"}]}'.replace('"b"', '"c"'),
        '{"error": {"message": "gone"}}',
    ]
    parser = serve_bench.EventParser()
    assert _parse_all(parser.parse, events) == _parse_all(serve_bench.parse_event, events)
    assert parser._hits >= 3  # the shortcut did serve


@given(
    sizes=st.lists(st.integers(1, 40), max_size=8),
    cuts=st.lists(st.integers(0, 400), max_size=8),
    ext=st.booleans(),
)
def test_the_body_decoder_undoes_any_chunking(sizes, cuts, ext):
    payload = bytes(range(256)) * 2
    wire, at = b"", 0
    for size in sizes:
        wire += f"{size:X}{';x=y' if ext else ''}\r\n".encode() + payload[at : at + size] + b"\r\n"
        at += size
    wire += b"0\r\n\r\n"
    decoder = serve_bench.BodyDecoder({"transfer-encoding": "chunked"})
    out = b""
    for piece in _split(wire, sorted(c for c in set(cuts) if 0 < c < len(wire))):
        out += decoder.feed(piece)
    assert decoder.done and out == payload[:at]
    short = serve_bench.BodyDecoder({"transfer-encoding": "chunked"})
    short.feed(wire[: len(wire) - 5])
    with pytest.raises(serve_bench.HTTPFailure, match="connection closed in the middle"):
        short.eof()


# ---------------------------------------------------------------- against the stub server
@contextlib.contextmanager
def _stub(*args: str):
    """python -m pagedllm.bench.serve_stub in its own process; yields its URL."""
    cmd = [sys.executable, "-m", "pagedllm.bench.serve_stub", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on "), line
        yield line.removeprefix("listening on ")
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("pace", [[], ["--tokens-per-s", "2000"]])
def test_the_client_counts_the_stubs_stream_exactly(pace):
    """Every request's tokens and events, at full speed (many events per read)
    and one token per stream every 0.5 ms (few)."""
    max_tokens = [1, 2, 7, 64, 300]
    work = workloads.Workload("stub", [[1, 2, 3]] * len(max_tokens), max_tokens, "test")
    with _stub(*pace) as url:
        client = serve_bench.Client(serve_bench.Endpoint.parse(url), "stub", {}, True, 10)
        results, peak = asyncio.run(serve_bench.run_rate(client, work, float("inf"), None, 0))
    assert peak == len(max_tokens)
    for r, n in zip(results, max_tokens):
        assert r.ok, r.error
        assert (r.output_tokens, r.events, len(r.itl)) == (n, n + 2, n - 1)
        assert r.ttft is not None and 0 < r.ttft <= r.e2e


def test_the_client_benchmark_reports_exact_counts(tmp_path):
    script = Path(__file__).parent.parent / "scripts" / "bench_client.py"
    argv = ["--num-requests", "20", "--output-len", "50", "--json", str(tmp_path / "c.json")]
    done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record == json.loads((tmp_path / "c.json").read_text())
    assert record["bench"] == "serve-client" and record["exact"] is True
    assert (record["completed"], record["failed"]) == (20, 0)
    assert record["events"] == record["events_expected"] == 20 * 52
    assert record["events_per_s"] == pytest.approx(20 * 52 / record["duration_s"], rel=1e-3)


def test_client_processes_send_every_request_and_merge_exactly():
    """Two client processes: each request's result comes back to its own place, exact."""
    max_tokens = [3, 40, 1, 17, 250, 8]
    work = workloads.Workload("stub", [[7]] * len(max_tokens), max_tokens, "test")

    async def go(client):
        processes = serve_bench.ClientProcesses(client, 2)
        try:
            await processes.start()
            assert len(set(processes.pids())) == 2
            return await serve_bench.run_rate(client, work, float("inf"), 4, 0, processes)
        finally:
            processes.close()

    with _stub() as url:
        client = serve_bench.Client(serve_bench.Endpoint.parse(url), "stub", {}, True, 10)
        results, peak = asyncio.run(go(client))
    assert peak == 4  # the cap holds across the processes
    for r, n in zip(results, max_tokens):
        assert r.ok, r.error
        assert (r.output_tokens, r.events, len(r.itl)) == (n, n + 2, n - 1)
    assert min(r.start for r in results) < max(r.end for r in results)


def test_bench_serve_with_client_processes(capsys):
    with _stub() as url:
        argv = ["serve", "--base-url", url, "--num-requests", "5", "--max-output-len", "30"]
        assert bench_main([*argv, "--client-processes", "2"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["workload"]["client_processes"] == 2
    (run,) = record["runs"]
    assert (run["completed"], run["failed"]) == (5, 0)
    assert run["output_tokens"] == sum(draw_throughput(5, None, 30).max_tokens)


def test_json_that_is_not_a_bench_record_is_refused_before_the_run(tmp_path, capsys):
    """bench serve checks --json as the other workloads do: before it sends anything
    (no server is running here: the refusal comes first), and the file keeps its bytes."""
    from pagedllm.bench.serve_bench import main as serve_main

    path = tmp_path / "notes.json"
    path.write_text('{"my": "notes"}')
    argv = ["--base-url", "http://127.0.0.1:9", "--json", str(path)]
    assert serve_main(argv) == 2
    assert "not a pagedllm bench record" in capsys.readouterr().err
    assert path.read_text() == '{"my": "notes"}'
