"""`pagedllm serve`: the OpenAI-compatible HTTP server.

    pagedllm serve                                   # the default model on 127.0.0.1:8000
    pagedllm serve --model path/to/Llama-3.2-1B-Instruct --port 8080 --api-key secret
    pagedllm serve --preset llama-3.2-1b --load-format dummy   # random weights, to load-test

Every request is logged in one line when it ends (client, method, path, status,
prompt and completion tokens, seconds, request id); the prompt's text only
with --log-requests, --no-access-log for none.

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
from pagedllm.model_source import (
    ModelSpec,
    add_model_source_arguments,
    engine_model,
    load_tokenizer,
    model_spec_from_args,
)

PROG = "pagedllm serve"
GIL_SWITCH_INTERVAL_S = 0.0005


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
        if spec.load_format == "dummy":
            log(f"{spec.describe()}: making random weights")
        # The engine loads the model itself (every rank its own slice, with
        # --tensor-parallel-size): a preset is its directory with dummy weights.
        engine = LLMEngine(
            config.replace(**engine_model(spec)), None, load_tokenizer(spec, log), log=log
        )
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    name = args.served_model_name or _model_name(engine, spec)
    # The stepping thread waits on the GPU with the GIL released, then must win
    # it back from the event loop; at Python's default 5 ms interval that wait
    # is a whole step at batch 256 (on the H200, 0.5 ms took a saturated
    # Llama-3.2-1B server from 13,900 to 18,400 output tokens/s).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    thread = EngineThread(engine)
    thread.start()
    app = build_app(
        thread,
        name,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_queued_requests=args.max_queued_requests,
        access_log=_access_logger() if args.access_log else None,
        log_requests=args.log_requests,
    )
    log(f"serving {name!r} on http://{args.host}:{args.port}/v1 (Ctrl-C to stop)")
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        access_log=False,  # ours (AccessLog) has the tokens and the time
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = _graceful_server(config)
    try:
        server.run()
    finally:
        thread.stop()  # aborts what is left; pages go back
        engine.close()  # tensor-parallel workers, if any
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


def _model_name(engine, spec: ModelSpec) -> str:
    path = getattr(engine.model, "source_path", None)
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
