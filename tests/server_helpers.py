"""A real pagedllm server for tests: uvicorn on a thread, on a free loopback
port, serving one engine thread (tests/test_server*.py, tests/test_bench_serve.py),
built as `pagedllm serve` builds it (server/cli.py's make_server: its
timeouts and its clean shutdown)."""

from __future__ import annotations

import socket
import threading
import time

import openai

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine_config import EngineConfig
from pagedllm.server.app import build_app
from pagedllm.server.cli import make_server
from pagedllm.server.engine_thread import EngineThread

MODEL = "smollm2-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn on a thread, serving one engine thread."""

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
        """`model`: a loaded model, or None to load `path`; `app_options`: more keyword
        arguments of build_app; `server_options`: of make_server (timeouts);
        `settings`: EngineConfig's."""
        config = EngineConfig(
            kv_cache_mib=kv_cache_mib, admission="optimistic", model=path, **settings
        )
        self.engine = LLMEngine(config, model, log=lambda s: None)
        self.thread = EngineThread(self.engine)
        self.thread.start()
        self.app = build_app(
            self.thread,
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
        self.thread.stop()
