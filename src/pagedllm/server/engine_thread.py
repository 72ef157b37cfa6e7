"""EngineThread: one background thread steps the engine; asyncio handlers talk to it.

Owns: the thread that owns the device (every `LLMEngine.step()` runs there),
the hand-off of each request's outputs to the asyncio task that waits for them,
and aborts asked for by handlers (a client went away). Does not own: HTTP
(app.py), or anything the engine does.

Why a thread and not the event loop: a step holds the engine's lock for
milliseconds on a GPU (a forward pass on the CPU takes longer); on the event
loop that would stall every connection. Handlers never block on the engine
and never take its lock: a new request and an abort are messages in queues
that the stepping thread acts on between steps (a handler that waited for the
lock would starve: the stepping thread takes it again the moment it lets go,
step after step). A step's outputs go back to the event loop in one
`loop.call_soon_threadsafe` per step, not one per token, and a handler that
finds several outputs of its request waiting takes them as one (at
saturation a streamed chunk then carries several tokens, as in vLLM).
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import traceback
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from pagedllm.engine.llm_engine import LLMEngine, StepOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import gc_frozen


class EngineDead(RuntimeError):
    """The stepping thread stopped after an error: the server cannot answer."""


@dataclass
class _NewRequest:
    """A handler's request, waiting for the stepping thread to add it."""

    prompt_token_ids: Sequence[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[StepOutput]
    added: asyncio.Future  # -> the Request, or the exception add_request raised


class EngineThread:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._aborts: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._new: queue.SimpleQueue[_NewRequest] = queue.SimpleQueue()
        # This step's outputs, per event loop: handed over in one call after the step.
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StepOutput]]] = {}
        self._work = threading.Event()  # set when there may be something to step
        self._stop = threading.Event()
        self.error: str | None = None  # why the thread died, if it did
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        if getattr(engine, "workers", None) is not None:
            # A tensor-parallel worker that dies: /health says so at once (503) and
            # new requests are refused, instead of the process exiting.
            engine.workers.on_failure = self.fail

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._work.set()
        self._thread.join(timeout)

    def fail(self, message: str) -> None:
        """The engine cannot go on (called from another thread): stop serving. An
        idle thread stops now; one blocked in a step stops when the step fails."""
        print(f"pagedllm serve: {message}", file=sys.stderr, flush=True)
        self.error = message
        self._stop.set()
        self._work.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -------------------------------------------------------- for handlers
    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[StepOutput]:
        """Add a request and yield its outputs as the engine makes them; the
        last one has `finished` set. Leaving early aborts the request.

        Raises RequestRejected (a ValueError) at once for a request that can
        never run, and EngineDead if the stepping thread stopped."""
        if not self.alive:
            raise EngineDead(self.error or "the engine thread is not running")
        loop = asyncio.get_running_loop()
        new = _NewRequest(prompt_token_ids, params, loop, asyncio.Queue(), loop.create_future())
        self._new.put(new)
        self._work.set()
        try:
            req = await self._added(new)
        except BaseException:
            # Cancelled (the client went away, the server is shutting down) before
            # the stepping thread added it: abort it once it is added.
            new.added.add_done_callback(self._abort_added)
            raise
        finished = False
        try:
            while not finished:
                out = _merge([await new.outputs.get(), *_drain(new.outputs)])
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._aborts.put(req.request_id)
                self._work.set()

    async def _added(self, new: _NewRequest):
        """The Request once the stepping thread has added it (or its refusal)."""
        while not new.added.done():
            # The thread resolves it between steps; if it died meanwhile, nobody will.
            await asyncio.wait({new.added}, timeout=1.0)
            if not new.added.done() and not self._thread.is_alive():
                raise EngineDead(self.error or "the engine thread is not running")
        return new.added.result()

    def _abort_added(self, added: asyncio.Future) -> None:
        if added.cancelled() or added.exception() is not None:
            return  # refused: nothing to abort
        self._aborts.put(added.result().request_id)
        self._work.set()

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        engine = self.engine
        try:
            # The server's objects at start-up (the app, the model, the imports) stay
            # out of full collections while it serves: no 90 ms stall mid-stream.
            with gc_frozen():
                while not self._stop.is_set():
                    self._take_aborts()
                    self._take_new()
                    self._flush()  # an abort's final output
                    if not engine.has_unfinished():
                        self._work.wait(0.05)
                        self._work.clear()
                        continue
                    engine.step()
                    self._flush()
        except BaseException as e:  # noqa: BLE001 - reported through /health
            # A failure reported first (fail(): a dead worker) is the cause; the step
            # that then broke (its collective lost a rank) is only the consequence.
            self.error = self.error or f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            # Every waiting handler gets a final output (finish_reason "abort"),
            # and every request not yet added its refusal.
            self._abort_all()
            self._flush()
            self._refuse_new()

    def _take_new(self) -> None:
        while True:
            try:
                new = self._new.get_nowait()
            except queue.Empty:
                return
            if new.loop.is_closed():
                continue

            def deliver(out: StepOutput, outputs=new.outputs, loop=new.loop) -> None:
                self._outbox.setdefault(loop, []).append((outputs, out))

            try:
                req = self.engine.add_request(new.prompt_token_ids, new.params, on_output=deliver)
            except Exception as e:  # noqa: BLE001 - the handler raises it (RequestRejected: a 400)
                new.loop.call_soon_threadsafe(_resolve, new.added, None, e)
            else:
                new.loop.call_soon_threadsafe(_resolve, new.added, req, None)

    def _flush(self) -> None:
        """Hand this step's outputs to their event loops, one call per loop."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop closed: nobody is waiting
                pass

    def _refuse_new(self) -> None:
        dead = EngineDead(self.error or "the engine thread stopped")
        while True:
            try:
                new = self._new.get_nowait()
            except queue.Empty:
                return
            try:
                new.loop.call_soon_threadsafe(_resolve, new.added, None, dead)
            except RuntimeError:
                pass

    def _take_aborts(self) -> None:
        while True:
            try:
                request_id = self._aborts.get_nowait()
            except queue.Empty:
                return
            self.engine.abort(request_id, report=False)

    def _abort_all(self) -> None:
        for state in list(self.engine.states.values()):
            try:
                self.engine.abort(state.request, report=False)
            except Exception:  # noqa: BLE001 - shutting down: free what can be freed
                pass


def _resolve(future: asyncio.Future, result, exception: BaseException | None) -> None:
    if future.done():  # the handler gave up (its client went away)
        return
    if exception is not None:
        future.set_exception(exception)
    else:
        future.set_result(result)


def _put_all(items: list[tuple[asyncio.Queue, StepOutput]]) -> None:
    for outputs, out in items:
        outputs.put_nowait(out)


def _drain(outputs: asyncio.Queue[StepOutput]) -> list[StepOutput]:
    """The outputs already waiting (a handler that fell behind takes them at once)."""
    taken = []
    while not outputs.empty():
        taken.append(outputs.get_nowait())
    return taken


def _merge(outs: list[StepOutput]) -> StepOutput:
    """Consecutive outputs of one request as one: their tokens and text joined."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    return StepOutput(
        request=last.request,
        new_token_ids=[t for o in outs for t in o.new_token_ids],
        new_text="".join(o.new_text for o in outs),
        finished=last.finished,
        state=last.state,
    )
