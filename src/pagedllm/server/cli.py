"""`pagedllm serve`: the OpenAI-compatible HTTP server.

    pagedllm serve                                   # the default model on 127.0.0.1:8000
    pagedllm serve --model path/to/Llama-3.2-1B-Instruct --port 8080 --api-key secret

Engine flags are those of `pagedllm` (engine_args.py), with optimistic
admission by default (a server's requests come and go; reserving every page a
request might write would leave most of the pool idle). Ctrl-C or SIGTERM:
stop accepting, give in-flight requests `--shutdown-timeout` seconds, abort
the rest, exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path

from pagedllm.engine_args import add_engine_arguments, engine_config_from_args, positive_int

PROG = "pagedllm serve"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=positive_int, default=8000, help="port (default 8000)")
    g.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
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
        type=positive_int,
        default=10,
        help="seconds in-flight requests get to finish on Ctrl-C/SIGTERM (default 10)",
    )
    add_engine_arguments(p, defaults={"admission": "optimistic"})
    return p


def serve_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = engine_config_from_args(args, parser)
    try:
        import uvicorn

        from pagedllm.server.app import build_app
        from pagedllm.server.engine_thread import EngineThread
    except ImportError as e:
        print(
            f"{PROG}: error: {e}; install the server extra: pip install 'pagedllm[server]'",
            file=sys.stderr,
        )
        return 1
    from pagedllm.engine.llm_engine import LLMEngine

    def log(message: str) -> None:
        print(f"[serve] {message}", file=sys.stderr)

    try:
        engine = LLMEngine(config, log=log)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    name = args.served_model_name or _model_name(engine)
    thread = EngineThread(engine)
    thread.start()
    app = build_app(
        thread,
        name,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_queued_requests=args.max_queued_requests,
    )
    log(f"serving {name!r} on http://{args.host}:{args.port}/v1 (Ctrl-C to stop)")
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = _graceful_server(config)
    try:
        server.run()
    finally:
        thread.stop()  # aborts what is left; pages go back
    return 0


def _graceful_server(config):
    """uvicorn's Server, except that Ctrl-C and SIGTERM only ask it to shut down
    gracefully: uvicorn itself re-raises the signal once it has stopped, which
    would make the exit status -15 (or a traceback) instead of 0."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            def stop(signum, frame):
                self.should_exit = True

            previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    return Server(config)


def _model_name(engine) -> str:
    path = getattr(engine.model, "source_path", None)
    if path is None:
        return "pagedllm"
    return Path(path).name.removesuffix(".gguf")
