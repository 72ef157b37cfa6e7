"""The server against its own OpenAPI schema (schemathesis): requests generated
from /openapi.json, valid and not, must never get a 5xx.

The default run tries a few examples per route, derandomized (the ci profile);
`pytest -m slow` runs many more. The server runs in-process (ASGI) on SmolLM2
with a 64-token context, so a generated request without max_tokens stays short.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, settings  # noqa: E402


def _serve():
    """The app and its engine thread (not started), on SmolLM2 in float32 (loaded
    once, when this module is collected)."""
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine_config import EngineConfig
    from pagedllm.model import load_model
    from pagedllm.resolve import default_model_path
    from pagedllm.server.app import build_app
    from pagedllm.server.engine_thread import EngineThread

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e), allow_module_level=True)
    model = load_model(path, device="cpu", dtype="float32")
    config = EngineConfig(kv_cache_mib=16, admission="optimistic", max_model_len=64)
    thread = EngineThread(LLMEngine(config, model, log=lambda s: None))
    return build_app(thread, "m"), thread


_app, _thread = _serve()
schema = schemathesis.openapi.from_asgi("/openapi.json", _app)


@pytest.fixture(scope="module", autouse=True)
def _engine_stepping():
    """The engine thread steps while this module's tests run, and only then: a
    server's thread keeps the collector frozen (`utils.gc_frozen`) while it
    runs, which the other modules' tests must not inherit."""
    _thread.start()
    yield
    _thread.stop()
    assert not _thread._thread.is_alive()


QUICK = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
THOROUGH = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def check(case) -> None:
    response = case.call()
    assert response.status_code < 500, (
        f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:300]}"
    )
    if response.status_code >= 400 and case.path != "/metrics":
        error = response.json()["error"]
        assert error["message"] and error["type"]  # OpenAI's error shape


@schema.parametrize()
@QUICK
def test_no_request_gets_a_5xx(case):
    check(case)


@pytest.mark.slow
@schema.parametrize()
@THOROUGH
def test_no_request_gets_a_5xx_searched_longer(case):
    check(case)
