"""Compiling requests' constraints off the stepping thread (issue 37).

Owns: `ConstraintCompiler`, the engine's one entry to `structured/`: a
request's `StructuredOutput` in, a future of its compiled constraint out.
Does not own: the constraint, its compilation or its matcher
(`structured/matcher.py`), masking the logits (the runner) or when a request
runs (the engine holds a compiling request outside the scheduler; the
scheduler knows nothing of grammars).

Two costs stay off the step loop. Once per engine: the tokenizer's adapter
(every id's bytes: 0.2-0.8 s for SmolLM2's or Llama 3's vocabulary), and, in
the engine core of `pagedllm serve`, which loads no tokenizer at start-up, the
tokenizer itself. Once per distinct constraint: its compilation
(milliseconds; cached by `constraint_cache`). Both run on worker threads
while the engine steps the other requests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class ConstraintCompiler:
    """`submit(constraint)` -> a Future of its `CompiledConstraint`.

    `tokenizer`: the engine's; None with a `loader` (the engine core) loads one
    on the first submit, on a thread of its own."""

    def __init__(self, tokenizer: Any, loader: Callable[[], Any] | None = None) -> None:
        self._tokenizer = tokenizer
        self._loader = loader
        self._cache: Future | None = None  # of structured.ConstraintCache
        self._lock = threading.Lock()

    def submit(self, constraint: Any) -> Future:
        with self._lock:
            if self._cache is None:
                self._cache = Future()
                threading.Thread(
                    target=self._build_cache, name="pagedllm-constraints", daemon=True
                ).start()
            cache = self._cache
        out: Future = Future()

        def compile_on(done: Future) -> None:
            error = done.exception()
            if error is not None:
                out.set_exception(error)
                return
            inner = done.result().submit(constraint)
            inner.add_done_callback(lambda f: _copy(f, out))

        cache.add_done_callback(compile_on)
        return out

    def _build_cache(self) -> None:
        try:
            from pagedllm.structured import constraint_cache

            tokenizer = self._tokenizer
            if tokenizer is None and self._loader is not None:
                tokenizer = self._tokenizer = self._loader()
            if tokenizer is None:
                raise ValueError(
                    "structured output needs the model's tokenizer (its vocabulary as text), "
                    "and this model has none"
                )
            self._cache.set_result(constraint_cache(tokenizer))
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request
            self._cache.set_exception(e)


def _copy(src: Future, dst: Future) -> None:
    error = src.exception()
    if error is not None:
        dst.set_exception(error)
    else:
        dst.set_result(src.result())
