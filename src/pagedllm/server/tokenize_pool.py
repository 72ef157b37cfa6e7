"""Tokenizing in worker processes, so that many prompts at once do not queue on
the HTTP process's one core.

Why: our byte-level BPE is Python. A 512-token prompt takes about 3-8 ms to
encode (a chat template adds its rendering), and 200 prompts sent at once
would take a second of the event loop, in turn: the last one's time to first
token is then the tokenizer's, not the engine's. `--tokenizer-workers N`
spreads them over N processes, each with its own copy of the tokenizer (sent
once, when it starts). A text is small to send and its ids small to return,
so a round trip costs well under a millisecond.

Owns: the worker processes and what runs in them (`encode`, `encode_chat`,
`decode`). Does not own: the decision of what goes here (app.py sends texts
over `POOL_MIN_CHARS` characters; shorter ones are encoded in place).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import time
from typing import Any

# Texts shorter than this are encoded in place: a round trip to a worker costs
# more than ~50 tokens of BPE.
POOL_MIN_CHARS = 256

_tokenizer: Any = None  # in each worker: its copy


def _init(tokenizer: Any) -> None:
    global _tokenizer
    _tokenizer = tokenizer


def _started(hold_s: float) -> int:
    """This worker's pid, after holding it busy for `hold_s` (see `start`)."""
    time.sleep(hold_s)
    return os.getpid()


def _encode_many(texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    return [_tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]


def _encode_chat(messages: list[dict[str, str]]) -> list[int]:
    return _tokenizer.encode_chat(messages)


def _decode(ids: list[int]) -> str:
    return _tokenizer.decode(ids)


class TokenizePool:
    """N worker processes, each holding a copy of `tokenizer`."""

    def __init__(self, tokenizer: Any, workers: int) -> None:
        self.workers = workers
        self._executor = concurrent.futures.ProcessPoolExecutor(
            workers,
            # Spawned, not forked: the HTTP process has threads (ZMQ's, uvicorn's).
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init,
            initargs=(tokenizer,),
        )

    def start(self) -> None:
        """Start every worker now, while the engine core loads, not at the first
        requests. The executor starts a process only when a task finds no idle
        one, and starting one blocks the caller while the tokenizer (megabytes)
        is written to it: on the event loop, in a burst, that held every request
        back for a second or two (H200, 7 workers). So tasks that keep their
        worker busy are sent until every worker has answered."""
        pids: set[int] = set()
        while len(pids) < self.workers:
            tasks = [self._executor.submit(_started, 0.2) for _ in range(self.workers)]
            pids.update(t.result() for t in tasks)

    @property
    def num_processes(self) -> int:
        """Worker processes alive now."""
        return sum(p.is_alive() for p in self._executor._processes.values())

    async def _run(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    async def encode_many(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return await self._run(_encode_many, texts, add_special_tokens)

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return await self._run(_encode_chat, messages)

    async def decode(self, ids: list[int]) -> str:
        return await self._run(_decode, ids)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
