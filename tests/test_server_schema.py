"""The server against its own OpenAPI schema (schemathesis): requests generated
from /openapi.json, valid and not, must never get a 5xx.

The default run tries a few examples per route, derandomized (the ci profile);
`pytest -m slow` runs many more. A real server (uvicorn and its engine-core
process, tests/server_helpers.py) serves SmolLM2 with a 64-token context, so
a generated request without max_tokens stays short. The cases come from the
app's own OpenAPI document.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, settings  # noqa: E402

from server_helpers import Server  # noqa: E402


@pytest.fixture(scope="module")
def _server(smollm2_path):
    s = Server(None, path=str(smollm2_path), kv_cache_mib=16, max_model_len=64)
    yield s
    s.stop()


def _schema():
    """The app's OpenAPI document: its routes and body models, which need no engine
    (a stand-in with the fields build_app reads stands for the core's client)."""
    from types import SimpleNamespace

    from pagedllm.server.app import build_app

    stand_in = SimpleNamespace(tokenizer=None, max_model_len=64, pool_tokens=352, gauges=None)
    return schemathesis.openapi.from_dict(build_app(stand_in, "m").openapi())


schema = _schema()


QUICK = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
THOROUGH = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def check(case, server) -> None:
    response = case.call(base_url=server.url)
    assert response.status_code < 500, (
        f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:300]}"
    )
    if response.status_code >= 400 and case.path != "/metrics":
        error = response.json()["error"]
        assert error["message"] and error["type"]  # OpenAI's error shape


@schema.parametrize()
@QUICK
def test_no_request_gets_a_5xx(case, _server):
    check(case, _server)


@pytest.mark.slow
@schema.parametrize()
@THOROUGH
def test_no_request_gets_a_5xx_searched_longer(case, _server):
    check(case, _server)
