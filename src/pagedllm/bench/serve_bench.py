"""`pagedllm bench serve`: load a running OpenAI-compatible server over HTTP and
measure what its clients see.

    pagedllm serve &                                      # or vLLM, SGLang, llama.cpp...
    pagedllm bench serve --num-requests 64 --max-prompt-len 256 --max-output-len 128
    pagedllm bench serve --base-url http://gpu-box:8000 --request-rate 1,4,16,inf \\
        --max-concurrency 64 --json serve.json

What it measures. The other workloads time the engine inside this process;
this one times the whole path a client sees: HTTP, the server's queue, the
engine, and the Server-Sent Events (SSE) coming back. Per request: time to
first token (TTFT), time per output token after it (TPOT), the gaps between
streamed pieces (ITL, inter-token latency) and the end-to-end time (E2E); per
run: requests and tokens per second. docs/benchmarks.md defines each figure.

How. The requests are the throughput draw of docs/gpu.md (workloads.py):
token-id prompts and an exact number of new tokens each (greedy; EOS ignored
through `ignore_eos`, a vLLM extension pagedllm accepts too), sent as streamed
`POST /v1/completions`. They arrive as a Poisson process at each
`--request-rate` (exponential gaps, seeded), or all at once (`inf`), with at
most `--max-concurrency` in flight. One asyncio event loop is the client: one
connection per request (`Connection: close`), HTTP/1.1 written and read by
hand (a streamed completion by an asyncio Protocol, where its bytes arrive),
so it needs nothing beyond the standard library. With `--client-processes N`
the requests are sent and read by N processes, each its own event loop,
while the arrivals and the cap stay in this one (`ClientProcesses`).

Order of a run: check the options -> GET /v1/models (the server is up, takes
our key, names its model) -> one warm-up request (not measured) -> each rate
in turn, on the same server -> a table, then one JSON line (the last line of
stdout). Logs go to stderr. Errors as every `pagedllm` command: a bad option
is a usage error (exit 2); a server that cannot be reached or refuses us is
one line `pagedllm bench serve: error: ...` (exit 1).

Owns: the HTTP client (`http_request`, `BodyDecoder`, `body_chunks`), the
SSE reader (`SSEReader`), the events' parsing (`parse_event`, `EventParser`),
the timing of one request (`send_completion`, `CompletionReader`), the
arrival process (`run_rate`, `ClientProcesses`) and the statistics
(`percentile`, `summarize`). Does not own: the draw (workloads.py), the
server (pagedllm/server/), the error style (pagedllm/cli_errors.py), the JSON
line's printing (report.emit) or the stub server that the client's own
benchmark runs against (serve_stub.py, scripts/bench_client.py).

Limits, so the figures are read right: one client process, on one core of a
2-core EPYC VM, reads about 150,000-300,000 streamed events per second when
many come in each read, and 50,000-80,000 per CPU-second when each stream's
events come one to a few per read (a system call per read);
docs/benchmarks.md, "The serving client alone". Past that the client is the
bottleneck: watch its CPU, or add --client-processes. An event's time is
when the read that brought it returned: events that arrive in one read share
a time, and their ITL gaps are 0. TTFT and E2E include opening the
connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import multiprocessing
import os
import random
import shlex
import ssl
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from pagedllm.bench import report, workloads
from pagedllm.cli_errors import error, one_line
from pagedllm.engine_args import positive_float, positive_int, whole_number

PROG = "pagedllm bench serve"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_NUM_REQUESTS = 256
DEFAULT_TIMEOUT_S = 600.0
MODELS_TIMEOUT_S = 60.0  # GET /v1/models answers at once on a live server
PERCENTILES = (50, 90, 99)
_scan_json = json.JSONDecoder().scan_once  # json.loads's scanner (the C one), called directly
_scan_string = json.decoder.scanstring  # and the function it reads string literals with
READ_SIZE = 1 << 16
LINE_LIMIT = 1 << 16  # a chunk-size line longer than this is not HTTP


class BenchError(Exception):
    """The server cannot be benchmarked (unreachable, refuses us): one line, exit 1."""


class HTTPFailure(Exception):
    """A request that did not complete: a bad status, a broken stream, not HTTP."""


# ------------------------------------------------------------------ HTTP, by hand
@dataclass(frozen=True)
class Endpoint:
    """Where the requests go: --base-url in parts. `prefix` is a path before /v1 (often "")."""

    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected http://HOST[:PORT] or https://HOST[:PORT], got {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)  # a bad port: ValueError
        # The openai client's base URL ends in /v1; ours is the server's root: take both.
        prefix = parts.path.rstrip("/").removesuffix("/v1")
        return cls(parts.scheme, parts.hostname, port, prefix)

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        default = self.port == (443 if self.scheme == "https" else 80)
        return host if default else f"{host}:{self.port}"

    def url(self, path: str = "") -> str:
        return f"{self.scheme}://{self.netloc}{self.prefix}{path}"


@dataclass
class Response:
    """A response whose head is read; the body is read through `chunks()` or `read()`."""

    status: int
    headers: dict[str, str]  # names in lower case
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def chunks(self) -> AsyncIterator[bytes]:
        return body_chunks(self.reader, self.headers)

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks()])

    def close(self) -> None:
        self.writer.close()  # Connection: close; nothing to wait for


async def http_request(
    endpoint: Endpoint,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes | None = None,
) -> Response:
    """Open a connection, send one HTTP/1.1 request, read the response's head."""
    tls = ssl.create_default_context() if endpoint.scheme == "https" else None
    extra = {"server_hostname": endpoint.host} if tls else {}
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port, ssl=tls, **extra)
    try:
        writer.write(_request_bytes(endpoint, method, path, headers, body))
        await writer.drain()
        status, response_headers = await read_head(reader)
    except BaseException:
        writer.close()
        raise
    return Response(status, response_headers, reader, writer)


def _request_bytes(
    endpoint: Endpoint, method: str, path: str, headers: dict[str, str], body: bytes | None
) -> bytes:
    """One HTTP/1.1 request, head and body, for a connection that closes after it."""
    lines = [
        f"{method} {endpoint.prefix}{path} HTTP/1.1",
        f"Host: {endpoint.netloc}",
        "User-Agent: pagedllm-bench-serve",
        "Connection: close",
    ]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and headers; interim answers (1xx) are skipped."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            raise HTTPFailure("the server closed the connection without an answer") from None
        except asyncio.LimitOverrunError:
            raise HTTPFailure("the response's head is over 64 KiB") from None
        status, headers = _parse_head(head)
        if not 100 <= status < 200:
            return status, headers


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """A response's head, up to its blank line: the status code and the headers."""
    lines = head.decode("latin-1").split("\r\n")
    status_line = lines[0].split(" ", 2)  # HTTP/1.1 200 OK
    if not (
        len(status_line) >= 2 and status_line[0].startswith("HTTP/") and status_line[1].isdigit()
    ):
        raise HTTPFailure(f"not an HTTP response: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(status_line[1]), headers


class BodyDecoder:
    """A response body's framing undone as its bytes arrive, in whatever pieces:
    chunked, Content-Length bytes, or up to EOF.

    `feed(raw)` returns the body's bytes in `raw` (a chunk's data may come out
    in parts, as it arrives); `done` is set at the end of the body; `eof()`
    says the connection closed and raises if that cut the body short. Chunked
    framing is `SIZE-IN-HEX[;ext]\\r\\n DATA \\r\\n`, ending with a size of 0;
    trailers after it are not read: the connection closes after each request
    anyway. It works on whole reads rather than awaiting each chunk's parts
    one at a time: a read that brings hundreds of events costs one pass, not
    three awaits per event.
    """

    def __init__(self, headers: dict[str, str]) -> None:
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self.done = False
        self.left: int | None = None  # bytes to come: of this chunk, or of the body; None: EOF
        self._crlf = False  # chunked: a chunk's data is all here, its CRLF is next
        self._buffer = b""  # chunked: an unfinished size line or CRLF
        if self.chunked:
            self.left = 0
        elif "content-length" in headers:
            try:
                self.left = int(headers["content-length"])
            except ValueError:
                raise HTTPFailure(f"a bad Content-Length {headers['content-length']!r}") from None
            self.done = self.left <= 0

    def want(self) -> int:
        """How many bytes to read next: never past a Content-Length body's end."""
        if self.chunked or self.left is None:
            return READ_SIZE
        return min(self.left, READ_SIZE)

    def feed(self, raw: bytes) -> bytes:
        if self.chunked:
            return self._unchunk(raw)
        if self.left is not None:
            raw = raw[: self.left]  # never past the body's end
            self.left -= len(raw)
            self.done = self.left <= 0
        return raw

    def eof(self) -> None:
        """The connection closed: the end of an up-to-EOF body, else a body cut short."""
        if self.done:
            return
        if self.chunked:
            if self.left or self._crlf:
                raise HTTPFailure("the connection closed in the middle of a chunk")
            raise HTTPFailure("the connection closed in the middle of the body")
        if self.left is not None:
            raise HTTPFailure(f"the body ended {self.left} bytes short of its Content-Length")
        self.done = True

    def _unchunk(self, raw: bytes) -> bytes:
        buf = self._buffer + raw if self._buffer else raw
        pos, end, out = 0, len(buf), []
        while pos < end and not self.done:
            if self.left:  # inside a chunk's data
                stop = pos + self.left
                out.append(buf[pos:stop])
                if stop > end:
                    self.left, pos = stop - end, end
                    break
                self.left, pos, self._crlf = 0, stop, True
            if self._crlf:
                if end - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise HTTPFailure("a chunk does not end in CRLF")
                pos, self._crlf = pos + 2, False
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if end - pos > LINE_LIMIT:
                    raise HTTPFailure("a chunk-size line over 64 KiB")
                break
            line = buf[pos:eol]
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                size = -1
            if size < 0:
                raise HTTPFailure(f"a bad chunk-size line {line[:40]!r}")
            pos = eol + 2
            if size == 0:
                self.done = True
            self.left = size
        self._buffer = buf[pos:] if pos < end and not self.done else b""
        return out[0] if len(out) == 1 else b"".join(out)


async def body_chunks(
    reader: asyncio.StreamReader, headers: dict[str, str]
) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive, one piece per read (BodyDecoder undoes the framing)."""
    body = BodyDecoder(headers)
    while not body.done:
        raw = await reader.read(body.want())
        if not raw:
            body.eof()
            return
        if data := body.feed(raw):
            yield data


# ------------------------------------------------------------------ Server-Sent Events
class SSEReader:
    """Server-Sent Events out of body bytes that arrive in arbitrary pieces.

    `feed(piece)` returns the data of every event the piece completes. A line
    is decoded only once it is whole, so a UTF-8 character split between two
    pieces comes out whole (a newline byte is never part of a multi-byte
    character). An event ends at a blank line; its `data:` lines are joined
    by newlines. Lines end in LF or CRLF (a lone CR, which the format also
    allows, is not handled); other fields (event, id, retry) and comments
    (lines that start with ':') are skipped.
    """

    def __init__(self) -> None:
        self._buffer = b""  # an unfinished line
        self._data: list[str] = []  # the data lines of an unfinished event

    def feed(self, piece: bytes) -> list[str]:
        buf = self._buffer + piece if self._buffer else piece
        if self._data:  # inside an event: line by line
            return self._lines(buf)
        # The fast path, for what servers send: whole events of one line each,
        # `data: X` then a blank line. With no event under way, `buf` starts a
        # line, so each piece between two blank lines that is one `data: ` line
        # is an event as the line-by-line reading would see it; the first piece
        # that is not hands the rest to that reading.
        sep = b"\r\n\r\n" if b"\r" in buf else b"\n\n"
        blocks = buf.split(sep)
        rest = blocks.pop()  # after the last blank line: an unfinished event, or b""
        events = []
        for i, block in enumerate(blocks):
            if block.startswith(b"data: ") and b"\n" not in block and b"\r" not in block:
                events.append(block.decode()[6:])  # invalid UTF-8: UnicodeDecodeError
            else:
                rest = sep.join([*blocks[i:], rest])
                break
        self._buffer = b""
        return events + self._lines(rest) if rest else events

    def _lines(self, buf: bytes) -> list[str]:
        """The reading of the format, line by line."""
        *lines, self._buffer = buf.split(b"\n")
        events = []
        for raw in lines:
            line = raw.removesuffix(b"\r").decode()  # invalid UTF-8: UnicodeDecodeError
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[len("data:") :]
                self._data.append(value.removeprefix(" "))
        return events

    def close(self) -> list[str]:
        """The body ended: a last event not followed by its blank line still counts."""
        return self.feed(b"\n\n")


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[float, str]]:
    """(arrival time, data) of each event of an SSE body; the time is when its bytes came."""
    reader = SSEReader()
    async for piece in chunks:
        now = time.perf_counter()
        for data in reader.feed(piece):
            yield now, data
    for data in reader.close():
        yield time.perf_counter(), data


# ------------------------------------------------------------------ one request
@dataclass(frozen=True)
class Client:
    """What every request of a benchmark shares."""

    endpoint: Endpoint
    model: str
    headers: dict[str, str]  # Authorization, when there is a key
    ignore_eos: bool
    timeout_s: float

    def completion_body(self, prompt: list[int], max_tokens: int) -> bytes:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        return json.dumps(body).encode()


@dataclass
class RequestResult:
    """One request as the client saw it. Times are time.perf_counter() seconds;
    `ttft` and `itl` are durations."""

    prompt_len: int
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    events: int = 0  # SSE events read, the usage event and [DONE] included
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Decode time per token: the first token's wait (TTFT) left out."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def send_completion(client: Client, prompt: list[int], max_tokens: int) -> RequestResult:
    """Send one streamed completion and time it; a failure is recorded, never raised."""
    result = RequestResult(len(prompt))
    result.start = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, prompt, max_tokens, result), client.timeout_s)
    except asyncio.TimeoutError:  # before OSError: from 3.11 it is one
        result.error = f"not finished within --timeout {client.timeout_s:g} s"
    except (HTTPFailure, OSError, ValueError) as e:  # ValueError: bad UTF-8
        result.error = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)
    if result.error is not None:
        result.end = time.perf_counter()
    return result


async def _stream(client: Client, prompt: list[int], max_tokens: int, r: RequestResult) -> None:
    """Fill `r` from the stream: ttft at the first text, itl between texts, end at [DONE]."""
    headers = client.headers | {"Content-Type": "application/json"}
    body = client.completion_body(prompt, max_tokens)
    endpoint = client.endpoint
    tls = ssl.create_default_context() if endpoint.scheme == "https" else None
    extra = {"server_hostname": endpoint.host} if tls else {}
    transport, reader = await asyncio.get_running_loop().create_connection(
        lambda: CompletionReader(r), endpoint.host, endpoint.port, ssl=tls, **extra
    )
    try:
        transport.write(_request_bytes(endpoint, "POST", "/v1/completions", headers, body))
        await reader.finished
    finally:
        transport.close()


_thread_state = threading.local()


def _read_buffer() -> memoryview:
    """This thread's buffer for reads: each read is copied out before the next."""
    buffer = getattr(_thread_state, "buffer", None)
    if buffer is None:
        buffer = _thread_state.buffer = memoryview(bytearray(READ_SIZE))
    return buffer


class CompletionReader(asyncio.BufferedProtocol):
    """The response to one streamed completion, read where its bytes arrive.

    The same steps as `http_request`, `body_chunks` and `sse_events` (the
    head, then BodyDecoder, SSEReader and EventParser), run inside the event
    loop's own callback for each read rather than in a task that a stream
    reader wakes: no future and no task step per read. And the reads land in
    one buffer per thread (a BufferedProtocol): a plain Protocol's transport
    allocates 256 KiB for every read, which glibc maps and unmaps (three
    system calls a read, as many as the read itself). When each event comes
    on its own, those costs were most of the event's (docs/benchmarks.md,
    "The serving client alone"). An event's time is when the read that
    brought it returned, as before. `finished` ends with None at `data:
    [DONE]`, or with the failure (HTTPFailure, an OSError, or a ValueError
    for bad UTF-8).
    """

    def __init__(self, r: RequestResult) -> None:
        self.r = r
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._head = b""  # the response's head, until it is whole
        self._status = 0
        self._body: BodyDecoder | None = None  # from the end of the head
        self._sse = SSEReader()
        self._parse = EventParser().parse
        self._texts, self._usage_tokens, self._last = 0, None, None
        self._error_body: list[bytes] | None = None  # a status other than 200: its body
        self._timer: asyncio.TimerHandle | None = None

    def get_buffer(self, sizehint: int) -> memoryview:
        return _read_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(_read_buffer()[:nbytes]))  # the buffer is the next read's

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.finished.done():
            return  # [DONE] came, or the request failed: the rest is not read
        try:
            if self._body is None:
                data = self._read_head(data)
                if self._body is None:
                    return
            data = self._body.feed(data)
            if self._error_body is not None:
                self._error_body.append(data)
                if self._body.done:
                    self._fail_status()
                return
            if data:
                for event in self._sse.feed(data):
                    if self._take(now, event):
                        return
            if self._body.done:
                self._end()
        except (HTTPFailure, ValueError) as e:  # ValueError: bad UTF-8
            self._finish(e)

    def eof_received(self) -> bool:
        if not self.finished.done():
            try:
                if self._body is None:
                    raise HTTPFailure("the server closed the connection without an answer")
                if self._error_body is not None:
                    self._fail_status()
                else:
                    self._body.eof()
                    self._end()
            except (HTTPFailure, ValueError) as e:
                self._finish(e)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            exc = HTTPFailure("the connection closed in the middle of the body")
        self._finish(exc)

    def _read_head(self, data: bytes) -> bytes:
        """Take the head's bytes, interim answers (1xx) skipped; return the body's that
        came with them."""
        self._head += data
        while (end := self._head.find(b"\r\n\r\n")) >= 0:
            head, self._head = self._head[: end + 4], self._head[end + 4 :]
            status, headers = _parse_head(head)
            if 100 <= status < 200:
                continue
            self._status, self._body = status, BodyDecoder(headers)
            if status != 200:  # its body says why: wait for it 10 s at most
                self._error_body = []
                loop = asyncio.get_running_loop()
                self._timer = loop.call_later(10, self._fail_status, False)
            rest, self._head = self._head, b""
            return rest
        if len(self._head) > LINE_LIMIT:
            raise HTTPFailure("the response's head is over 64 KiB")
        return b""

    def _take(self, now: float, data: str) -> bool:
        """Count one event; True at [DONE]."""
        r = self.r
        r.events += 1
        if data == "[DONE]":
            r.end = now
            usage = self._usage_tokens
            r.output_tokens = usage if usage is not None else self._texts
            self._finish(None)
            return True
        text, tokens = self._parse(data)
        if tokens is not None:
            self._usage_tokens = tokens
        if text:
            self._texts += 1
            if self._last is None:
                r.ttft = now - r.start
            else:
                r.itl.append(now - self._last)
            self._last = now
        return False

    def _end(self) -> None:
        """The body ended: a last event without its blank line still counts, then [DONE]
        must have come."""
        for event in self._sse.close():
            if self._take(time.perf_counter(), event):
                return
        raise HTTPFailure("the stream ended without data: [DONE]")

    def _fail_status(self, whole: bool = True) -> None:
        """A status other than 200, with the message of its body (none if it did not
        come whole)."""
        body = b""
        if whole and self._error_body is not None and self._body is not None:
            with contextlib.suppress(HTTPFailure):
                self._body.eof()
                body = b"".join(self._error_body)
        self._finish(HTTPFailure(_status_text(self._status, body)))

    def _finish(self, error: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.finished.done():
            return
        if error is None:
            self.finished.set_result(None)
        else:
            self.finished.set_exception(error)


def parse_event(data: str) -> tuple[str, int | None]:
    """One event of a /v1/completions stream: (choices[0].text, usage.completion_tokens)."""
    try:
        # json.loads without its Python layers: the same scan, and json.loads
        # itself (the same result or error) whenever the scan does not take
        # the whole text (leading or trailing space, bad JSON).
        event, end = _scan_json(data, 0)
        if end != len(data):
            event = json.loads(data)
    except (StopIteration, ValueError):
        try:
            event = json.loads(data)
        except ValueError:
            raise HTTPFailure(f"an event that is not JSON: {data[:100]!r}") from None
    if not isinstance(event, dict):
        raise HTTPFailure(f"an event that is not a JSON object: {data[:100]!r}")
    if "error" in event:  # vLLM and others report a failure inside the stream
        raise HTTPFailure(f"an error event: {_error_message(event)}")
    choices = event.get("choices")
    if not isinstance(choices, list):
        raise HTTPFailure(f"an event without choices: {data[:100]!r}")
    text = choices[0].get("text") if choices and isinstance(choices[0], dict) else None
    if text is not None and not isinstance(text, str):
        raise HTTPFailure(f"an event whose text is not a string: {data[:100]!r}")
    usage = event.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return text or "", tokens if isinstance(tokens, int) else None


class EventParser:
    """`parse_event` for the events of one stream, with an exact shortcut for
    the events that servers send one token at a time.

    Such events differ only in their text: `{"id": ..., "choices": [{"index":
    0, "text": " the", ...}]}` then the same with " cat". Once one event has
    been parsed in full, the text before and after its `choices[0].text`
    literal (`head`, `tail`) is learnt; a later event that is `head`, one
    JSON string literal, `tail` parses as that event with only the text
    replaced, so its result is (the literal's value, the learnt token count)
    at the cost of reading one string (`json.decoder.scanstring`, the
    function json.loads reads strings with) instead of the whole event.

    Exact, not a guess: a place is learnt only after the event with the
    literal there replaced by a marker string parses, in full, to the marker
    as `choices[0].text` and the same token count. JSON's grammar is
    context-free, so any other string literal in that place is read as that
    same value. Events that do not match (the last one, with its
    finish_reason; the usage event) are parsed in full. At most
    `LEARN_TRIES` events of a stream are tried for a place, and none once a
    place has served, so a server whose events all differ costs at most
    that many extra parses.
    """

    LEARN_TRIES = 2
    MARK = "\x00pagedllm-bench-mark"

    def __init__(self) -> None:
        self._head: str | None = None
        self._tail = ""
        self._tokens: int | None = None
        self._tries = self.LEARN_TRIES
        self._hits = 0  # events read through the shortcut

    def parse(self, data: str) -> tuple[str, int | None]:
        head, tail = self._head, self._tail
        if head is not None and data.startswith(head) and data.endswith(tail):
            start, stop = len(head), len(data) - len(tail)
            if stop - start >= 2 and data[start] == '"':
                try:
                    text, end = _scan_string(data, start + 1)
                except ValueError:  # a bad literal: parse_event says what is wrong
                    pass
                else:
                    if end == stop:
                        self._hits += 1
                        return text, self._tokens
        text, tokens = parse_event(data)
        if text and self._tries and not self._hits:  # a place that served once is kept
            self._tries -= 1
            self._learn(data, text, tokens)
        return text, tokens

    def _learn(self, data: str, text: str, tokens: int | None) -> None:
        """Find the literal of `text` that is choices[0].text (json.dumps's spellings of it)."""
        mark = json.dumps(self.MARK)
        for literal in dict.fromkeys([json.dumps(text, ensure_ascii=False), json.dumps(text)]):
            at = data.find(literal)
            while at >= 0:
                head, tail = data[:at], data[at + len(literal) :]
                try:
                    if parse_event(head + mark + tail) == (self.MARK, tokens):
                        self._head, self._tail, self._tokens = head, tail, tokens
                        return
                except HTTPFailure:
                    pass
                at = data.find(literal, at + 1)


async def _status_message(response: Response) -> str:
    """`HTTP 401: MESSAGE`, the message taken from OpenAI's error shape when it is there."""
    try:
        body = await asyncio.wait_for(response.read(), 10)
    except (HTTPFailure, OSError, asyncio.TimeoutError):
        body = b""
    return _status_text(response.status, body)


def _status_text(status: int, body: bytes) -> str:
    text = body.decode("utf-8", "replace")
    try:
        message = _error_message(json.loads(text))
    except ValueError:
        message = text
    return f"HTTP {status}: {one_line(message)[:300] or '(no body)'}"


def _error_message(obj: Any) -> str:
    """OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or the object as text."""
    if isinstance(obj, dict):
        inner = obj.get("error", obj)
        if isinstance(inner, dict):
            return str(inner.get("message") or inner.get("detail") or obj)
        return str(inner)
    return str(obj)


# ------------------------------------------------------------------ the server, first
async def served_models(endpoint: Endpoint, headers: dict[str, str], timeout_s: float) -> list[str]:
    """GET /v1/models: the ids it lists. Raises BenchError saying what to do."""
    url = endpoint.url("/v1/models")

    async def get() -> tuple[int, bytes, str]:
        response = await http_request(endpoint, "GET", "/v1/models", headers)
        try:
            if response.status != 200:
                return response.status, b"", await _status_message(response)
            return response.status, await response.read(), ""
        finally:
            response.close()

    try:
        status, body, message = await asyncio.wait_for(get(), timeout_s)
    except asyncio.TimeoutError:
        raise BenchError(
            f"{url} did not answer within {timeout_s:g} s: is the server up and serving?"
        ) from None
    except (OSError, HTTPFailure) as e:
        raise BenchError(
            f"cannot reach {url} ({e}): start a server (`pagedllm serve`) "
            "or point --base-url at one"
        ) from None
    if status != 200:
        hint = {
            401: "give its key with --api-key KEY (or set OPENAI_API_KEY)",
            403: "give its key with --api-key KEY (or set OPENAI_API_KEY)",
            404: "is --base-url the server's root, http://HOST:PORT?",
        }.get(status, "is it an OpenAI-compatible server?")
        raise BenchError(f"{url} answered {message}; {hint}")
    try:
        return [str(card["id"]) for card in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        raise BenchError(
            f"{url} answered 200 but not with OpenAI's model list: {body[:100]!r}"
        ) from None


# ------------------------------------------------------------------ one run
class InFlight:
    """Requests sent and not yet finished, and the most there were at once."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def __enter__(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def __exit__(self, *exc: object) -> None:
        self.now -= 1


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (s) of `n` Poisson arrivals at `rate` per second; the first at 0.

    The gaps are exponential with mean 1/rate, from random.Random(seed), so
    every run at this rate and seed sends at the same moments. `inf`: all at 0.
    """
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def run_rate(
    client: Client,
    work: workloads.Workload,
    rate: float,
    max_concurrency: int | None,
    seed: int,
    processes: ClientProcesses | None = None,
) -> tuple[list[RequestResult], int]:
    """Every request of `work`, arriving at `rate`; returns the results and the peak in flight.
    With `processes`, the requests are sent from those (the arrivals stay here)."""
    send = processes.send if processes is not None else partial(send_completion, client)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    in_flight = InFlight()
    n, finished = work.num_requests, 0
    every = max(1, n // 10)

    async def one(prompt: list[int], max_tokens: int) -> RequestResult:
        nonlocal finished
        async with limit:  # a request waits here for a slot, untimed: TTFT starts at the send
            with in_flight:
                result = await send(prompt, max_tokens)
        finished += 1
        if finished % every == 0 or finished == n:
            _log(f"rate {_rate_text(rate)}: {finished}/{n} requests finished")
        return result

    t0 = time.perf_counter()
    tasks = []
    for offset, prompt, max_tokens in zip(
        arrival_times(n, rate, seed), work.prompts, work.max_tokens
    ):
        # Sleep to the arrival's moment, not by the gap: late wake-ups do not add up.
        # An arrival already due is sent without yielding: a yield per request
        # would pace the sends by the event loop's turns, which are long when
        # many streams are being read (`inf` would no longer be all at once).
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(prompt, max_tokens)))
    results = await asyncio.gather(*tasks)
    return results, in_flight.peak


# ------------------------------------------------------------------ client processes
class ClientProcesses:
    """`--client-processes N`: N processes, each with its own event loop, that
    send the requests this process's arrival process hands them.

    The arrivals, the concurrency cap and the count in flight stay here, in
    `run_rate`, exactly as with one process: only `send_completion` moves.
    A request goes to the process with the fewest in flight (the lowest
    index on a tie) as one pickled message over a pipe; its `RequestResult`
    comes back the same way. Every time in a result is `time.perf_counter()`
    read in the process that sent the request: on Linux (CLOCK_MONOTONIC),
    macOS and Windows that clock is one for all processes, so results from
    different processes compare and merge as they are. The cost of the hop
    (a message each way per request, not per event) falls between the
    arrival and the send, which is untimed, as the wait for a slot is.
    """

    def __init__(self, client: Client, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process inside an event loop
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        for _ in range(n):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client_process, args=(theirs, client), daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        self._load = [0] * n  # requests in flight in each process
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 0

    async def start(self) -> None:
        """Wait for every process to be up (imported, its loop running), then listen to them."""
        loop = asyncio.get_running_loop()
        for k, conn in enumerate(self._conns):
            try:
                ready = await loop.run_in_executor(None, conn.recv)  # its first word: "ready"
            except (EOFError, OSError):
                ready = None
            if ready != "ready":
                raise BenchError(f"client process {k} (pid {self._procs[k].pid}) did not start")
        for k, conn in enumerate(self._conns):
            loop.add_reader(conn.fileno(), self._on_message, k)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    async def send(self, prompt: list[int], max_tokens: int) -> RequestResult:
        """send_completion, in the least busy process."""
        k = min(range(len(self._load)), key=self._load.__getitem__)
        rid, self._next_id = self._next_id, self._next_id + 1
        future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future
        self._load[k] += 1
        try:
            self._conns[k].send((rid, prompt, max_tokens))
            return await future
        finally:
            self._load[k] -= 1

    def _on_message(self, k: int) -> None:
        conn = self._conns[k]
        try:
            while conn.poll():
                rid, result = conn.recv()
                future = self._waiting.pop(rid)
                if not future.done():
                    future.set_result(result)
        except (EOFError, OSError):  # the process died: its requests cannot finish
            asyncio.get_running_loop().remove_reader(conn.fileno())
            error = BenchError(f"client process {k} (pid {self._procs[k].pid}) died")
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(error)

    def close(self) -> None:
        """Tell each process to end, and wait for it (a few seconds at most)."""
        loop = asyncio.get_running_loop()
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                loop.remove_reader(conn.fileno())
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for conn in self._conns:
            conn.close()


def _client_process(conn: Any, client: Client) -> None:
    """A client process: send each request its parent hands it, hand back the result."""
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: the parent says what happened
        asyncio.run(_client_process_loop(conn, client))


async def _client_process_loop(conn: Any, client: Client) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

    async def one(rid: int, prompt: list[int], max_tokens: int) -> None:
        conn.send((rid, await send_completion(client, prompt, max_tokens)))

    def on_message() -> None:
        try:
            while conn.poll():
                message = conn.recv()
                if message is None:
                    raise EOFError
                task = loop.create_task(one(*message))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (EOFError, OSError):  # the parent is done, or gone
            loop.remove_reader(conn.fileno())
            stop.set()

    loop.add_reader(conn.fileno(), on_message)
    conn.send("ready")
    await stop.wait()
    for task in list(tasks):
        task.cancel()  # the parent is not waiting for these any more


# ------------------------------------------------------------------ statistics
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in 0..100) of `values`, as numpy.percentile's default:
    sorted, at the fractional rank (n - 1) * q / 100, interpolated linearly
    between the two values around it."""
    if not values:
        raise ValueError("the percentile of no values")
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize(seconds: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50, p90 and p99 in milliseconds; all None when there are no values."""
    keys = ["mean"] + [f"p{q}" for q in PERCENTILES]
    if not seconds:
        return dict.fromkeys(keys)
    ms = [1e3 * s for s in seconds]
    values = [sum(ms) / len(ms)] + [percentile(ms, q) for q in PERCENTILES]
    return {k: round(v, 4) for k, v in zip(keys, values)}


def run_record(
    rate: float, max_concurrency: int | None, peak: int, results: list[RequestResult]
) -> dict[str, Any]:
    """One rate's figures; failed requests count in `failed` and the duration only."""
    ok = [r for r in results if r.ok]
    failed = sorted((r for r in results if not r.ok), key=lambda r: r.end)
    duration = max(r.end for r in results) - min(r.start for r in results)
    prompt_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)

    def per_s(x: float) -> float | None:
        return round(x / duration, 4) if duration > 0 else None

    return {
        "request_rate": _rate_text(rate) if math.isinf(rate) else rate,
        "max_concurrency": max_concurrency,
        "max_concurrency_observed": peak,
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "duration_s": round(duration, 4),
        "request_throughput": per_s(len(ok)),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tokens_per_s": per_s(output_tokens),
        "total_tokens_per_s": per_s(prompt_tokens + output_tokens),
        "ttft_ms": summarize([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": summarize([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": summarize([gap for r in ok for gap in r.itl]),
        "e2e_ms": summarize([r.e2e for r in ok]),
    }


# ------------------------------------------------------------------ the table
COLUMNS: list[tuple[str, Any, str, int]] = [  # header, getter of a run record, format, width
    ("rate", lambda r: r["request_rate"], "g", 7),
    ("cap", lambda r: r["max_concurrency"], "d", 5),
    ("peak", lambda r: r["max_concurrency_observed"], "d", 6),
    ("done", lambda r: r["completed"], "d", 6),
    ("failed", lambda r: r["failed"], "d", 7),
    ("time (s)", lambda r: r["duration_s"], ".2f", 9),
    ("req/s", lambda r: r["request_throughput"], ".2f", 8),
    ("out tok/s", lambda r: r["output_tokens_per_s"], ".1f", 11),
    ("total tok/s", lambda r: r["total_tokens_per_s"], ".1f", 12),
] + [
    (f"{name.upper()} {p}", lambda r, k=f"{name}_ms", p=p: r[k][p], ".1f", 10)
    for name in ("ttft", "tpot", "itl", "e2e")
    for p in ("p50", "p99")
]


def format_table(record: dict[str, Any]) -> str:
    """One row per rate; latencies in ms, their mean and p90 are in the JSON line."""
    lines = [
        f"{PROG}: {record['model']} at {record['base_url']}",
        f"workload: {record['workload']['description']}",
        "rate: requests/s (inf: all at once); cap/peak: requests in flight, the limit and "
        "the most seen; latencies in ms (mean, p90: the JSON line)",
        "",
        "".join(f"{name:>{width}}" for name, _, _, width in COLUMNS),
    ]
    for run in record["runs"]:
        lines.append(
            "".join(f"{_cell(get(run), spec):>{width}}" for _, get, spec, width in COLUMNS)
        )
    for run in record["runs"]:
        if run["failed"]:
            lines.append(
                f"rate {run['request_rate']}: {run['failed']} failed, the first: "
                f"{run['first_error']}"
            )
    return "\n".join(lines)


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else format(value, spec)  # "inf" stays "inf"


# ------------------------------------------------------------------ the command
def _base_url(text: str) -> Endpoint:
    try:
        return Endpoint.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rates(text: str) -> tuple[float, ...]:
    """Parse "1,4.5,inf" into (1.0, 4.5, inf): requests per second, each > 0."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected numbers or inf, separated by commas, got {part.strip()!r}"
            ) from None
        if not rate > 0:  # NaN too
            raise argparse.ArgumentTypeError(
                f"a rate is requests per second, > 0 (or inf), got {part.strip()!r}"
            )
        rates.append(rate)
    return tuple(rates)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Send the throughput draw (docs/gpu.md) to an OpenAI-compatible server as "
        "streamed /v1/completions\nand measure TTFT, TPOT, ITL, E2E and throughput per request "
        "rate; print a table, then one JSON line.",
        epilog="docs/benchmarks.md, 'Serving': what each figure means.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s = p.add_argument_group("server")
    s.add_argument(
        "--base-url",
        type=_base_url,
        default=DEFAULT_BASE_URL,
        metavar="URL",
        help=f"the server's root (default {DEFAULT_BASE_URL}; a trailing /v1 is dropped)",
    )
    s.add_argument("--model", help="the model name to send (default: the first of GET /v1/models)")
    s.add_argument(
        "--api-key",
        metavar="KEY",
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, if set)",
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--num-requests",
        type=positive_int,
        default=DEFAULT_NUM_REQUESTS,
        metavar="N",
        help=f"requests per rate (default {DEFAULT_NUM_REQUESTS})",
    )
    w.add_argument(
        "--max-prompt-len",
        type=positive_int,
        metavar="N",
        help="scale the drawn prompt lengths (100..1024) to <= N",
    )
    w.add_argument(
        "--max-output-len",
        type=positive_int,
        metavar="N",
        help="scale the drawn output lengths (100..1024) to <= N",
    )
    w.add_argument(
        "--vocab-size",
        type=positive_int,
        metavar="N",
        help="fold the prompt ids (0..10000) into [0, N) for a model with a smaller vocabulary",
    )
    w.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="leave out ignore_eos (for servers that reject it); requests may then stop early",
    )
    a = p.add_argument_group("arrivals")
    a.add_argument(
        "--request-rate",
        type=_rates,
        default=(math.inf,),
        metavar="R,R,...",
        help="requests per second, Poisson arrivals; inf sends all at once. Each rate is "
        "one run, in order (default inf)",
    )
    a.add_argument(
        "--max-concurrency",
        type=positive_int,
        metavar="N",
        help="at most N requests in flight; the others wait for a slot (default: no limit)",
    )
    a.add_argument(
        "--seed",
        type=whole_number,
        default=0,
        help="seed of the arrival gaps, random.Random(SEED) per run (default 0)",
    )
    a.add_argument(
        "--timeout",
        type=positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds a request may take before it counts as failed (default "
        f"{DEFAULT_TIMEOUT_S:g}; GET /v1/models: at most {MODELS_TIMEOUT_S:g})",
    )
    a.add_argument(
        "--no-warmup", action="store_true", help="skip the warm-up request before the first run"
    )
    a.add_argument(
        "--client-processes",
        type=positive_int,
        default=1,
        metavar="N",
        help="send the requests from N processes, each with its own event loop, for servers "
        "that stream more events than one client core reads (50,000-300,000/s); the "
        "arrivals and the cap stay in one place (default 1)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="also write the JSON line to PATH")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.json:
            try:  # before the run: a file that is not a bench record is never lost
                report.check_json_path(args.json)
            except ValueError as e:
                parser.error(str(e))
    except SystemExit as e:  # --help (0) or a usage error (2)
        return int(e.code or 0)
    try:
        record = asyncio.run(_bench(args, argv))
    except BenchError as e:
        return error(PROG, e)
    report.emit(record, format_table(record), args.json)
    return 0


async def _bench(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    endpoint: Endpoint = args.base_url
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    # 1. The server is up, takes our key, and names its model.
    models = await served_models(endpoint, headers, min(args.timeout, MODELS_TIMEOUT_S))
    if args.model is None and not models:
        raise BenchError(f"{endpoint.url('/v1/models')} lists no model: name one with --model")
    model = args.model or models[0]
    if model not in models:
        _log(f"note: {model!r} is not among the served models {models}")
    client = Client(endpoint, model, headers, not args.no_ignore_eos, args.timeout)
    work = workloads.draw_throughput(
        args.num_requests, args.max_prompt_len, args.max_output_len, args.vocab_size
    )
    _log(f"{model} at {endpoint.url()}: {work.description}")

    # 2. One short request, not measured: first-call costs (compilation, caches) go here.
    if not args.no_warmup:
        warm = workloads.warmup_workload(args.vocab_size)
        result = await send_completion(client, warm.prompts[0], warm.max_tokens[0])
        if not result.ok:
            raise BenchError(
                f"the warm-up request to {endpoint.url('/v1/completions')} failed: {result.error}"
            )

    # 3. Each rate in turn, on the same server.
    processes = None
    if args.client_processes > 1:
        _log(f"starting {args.client_processes} client processes")
        processes = ClientProcesses(client, args.client_processes)
    try:
        if processes is not None:
            await processes.start()
        runs = await _runs(args, client, work, processes)
    finally:
        if processes is not None:
            processes.close()

    eos = "EOS ignored" if client.ignore_eos else "EOS honoured (requests may stop early)"
    return {
        "bench": "serve",
        "base_url": endpoint.url(),
        "model": model,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "workload": {
            "name": work.name,
            "description": f"{work.description}, greedy, {eos}, streamed /v1/completions",
            "num_requests": work.num_requests,
            "prompt_tokens": work.prompt_tokens,
            "max_tokens_sum": work.output_tokens,
            "max_prompt_len": args.max_prompt_len,
            "max_output_len": args.max_output_len,
            "vocab_size": args.vocab_size,
            "ignore_eos": client.ignore_eos,
            "request_rates": [_rate_text(r) if math.isinf(r) else r for r in args.request_rate],
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
            "timeout_s": args.timeout,
            "warmup": not args.no_warmup,
            "client_processes": args.client_processes,
        },
        "runs": runs,
        "command": f"{PROG} {_quoted(argv)}",
    }


async def _runs(
    args: argparse.Namespace,
    client: Client,
    work: workloads.Workload,
    processes: ClientProcesses | None,
) -> list[dict[str, Any]]:
    runs = []
    for rate in args.request_rate:
        _log(f"rate {_rate_text(rate)}: sending {work.num_requests} requests")
        results, peak = await run_rate(
            client, work, rate, args.max_concurrency, args.seed, processes
        )
        run = run_record(rate, args.max_concurrency, peak, results)
        _log(
            f"rate {_rate_text(rate)}: {run['completed']} completed, {run['failed']} failed in "
            f"{run['duration_s']:.2f} s, {run['output_tokens_per_s'] or 0:.1f} output tokens/s"
        )
        runs.append(run)
    return runs


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _quoted(argv: list[str]) -> str:
    """The command line for the record, with the API key's value hidden."""
    shown, hide = [], False
    for arg in argv:
        if hide:
            arg, hide = "***", False
        else:
            name, eq, _ = arg.partition("=")
            if len(name) > 3 and "--api-key".startswith(name):  # argparse takes "--api" too
                arg, hide = (f"{name}=***", False) if eq else (arg, True)
        shown.append(shlex.quote(arg))
    return " ".join(shown)


def _log(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)
