"""EngineThread: one background thread steps the engine; asyncio handlers talk to it.

Owns: the thread that owns the device (every `LLMEngine.step()` runs there),
the hand-off of each request's outputs to the asyncio task that waits for them,
and aborts asked for by handlers (a client went away). Does not own: HTTP
(app.py), or anything the engine does.

Why a thread and not the event loop: a step holds the engine's lock for
milliseconds on a GPU (a forward pass on the CPU takes longer); on the event
loop that would stall every connection. Handlers never block on the
engine: adding a request runs in a worker thread (`asyncio.to_thread`), outputs
come back through `loop.call_soon_threadsafe`, and an abort is a message the
stepping thread acts on between steps.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Sequence

from pagedllm.engine.llm_engine import LLMEngine, StepOutput
from pagedllm.sampling_params import SamplingParams


class EngineDead(RuntimeError):
    """The stepping thread stopped after an error: the server cannot answer."""


class EngineThread:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._aborts: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._work = threading.Event()  # set when there may be something to step
        self._stop = threading.Event()
        self.error: str | None = None  # why the thread died, if it did
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._work.set()
        self._thread.join(timeout)

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
        outputs: asyncio.Queue[StepOutput] = asyncio.Queue()

        def deliver(out: StepOutput) -> None:  # on the stepping thread
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        req = await asyncio.to_thread(
            self.engine.add_request, prompt_token_ids, params, on_output=deliver
        )
        self._work.set()
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._aborts.put(req.request_id)
                self._work.set()

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._take_aborts()
                if not engine.has_unfinished():
                    self._work.wait(0.05)
                    self._work.clear()
                    continue
                engine.step()
        except BaseException as e:  # noqa: BLE001 - reported through /health
            self.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            # Every waiting handler gets a final output (finish_reason "abort").
            self._abort_all()

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
