"""A stub OpenAI-compatible streaming server that costs as little as it can per
event, so that a benchmark of `pagedllm bench serve`'s client measures the
client alone.

    python -m pagedllm.bench.serve_stub --port 0                   # as fast as it can write
    python -m pagedllm.bench.serve_stub --port 0 --tokens-per-s 50  # one token per 20 ms

It prints one line, `listening on http://HOST:PORT`, on stdout once it accepts
connections, then serves until it is killed (SIGTERM or SIGINT).

What it answers (HTTP/1.1, one request per connection, `Connection: close`):

- `GET /v1/models`: OpenAI's model list with one id (`--model`, default "stub").
- `POST /v1/completions` (a JSON body; `max_tokens` is read, the prompt is
  not): a `text/event-stream` body in chunked framing, as uvicorn sends
  pagedllm's and vLLM's streams. `max_tokens` events of one token each, the
  shape pagedllm sends (`{"id", "object": "text_completion", "created",
  "model", "choices": [{"index": 0, "text", "logprobs": null,
  "finish_reason"}]}`, finish_reason "length" on the last), then the usage
  event (`"choices": []` and `usage.completion_tokens`), then `data: [DONE]`.
  One event per chunk. The texts cycle through a few words, one of them
  non-ASCII.
- Anything else: 404, with OpenAI's error shape.

Pace. By default a stream is written as fast as the socket takes it (the
bytes are built once per request and written in slices of `SLICE_EVENTS`
events under the transport's flow control), so the client reads many events
per read. With `--tokens-per-s R` one clock ticks every 1/R s and each tick
writes the next event of every open stream, as a batched engine's decode step
does: each stream gets R tokens per second and, with many streams, the client
reads one event per stream per tick. A tick that comes late is not made up.

Why it is cheap: one asyncio Protocol per connection (no stream objects), the
events' bytes made from a per-request template by concatenation (no JSON
encoding per event), and one write per slice or per tick. It imports the
standard library only and runs in its own process (scripts/bench_client.py
starts it), so its CPU is not the client's.

Owns: the stub (`StubServer`, `serve`, `main`). Does not own: the client
(serve_bench.py) or the benchmark of it (scripts/bench_client.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from typing import Any

WORDS = (" the", " quick", " brown", " fox", " jumps", " over", " lazy", " café")
SLICE_EVENTS = 256  # events per write at full speed
MAX_HEAD = 1 << 16


def _chunk(payload: bytes) -> bytes:
    """One SSE event in one HTTP chunk: `SIZE\\r\\ndata: PAYLOAD\\n\\n\\r\\n`."""
    data = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


class Stream:
    """The events of one completion, as chunks, made on demand from a template."""

    def __init__(self, rid: str, model: str, max_tokens: int, prompt_tokens: int) -> None:
        head = json.dumps(
            {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
        )[:-1].encode()  # without its closing brace
        choice = head + b', "choices": [{"index": 0, "text": '
        self.texts = [  # the events of each word, but the last token's
            _chunk(
                choice + json.dumps(w).encode() + b', "logprobs": null, "finish_reason": null}]}'
            )
            for w in WORDS
        ]
        last_word = json.dumps(WORDS[(max_tokens - 1) % len(WORDS)]).encode()
        self.last = _chunk(choice + last_word + b', "logprobs": null, "finish_reason": "length"}]}')
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens,
        }
        self.tail = _chunk(head + b', "choices": [], "usage": ' + json.dumps(usage).encode() + b"}")
        self.tail += _chunk(b"[DONE]") + b"0\r\n\r\n"
        self.n = max_tokens
        self.sent = 0  # events of text sent

    @property
    def done(self) -> bool:
        return self.sent > self.n

    def take(self, k: int) -> bytes:
        """The next `k` text events' chunks; the last one brings the usage event and [DONE]."""
        a, b = self.sent, min(self.sent + k, self.n)
        words = len(self.texts)
        out = b"".join([self.texts[i % words] for i in range(a, min(b, self.n - 1))])
        if b == self.n:
            out += self.last + self.tail
            b += 1
        self.sent = b
        return out


class StubServer:
    """The server's state: the open streams that the clock feeds, and a request counter."""

    def __init__(self, model: str, tokens_per_s: float | None) -> None:
        self.model = model
        self.tokens_per_s = tokens_per_s
        self.ticking: list[Connection] = []
        self.requests = 0
        self._tick_task: asyncio.Task[None] | None = None

    def start_clock(self) -> None:
        if self.tokens_per_s is not None:
            self._tick_task = asyncio.get_running_loop().create_task(self._clock())

    async def _clock(self) -> None:
        """Each tick, one event to every open stream (a decode step of all of them)."""
        assert self.tokens_per_s is not None
        period = 1.0 / self.tokens_per_s
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            deadline = max(deadline + period, loop.time())  # late: not made up
            await asyncio.sleep(deadline - loop.time())
            if self.ticking:
                self.ticking = [c for c in self.ticking if c.tick()]


class Connection(asyncio.Protocol):
    """One request, one response, then the connection closes."""

    def __init__(self, server: StubServer) -> None:
        self.server = server
        self.buffer = b""
        self.stream: Stream | None = None
        self.paused = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.stream is not None or self.transport is None or self.transport.is_closing():
            return  # one request per connection: anything after it is ignored
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD:
                self._answer(431, {"error": {"message": "the request's head is over 64 KiB"}})
            return
        lines = self.buffer[:end].decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        path = rest.partition(" ")[0]
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                try:
                    length = int(value)
                except ValueError:
                    self._answer(400, {"error": {"message": f"a bad Content-Length {value!r}"}})
                    return
        body = self.buffer[end + 4 :]
        if len(body) < length:
            return  # the body is still coming
        if method == "GET" and path.endswith("/v1/models"):
            card = {"id": self.server.model, "object": "model", "owned_by": "stub"}
            self._answer(200, {"object": "list", "data": [card]})
        elif method == "POST" and path.endswith("/v1/completions"):
            self._complete(body[:length])
        else:
            self._answer(404, {"error": {"message": f"no route {method} {path}"}})

    def _answer(self, status: int, obj: Any) -> None:
        assert self.transport is not None
        body = json.dumps(obj).encode()
        head = (
            f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()

    def _complete(self, body: bytes) -> None:
        try:
            request = json.loads(body)
            max_tokens = int(request.get("max_tokens") or 16)
            prompt = request.get("prompt")
            prompt_tokens = len(prompt) if isinstance(prompt, list) else 1
        except (ValueError, TypeError, AttributeError) as e:
            self._answer(400, {"error": {"message": f"a bad request body: {e}"}})
            return
        if max_tokens < 1:
            self._answer(400, {"error": {"message": "max_tokens must be >= 1"}})
            return
        self.server.requests += 1
        rid = f"cmpl-stub-{self.server.requests}"
        self.stream = Stream(rid, self.server.model, max_tokens, prompt_tokens)
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        )
        if self.server.tokens_per_s is None:
            self._pour()
        else:
            self.server.ticking.append(self)

    def _pour(self) -> None:
        """Full speed: write slices until the transport's buffer is full or the stream ends."""
        stream, transport = self.stream, self.transport
        assert stream is not None and transport is not None
        while not self.paused and not stream.done and not transport.is_closing():
            transport.write(stream.take(SLICE_EVENTS))
        if stream.done:
            transport.close()

    def tick(self) -> bool:
        """The clock's step: write the next event; False once the stream is over."""
        stream, transport = self.stream, self.transport
        assert stream is not None and transport is not None
        if transport.is_closing():
            return False
        transport.write(stream.take(1))
        if stream.done:
            transport.close()
            return False
        return True

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.stream is not None and self.server.tokens_per_s is None:
            self._pour()


async def serve(host: str, port: int, model: str, tokens_per_s: float | None) -> None:
    """Listen, say where on stdout, and serve until SIGTERM or SIGINT."""
    state = StubServer(model, tokens_per_s)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(state), host, port, backlog=4096)
    state.start_clock()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bound = server.sockets[0].getsockname()
    print(f"listening on http://{host}:{bound[1]}", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pagedllm.bench.serve_stub",
        description="A stub OpenAI-compatible server that streams /v1/completions as cheaply "
        "as it can, to benchmark the client of `pagedllm bench serve` alone.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port (default)")
    p.add_argument("--model", default="stub", help="the model id it serves (default stub)")
    p.add_argument(
        "--tokens-per-s",
        type=float,
        metavar="R",
        help="one token per stream every 1/R s, all streams on one clock (default: as fast "
        "as the socket takes them)",
    )
    args = p.parse_args(argv)
    if args.tokens_per_s is not None and not args.tokens_per_s > 0:
        p.error(f"--tokens-per-s is tokens per second, > 0, got {args.tokens_per_s:g}")
    if not 0 <= args.port <= 65535:
        p.error(f"--port is 0 (any free port) to 65535, got {args.port}")
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(args.host, args.port, args.model, args.tokens_per_s))
    except OSError as e:  # the address is taken, or not this machine's
        print(f"{p.prog}: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
