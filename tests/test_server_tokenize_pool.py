"""Long prompts tokenized in worker processes (server/tokenize_pool.py): the
same ids as the HTTP process's own tokenizer, for completions, chat and
/tokenize; short texts stay in the HTTP process.

Oracle: the tokenizer itself, in this process.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from pagedllm.server.tokenize_pool import POOL_MIN_CHARS, TokenizePool  # noqa: E402
from server_helpers import MODEL, Server  # noqa: E402

LONG = "The page table maps each request's tokens to pages of the cache. " * 8


class CountingPool(TokenizePool):
    """The pool, counting the texts sent to its workers."""

    sent = 0

    async def encode_many(self, texts, add_special_tokens):
        self.sent += len(texts)
        return await super().encode_many(texts, add_special_tokens)

    async def encode_chat(self, messages):
        self.sent += 1
        return await super().encode_chat(messages)


@pytest.fixture(scope="module")
def served(smollm2):
    from pagedllm.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(smollm2.source_path)
    pool = CountingPool(tok, 2)
    pool.start()
    # Every worker is up before the first request: none is started mid-burst.
    assert pool.num_processes == 2
    s = Server(smollm2, app_options={"tokenize_workers": pool})
    yield s, tok, pool
    s.stop()
    pool.shutdown()


def post(server: Server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_long_prompts_get_the_same_ids_from_the_workers(served):
    server, tok, pool = served
    assert len(LONG) > POOL_MIN_CHARS
    status, reply = post(server, "/tokenize", {"prompt": LONG})
    assert status == 200 and reply["tokens"] == tok.encode(LONG, add_special_tokens=True)
    messages = [{"role": "user", "content": LONG}]
    status, reply = post(server, "/tokenize", {"messages": messages})
    assert status == 200 and reply["tokens"] == tok.encode_chat(messages)
    # Two prompts in one request: each its own ids, in order (usage counts them).
    other = LONG.upper()
    status, reply = post(
        server, "/v1/completions", {"model": MODEL, "prompt": [LONG, other], "max_tokens": 1}
    )
    want = len(tok.encode(LONG, add_special_tokens=True)) + len(
        tok.encode(other, add_special_tokens=True)
    )
    assert status == 200 and reply["usage"]["prompt_tokens"] == want
    assert pool.sent == 4  # every long text went to a worker
    status, reply = post(server, "/tokenize", {"prompt": "Hi"})
    assert reply["tokens"] == tok.encode("Hi", add_special_tokens=True) and pool.sent == 4
