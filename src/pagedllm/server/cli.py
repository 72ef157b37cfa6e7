"""`pagedllm serve`: the OpenAI-compatible HTTP server.

    pagedllm serve                                   # the default model on 127.0.0.1:8000
    pagedllm serve --model path/to/Llama-3.2-1B-Instruct --port 8080 --api-key secret
    pagedllm serve --preset llama-3.2-1b --load-format dummy   # random weights, to load-test

Every request is logged in one line when it ends (client, method, path, status,
prompt and completion tokens, seconds, request id); the prompt's text only
with --log-requests, --no-access-log for none.

Two processes: this one (HTTP: parsing, the chat template, tokenizing,
detokenizing, stop strings, SSE, metrics) and the engine core's (the
scheduler, the KV pool, the model, sampling: engine/core_process.py), which
starts first and loads the model while this one loads its tokenizer. If the
core dies, /health turns 503 at once, every request in flight ends (a stream
with an error event and `data: [DONE]`, any other with a 503), and the server
exits 1 with one line naming the cause; if this process dies, the core exits.

Engine flags are those of `pagedllm` (engine_args.py), with optimistic
admission by default (a server's requests come and go; reserving every page a
request might write would leave most of the pool idle). The port is bound
before the model loads: a bad --host or --port (exit 2) or a busy port (exit
1) is one line at once, not an error after the load.

Slow clients: a connection must send a request's headers within
--header-timeout seconds (of connecting, or of starting its next request) and
its body within --body-timeout seconds of the headers (else a 408); an idle
keep-alive connection is closed after --keep-alive-timeout seconds.

Ctrl-C or SIGTERM: stop accepting, give in-flight requests
`--shutdown-timeout` seconds, then end each one cleanly (a stream gets an
error event and `data: [DONE]`, any other request a 503), exit 0. A second
Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import ipaddress
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pagedllm.cli_errors import EXIT_FAILED, EXIT_USAGE, error
from pagedllm.engine_args import (
    add_engine_arguments,
    checked,
    engine_config_from_args,
    number,
    positive_float,
    positive_int,
    whole_number,
)
from pagedllm.model_source import (
    ModelSpec,
    add_model_source_arguments,
    engine_model,
    load_tokenizer,
    model_spec_from_args,
)

PROG = "pagedllm serve"
DEFAULT_KEEP_ALIVE_S = 5.0  # uvicorn's and vLLM's
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0  # app.DEFAULT_BODY_TIMEOUT_S (app.py imports fastapi)
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
# After --shutdown-timeout the app ends its requests itself; uvicorn cuts what
# is still open this much later (a client that does not read its reply).
SHUTDOWN_GRACE_S = 3.0
# A dead engine core: /health answers 503 this long before the server exits.
DEATH_EXIT_DELAY_S = 2.0

port_number = checked(whole_number, lambda v: 1 <= v <= 65535, "a port number from 1 to 65535")
seconds = checked(number, lambda v: v >= 0, "a number of seconds >= 0")


def host_address(text: str) -> str:
    """--host: an IPv4 or IPv6 address, or a host name (resolved when the port is bound)."""
    rule = f"must be an IPv4 or IPv6 address or a host name, got {text!r}"
    if not text.strip():
        raise argparse.ArgumentTypeError(rule)
    try:
        if ":" in text:
            ipaddress.IPv6Address(text)
        elif re.fullmatch(r"[0-9.]+", text):  # looks like IPv4: must be one (not 256.1.1.1)
            ipaddress.IPv4Address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(rule) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("server")
    g.add_argument(
        "--host",
        type=host_address,
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1)",
    )
    g.add_argument("--port", type=port_number, default=8000, help="port (default 8000)")
    g.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize"
    )
    g.add_argument(
        "--served-model-name", help="the model's name in the API (default: its file name)"
    )
    g.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=4 << 20,
        help="largest request body (default 4 MiB)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=positive_int,
        default=1024,
        help="requests waiting or running at most; past it a 503 asks to retry (default 1024)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="S",
        help="seconds in-flight requests get to finish on Ctrl-C/SIGTERM; then each ends "
        "with an error (default 10)",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=positive_float,
        default=DEFAULT_KEEP_ALIVE_S,
        metavar="S",
        help="seconds an idle keep-alive connection stays open (default 5)",
    )
    g.add_argument(
        "--header-timeout",
        type=positive_float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="S",
        help="seconds a connection gets to send a request's headers; then it is closed "
        "(default 10)",
    )
    g.add_argument(
        "--body-timeout",
        type=positive_float,
        default=DEFAULT_BODY_TIMEOUT_S,
        metavar="S",
        help="seconds a request's body may take to arrive after its headers; then a 408 "
        "(default 30)",
    )
    g.add_argument(
        "--tokenizer-workers",
        type=whole_number,
        metavar="N",
        help="processes that tokenize long prompts, so that many at once do not queue "
        "on the HTTP process (default: half the cores beyond 2, at most 8; 0: none)",
    )
    g.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one line per request: client, path, status, tokens in/out, seconds (default on)",
    )
    g.add_argument(
        "--log-requests",
        action="store_true",
        help="also log each completion request's body, prompt text included (default off)",
    )
    groups = add_engine_arguments(p, defaults={"admission": "optimistic"})
    add_model_source_arguments(groups["model"], tokenizer=True)
    return p


def serve_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = engine_config_from_args(args, parser)
    spec = model_spec_from_args(parser, args)
    # The port first: a busy port or a bad address is an answer at once, not
    # after the model has loaded. Nothing listens on it until the server starts.
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as e:
        message, code = _listen_error(e, args.host, args.port)
        if code == EXIT_USAGE:
            parser.error(message)
        return error(PROG, message, code)
    install = "install the server extra: pip install 'pagedllm[server]'"
    try:
        from pagedllm.server.core_client import EngineCoreClient
    except ImportError as e:
        sock.close()
        return error(PROG, f"{e}; {install}")
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[serve] {message}", file=sys.stderr, flush=True)

    if spec.load_format == "dummy":
        log(f"{spec.describe()}: making random weights")
    # The core process loads the model (every rank its own slice, with
    # --tensor-parallel-size: a preset is its directory with dummy weights)
    # while this process loads the tokenizer; the port listens once both are done.
    engine = EngineCoreClient(config.replace(**engine_model(spec)), tokenizer_spec=spec)
    workers = None
    try:
        engine.start_process()  # first: the rest of start-up runs beside its load
        import uvicorn  # noqa: F401

        from pagedllm.server.app import build_app

        engine.set_tokenizer(_tokenizer(spec, config, log))  # the core learns its EOS ids
        workers = _tokenize_pool(engine.tokenizer, args.tokenizer_workers, log)
        log(f"HTTP side ready after {time.perf_counter() - t0:.1f} s")
        ready = engine.wait_ready()
        _check_vocab(engine.tokenizer, ready.vocab_size)
    except BaseException as e:  # Ctrl-C while loading too: the core must not outlive us
        engine.shutdown()
        if workers is not None:
            workers.shutdown()
        sock.close()
        if isinstance(e, ImportError):
            return error(PROG, f"{e}; {install}")
        if isinstance(e, (ValueError, FileNotFoundError, OSError)):
            return error(PROG, e)
        raise
    log(
        f"engine core ready after {time.perf_counter() - t0:.1f} s "
        f"(model loaded in {ready.load_time_s:.1f} s; pid {engine.process.pid})"
    )
    name = args.served_model_name or _model_name(ready.model_path, spec)
    app = build_app(
        engine,
        name,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_queued_requests=args.max_queued_requests,
        access_log=_access_logger() if args.access_log else None,
        log_requests=args.log_requests,
        body_timeout=args.body_timeout,
        tokenize_workers=workers,
    )
    host = f"[{args.host}]" if ":" in args.host else args.host
    log(f"serving {name!r} on http://{host}:{args.port}/v1 (Ctrl-C to stop)")
    server = make_server(
        app,
        keep_alive_timeout=args.keep_alive_timeout,
        header_timeout=args.header_timeout,
        shutdown_timeout=args.shutdown_timeout,
    )
    died: list[str] = []

    def on_death(why: str) -> None:
        # Every request in flight has already been ended (core_client). For a
        # moment /health answers 503 with the cause (what a load balancer probes
        # for), then the server stops.
        died.append(why)
        asyncio.get_running_loop().call_later(DEATH_EXIT_DELAY_S, _exit, server)

    engine.on_death = on_death
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()  # the core aborts what is left and exits
        if workers is not None:
            workers.shutdown()
    if died:
        return error(PROG, f"the engine core stopped: {died[0]}")
    return 0


def _exit(server: Any) -> None:
    server.should_exit = True


def _tokenize_pool(tokenizer: Any, workers: int | None, log: Any) -> Any:
    """Started tokenizer processes (tokenize_pool.py), or None: none asked for,
    or no tokenizer. Default: half the usable cores beyond two (one for this
    process, one for the engine core), at most 8."""
    from pagedllm.cpu_threads import usable_cores
    from pagedllm.server.tokenize_pool import TokenizePool

    if workers is None:
        workers = min(8, max(0, (usable_cores() - 2) // 2))
    if tokenizer is None or workers == 0:
        return None
    pool = TokenizePool(tokenizer, workers)
    pool.start()
    log(f"{workers} tokenizer process{'es' if workers > 1 else ''}")
    return pool


def _tokenizer(spec: ModelSpec, config: Any, log: Any) -> Any:
    """This process's tokenizer: the one `spec` asks for, else the model's own
    (None: token-id prompts only), as the engine core finds it."""
    from pagedllm.engine.llm_engine import load_model_tokenizer
    from pagedllm.resolve import resolve_model_path

    tok = load_tokenizer(spec, log)
    if tok is not None or spec.load_format == "dummy":
        return tok
    return load_model_tokenizer(resolve_model_path(config.replace(**engine_model(spec)).model), log)


def _check_vocab(tokenizer: Any, model_vocab: int) -> None:
    """A tokenizer with ids the model cannot embed is refused (ValueError); the
    core has logged the other case."""
    from pagedllm.engine.llm_engine import check_vocab_sizes

    if tokenizer is not None:
        check_vocab_sizes(model_vocab, tokenizer.vocab_size, lambda m: None)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), as uvicorn binds one (SO_REUSEADDR);
    it listens once the server starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _listen_error(e: OSError, host: str, port: int) -> tuple[str, int]:
    """Why (host, port) cannot be bound, in one line, and the exit code."""
    if isinstance(e, socket.gaierror):
        return f"argument --host: cannot resolve {host!r} ({e.strerror})", EXIT_USAGE
    if e.errno == errno.EADDRNOTAVAIL:
        return f"argument --host: {host} is not an address of this machine", EXIT_USAGE
    if e.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use (another server?); "
            f"stop it or pick another --port",
            EXIT_FAILED,
        )
    if e.errno == errno.EACCES:
        return f"no permission to listen on {host}:{port} (ports below 1024 need it)", EXIT_FAILED
    return f"cannot listen on {host}:{port}: {e.strerror or e}", EXIT_FAILED


def make_server(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_S,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    log_level: str = "info",
):
    """uvicorn's Server for `app` (build_app's), with the timeouts and the clean
    shutdown (`app.state.in_flight.drain`). `host`/`port` are used only when
    `run()` gets no socket."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,  # ours (AccessLog) has the tokens and the time
        http=_header_timeout_protocol(header_timeout),
        timeout_keep_alive=keep_alive_timeout,  # type: ignore[arg-type]
        timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_GRACE_S,  # type: ignore[arg-type]
    )
    in_flight = app.state.in_flight

    class Server(uvicorn.Server):
        """Ctrl-C and SIGTERM only ask it to shut down gracefully (uvicorn itself
        re-raises the signal once it has stopped, which would make the exit
        status -15 or a traceback instead of 0); a second Ctrl-C forces the exit.
        Its shutdown also drains the app: requests in flight get
        `shutdown_timeout` seconds, then the app ends each one cleanly."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield  # signals reach the main thread only (a test's server on a thread)
                return

            def stop(signum, frame):
                if self.should_exit and signum == signal.SIGINT:
                    self.force_exit = True  # a second Ctrl-C: exit now, as uvicorn does
                self.should_exit = True

            previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        async def shutdown(self, sockets=None) -> None:
            drain = asyncio.ensure_future(in_flight.drain(shutdown_timeout))
            try:
                await super().shutdown(sockets)
            finally:
                drain.cancel()

    return Server(config)


def _header_timeout_protocol(timeout: float) -> type:
    """uvicorn's HTTP/1.1 protocol (h11 or httptools, whichever it picks), closing
    a connection that does not finish a request's line and headers within
    `timeout` seconds of connecting, or of the first byte of its next request.
    uvicorn has no such timeout: a client that never finishes its headers (or
    never sends any) would hold its connection forever. Idle time between
    requests is uvicorn's own keep-alive timeout."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_cycle: Any = None  # the request cycle when the timer started

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._start_head_timer()

        def data_received(self, data: bytes) -> None:
            between_requests = self.cycle is None or self.cycle.response_complete
            # The first bytes of a next request start its timer (a trickle does not restart it).
            if between_requests and (
                self._head_timer is None or self._head_cycle is not self.cycle
            ):
                self._start_head_timer()
            super().data_received(data)

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _start_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_cycle = self.cycle
            self._head_timer = self.loop.call_later(timeout, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            # A new cycle means the headers came: nothing to do.
            if self.cycle is self._head_cycle and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


def _model_name(path: str | None, spec: ModelSpec) -> str:
    if path is None:
        return spec.name
    return Path(path).name.removesuffix(".gguf")


def _access_logger():
    """Access lines on stderr, timestamped like uvicorn's own."""
    import logging

    logger = logging.getLogger("pagedllm.access")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s [access] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger.info
