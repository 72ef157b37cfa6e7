"""A real pagedllm server for tests: uvicorn on a thread, on a free loopback
port, in front of an engine-core process (tests/test_server*.py,
tests/test_bench_serve.py), built as `pagedllm serve` builds it (server/cli.py's
make_server: its timeouts and its clean shutdown)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import openai

from pagedllm.engine.llm_engine import load_model_tokenizer
from pagedllm.engine_config import EngineConfig
from pagedllm.server.app import build_app
from pagedllm.server.cli import make_server
from pagedllm.server.core_client import EngineCoreClient

MODEL = "smollm2-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn on a thread, in front of one engine-core process."""

    def __init__(
        self,
        model,
        api_key: str | None = None,
        max_queued: int = 1024,
        app_options: dict | None = None,
        path: str | None = None,
        server_options: dict | None = None,
        kv_cache_mib: float = 64,
        **settings,
    ):
        """`model`: a loaded model (the core loads its file again), or None to load
        `path`; `app_options`: more keyword arguments of build_app;
        `server_options`: of make_server (timeouts); `settings`: EngineConfig's."""
        path = path if model is None else str(model.source_path)
        config = EngineConfig(
            kv_cache_mib=kv_cache_mib, admission="optimistic", model=path, **settings
        )
        self.engine = EngineCoreClient(
            config, tokenizer=load_model_tokenizer(Path(path), log=lambda m: None)
        )
        self.engine.start(timeout_s=120)
        self.app = build_app(
            self.engine,
            MODEL,
            api_key=api_key,
            max_queued_requests=max_queued,
            **(app_options or {}),
        )
        self.port = free_port()
        self.server = make_server(
            self.app, port=self.port, log_level="warning", **(server_options or {})
        )
        self._t = threading.Thread(target=self.server.run, daemon=True)
        self._t.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self._t.join(30)
        self.engine.shutdown()

    def wait_for(self, cond, what: str, timeout: float = 30) -> None:
        """Until `cond(gauges)` holds for the core's latest counters (core_process.Gauges)."""
        deadline = time.time() + timeout
        while not cond(self.engine.gauges):
            assert time.time() < deadline, f"timed out waiting: {what} ({self.engine.gauges})"
            time.sleep(0.02)
