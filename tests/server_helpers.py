"""A real pagedllm server for tests: uvicorn on a thread, on a free loopback
port, serving one engine thread (tests/test_server.py, tests/test_bench_serve.py)."""

from __future__ import annotations

import socket
import threading
import time

import openai
import uvicorn

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine_config import EngineConfig
from pagedllm.server.app import build_app
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
        **settings,
    ):
        """`model`: a loaded model, or None to load `path`; `app_options`: more keyword
        arguments of build_app; `settings`: EngineConfig's."""
        config = EngineConfig(kv_cache_mib=64, admission="optimistic", model=path, **settings)
        self.engine = LLMEngine(config, model, log=lambda s: None)
        self.thread = EngineThread(self.engine)
        self.thread.start()
        app = build_app(
            self.thread,
            MODEL,
            api_key=api_key,
            max_queued_requests=max_queued,
            **(app_options or {}),
        )
        self.port = free_port()
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(cfg)
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
        self._t.join(10)
        self.thread.stop()
