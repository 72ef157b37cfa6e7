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


_gc_lock = threading.Lock()
_gc_depth = 0  # engine loops running now, in any thread
_gc_ours = False  # whether the freeze in force is this module's


@contextmanager
def gc_frozen() -> Iterator[None]:
    """Keep the objects that exist now out of the garbage collector's scans
    while the block (an engine's step loop) runs.

    Why: a full (generation 2) collection walks every tracked object of the
    process, and after `import torch` and a model load that is ~180,000 of
    them: one such pass took 89 ms on the GPU machine, in the middle of a decode
    step of 2.7 ms (a stall every few hundred steps, ~9 % of a 1B throughput
    run). `gc.freeze()` moves every object alive now to a permanent generation
    that collections skip; objects made inside the block are collected as
    usual, and `gc.unfreeze()` at the end (when the last loop in the process
    ends) puts the others back, so nothing that dies later stays uncollected.
    Both calls are O(1). If the caller's process froze objects itself
    (`gc.freeze()` before the block) it already manages this: nothing is
    changed. Nested and concurrent blocks freeze once, unfreeze once. The
    count and the freeze change together: a Ctrl-C between them would leave
    the process frozen for good (`deferred_interrupts`).
    """
    import gc

    global _gc_depth, _gc_ours
    counted = False
    try:
        with deferred_interrupts(), _gc_lock:
            if _gc_depth == 0:
                _gc_ours = gc.get_freeze_count() == 0
                if _gc_ours:
                    gc.freeze()
            _gc_depth += 1
            counted = True
        yield
    finally:
        if counted:
            with deferred_interrupts(), _gc_lock:
                _gc_depth -= 1
                if _gc_depth == 0 and _gc_ours:
                    gc.unfreeze()
                    _gc_ours = False
