"""Small helpers shared by every layer (stdlib only)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the number of pages of `b` tokens that hold `a` tokens."""
    return -(-a // b)


def plural(n: int, word: str, plural_word: str | None = None) -> str:
    """`1 page`, `2 pages` (the count and the word, agreed)."""
    return f"{n} {word if n == 1 else (plural_word or word + 's')}"


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold back Ctrl-C (SIGINT) until the block ends, then raise it.

    Why: bookkeeping that spans layers (the scheduler's queues, the block
    manager's tables, the engine's per-request state) must change all or
    nothing. Python raises KeyboardInterrupt between any two bytecodes, so a
    Ctrl-C inside `BlockManager.admit` could lose pages for ever. Inside
    this block a SIGINT is only noted; the KeyboardInterrupt comes when the
    block has finished and the state is whole again. Long work (the forward
    pass) stays outside such blocks, so Ctrl-C stays prompt.

    Signal handlers run only in the main thread, so elsewhere (where SIGINT is
    never delivered) this does nothing. Nested blocks defer to the outermost.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or getattr(previous, "_pagedllm_deferring", False):
        yield  # a handler not set from Python (left alone), or an outer block defers
        return
    pending: list[tuple[int, object]] = []

    def note(signum: int, frame: object) -> None:
        pending.append((signum, frame))

    note._pagedllm_deferring = True  # type: ignore[attr-defined]
    try:
        signal.signal(signal.SIGINT, note)
    except (ValueError, TypeError):  # not the main interpreter, or no handler to swap
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            if callable(previous):
                previous(*pending[0])  # the default handler raises KeyboardInterrupt
            elif previous == signal.default_int_handler or previous == signal.SIG_DFL:
                raise KeyboardInterrupt
