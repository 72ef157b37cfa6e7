"""The HTTP process's handle on the engine-core process, and its text work.

Owns: starting the core process and waiting for it to be ready (before the
port is bound), the two ZMQ sockets (requests out, one `Step` message per
engine step in), each request's text (detokenizing, stop strings: a stop
string that matches sends the core an `Abort`), handing each request's new
tokens to the handler that waits for them, and noticing at once that the core
died (its process sentinel on the event loop). Does not own: HTTP
(app.py), or anything inside a step (engine/core_process.py hosts the same
`LLMEngine` the offline `LLM` runs in one process).

A handler that falls behind finds several steps' tokens waiting and takes
them as one output (one SSE chunk), so at saturation the server sends fewer,
larger chunks instead of falling further behind.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagedllm.engine.core_process import (
    Abort,
    AddRequest,
    CoreSetup,
    EosIds,
    Failed,
    FromCore,
    Gauges,
    Ready,
    RequestOutput,
    Shutdown,
    Step,
    params_to_wire,
    run_engine_core,
)
from pagedllm.engine.llm_engine import StepOutput
from pagedllm.engine.request_text import RequestText
from pagedllm.request import FinishReason
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import RequestRejected


class EngineDead(RuntimeError):
    """The engine core stopped: the server cannot answer."""


@dataclass(eq=False)
class ClientRequest:
    """What the HTTP process knows of one request: the fields of an engine
    `Request` that the handlers read, and the text state. Doubles as the
    output's `state` (its `logprobs`)."""

    request_id: int
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    text: RequestText
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # Not yet taken by the handler: tokens, text, whether it ended; and its waiter.
    new_ids: list[int] = field(default_factory=list)
    new_text: list[str] = field(default_factory=list)
    finished: bool = False
    dead: str | None = None  # the core died before this request ended
    waiter: asyncio.Future | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class EngineCoreClient:
    """Start the core, then (on the serving event loop) add, abort and stream.

    client = EngineCoreClient(config, tokenizer)
    ready = client.start()           # blocking: spawn, load, "ready" (or an error)
    ...                              # inside the event loop (the app's lifespan):
    await client.attach()
    async for out in client.generate(prompt_ids, params): ...
    client.shutdown()                # after the loop: the core exits
    """

    def __init__(
        self,
        config: Any,
        tokenizer: Any = None,
        tokenizer_spec: Any = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        # The core loads this tokenizer (a model_source.ModelSpec; None: the model's
        # own) only if a constrained request needs the vocabulary.
        self.tokenizer_spec = tokenizer_spec
        self.ready: Ready | None = None
        self.error: str | None = None  # why the core stopped, once it did
        self.gauges: Gauges | None = None
        self.on_death: Callable[[str], None] | None = None
        self._ids = itertools.count()
        self._requests: dict[int, ClientRequest] = {}
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self._encoder = msgspec.msgpack.Encoder()
        self._dir = tempfile.mkdtemp(prefix="pagedllm-core-")
        self._ctx = zmq.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        # No high-water mark: a burst of a thousand adds within one long step
        # must queue, not fail (messages are small; the core drains each step).
        self._to_core.setsockopt(zmq.SNDHWM, 0)
        self._to_core.bind(f"ipc://{self._dir}/in")
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.RCVHWM, 0)
        self._from_core.bind(f"ipc://{self._dir}/out")
        self._async_from_core: Any = None
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.process: Any = None

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float | None = None) -> Ready:
        """Spawn the core and wait until its model is loaded. Raises ValueError
        with the core's own one-line reason if it could not start."""
        self.start_process()
        return self.wait_ready(timeout_s)

    def start_process(self) -> None:
        """Spawn the core; it loads the model while the caller does other work."""
        setup = CoreSetup(
            config=self.config,
            tokenizer_spec=self.tokenizer_spec,
            input_address=f"ipc://{self._dir}/in",
            output_address=f"ipc://{self._dir}/out",
            parent_pid=os.getpid(),
            started_at=time.time(),
        )
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        # Not a daemon: with tensor parallelism the core starts worker processes.
        self.process = ctx.Process(target=run_engine_core, args=(setup,), name="pagedllm-core")
        self.process.start()
        if self.tokenizer is not None:
            self.set_tokenizer(self.tokenizer)

    def set_tokenizer(self, tokenizer: Any) -> None:
        """This process's tokenizer (None: token ids only). The core loads none of
        its own; it learns the tokenizer's end-of-turn ids from here, before any
        request (the input socket keeps order). Call after `start_process`."""
        self.tokenizer = tokenizer
        if tokenizer is None or not tokenizer.eos_token_ids:
            return
        # The core connects its sockets as soon as it starts; until then a send
        # would find no peer. Wait for it (or for its death, which wait_ready reports).
        while not self._to_core.poll(100, zmq.POLLOUT):
            if not self.process.is_alive():
                return
        self._send(EosIds(list(tokenizer.eos_token_ids)))

    def wait_ready(self, timeout_s: float | None = None) -> Ready:
        """Wait for the core's `Ready` (ValueError with its reason if it failed)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._from_core.poll(100):
                msg = self._decoder.decode(self._from_core.recv())
                if isinstance(msg, Ready):
                    self.ready = msg
                    n = msg.num_blocks
                    self.gauges = Gauges(0, 0, 0, n, n, 0.0, 0, 0, 0, msg.weight_bytes)
                    return msg
                if isinstance(msg, Failed):
                    self._reap()
                    raise ValueError(msg.message)
            elif not self.process.is_alive():
                self._reap()
                raise ValueError(f"the engine core {_exit_text(self.process.exitcode)}")
            if deadline is not None and time.monotonic() > deadline:
                self._reap()
                raise ValueError(f"the engine core was not ready within {timeout_s:g} s")

    async def attach(self) -> None:
        """On the serving loop: read the core's messages and watch its process."""
        loop = self._loop = asyncio.get_running_loop()
        self._async_from_core = zmq.asyncio.Socket.from_socket(self._from_core)
        self._reader = loop.create_task(self._read(), name="pagedllm-core-reader")
        loop.add_reader(self.process.sentinel, self._on_exit)

    async def detach(self) -> None:
        """Leave the loop (its end): stop reading; the core goes on until shutdown()."""
        if self._loop is not None:
            self._loop.remove_reader(self.process.sentinel)
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._reader = None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop (it aborts what is left and frees its pages), then
        make sure it has (SIGKILL after `timeout_s`). Idempotent."""
        if self.process is not None and self.process.is_alive():
            try:
                self._to_core.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(timeout_s)
            if self.process.is_alive():  # stuck (it ignores SIGTERM: core_process.py)
                self.process.kill()
                self.process.join()
        self._close()

    def _reap(self) -> None:
        if self.process is not None:
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self._close()

    def _close(self) -> None:
        if self._ctx.closed:
            return
        for sock in (self._to_core, self._from_core):
            sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self.error is None and self.process is not None and self.process.is_alive()

    @property
    def max_model_len(self) -> int:
        assert self.ready is not None
        return self.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        assert self.ready is not None
        return self.ready.vocab_size

    @property
    def pool_tokens(self) -> int:
        """The most tokens one request can ever hold in the KV cache: the whole pool."""
        assert self.ready is not None
        return self.ready.num_blocks * self.ready.block_size

    # -------------------------------------------------------- for handlers
    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[StepOutput]:
        """Add a request and yield its outputs as the core makes them (several
        steps' worth as one when the reader fell behind); the last has
        `finished` set. Leaving early aborts it in the core.

        Raises RequestRejected at the first output for a request that can never
        run, and EngineDead when the core is gone."""
        if not self.alive:
            raise EngineDead(self.error or "the engine core is not running")
        rid = next(self._ids)
        req = ClientRequest(
            rid,
            prompt_token_ids,
            params,
            RequestText(self.tokenizer, params, prompt_token_ids),
            logprobs=[] if params.logprobs is not None else None,
        )
        wire = params_to_wire(params)
        wire["stop"] = None  # stop strings are matched here, on the text
        self._requests[rid] = req
        self._send(AddRequest(rid, list(prompt_token_ids), wire))
        loop = asyncio.get_running_loop()
        done = False
        try:
            while not done:
                if not req.new_ids and not req.finished and req.dead is None:
                    req.waiter = loop.create_future()
                    await req.waiter
                    req.waiter = None
                if req.finish_reason is FinishReason.REJECTED:
                    done = True
                    raise RequestRejected(req.error or "the request was rejected")
                if req.dead is not None and not req.finished:
                    done = True
                    raise EngineDead(req.dead)
                ids, req.new_ids = req.new_ids, []
                text = "".join(req.new_text)
                req.new_text.clear()
                done = req.finished
                yield StepOutput(req, ids, text, done, req)  # type: ignore[arg-type]
        finally:
            self._requests.pop(rid, None)
            if not done and self.alive:
                self._send(Abort([rid]))

    def _send(self, msg: Any) -> None:
        try:
            self._to_core.send(self._encoder.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the core stopped reading: it is dying
            raise EngineDead(f"the engine core does not take requests: {e}") from None

    # ------------------------------------------------------------ reading
    async def _read(self) -> None:
        try:
            await self._read_messages()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug here would leave every handler waiting
            self._died(f"the server could not read the engine core's messages: {e!r}")

    async def _read_messages(self) -> None:
        sock = self._async_from_core
        while True:
            frames = [await sock.recv()]
            while True:  # whatever else is waiting: processed before any handler runs
                try:
                    frames.append(self._from_core.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
            for frame in frames:
                msg = self._decoder.decode(frame)
                if isinstance(msg, Step):
                    self._on_step(msg)
                elif isinstance(msg, Failed):
                    self._died(msg.message)
                    return

    def _on_step(self, step: Step) -> None:
        self.gauges = step.gauges
        stopped: list[int] = []
        for out in step.outputs:
            req = self._requests.get(out.id)
            if req is None or req.finished:
                continue  # its handler left (aborted), or a stop string ended it here
            if self._apply(req, out):
                stopped.append(out.id)
            req.wake()
        if stopped:
            self._send(Abort(stopped))

    def _apply(self, req: ClientRequest, out: RequestOutput) -> bool:
        """One step's output into the request's state; True when a stop string
        ended it here (the core must be told)."""
        req.output_token_ids += out.new_token_ids
        req.new_ids += out.new_token_ids
        if req.logprobs is not None and out.logprobs is not None:
            req.logprobs += out.logprobs
        finished = out.finish_reason is not None
        if out.finish_reason == FinishReason.REJECTED.value:
            req.finish_reason, req.error, req.finished = FinishReason.REJECTED, out.error, True
            return False
        text, matched = req.text.feed(
            out.new_token_ids, len(req.output_token_ids), finished, out.stop_reason
        )
        req.new_text.append(text)
        if matched is not None:
            req.finish_reason, req.stop_reason = FinishReason.STOP, matched
            req.finished = True
            return not finished
        if finished:
            req.finish_reason = FinishReason(out.finish_reason)
            req.stop_reason, req.error, req.finished = out.stop_reason, out.error, True
        return False

    # ------------------------------------------------------------ death
    def _on_exit(self) -> None:
        """The core's process ended (its sentinel is readable)."""
        if self._loop is not None:
            self._loop.remove_reader(self.process.sentinel)
        self.process.join(1)
        self._died(self.error or f"the engine core {_exit_text(self.process.exitcode)}")

    def _died(self, why: str) -> None:
        first = self.error is None
        self.error = self.error or why
        for req in self._requests.values():
            if not req.finished:
                req.dead = self.error
                req.wake()
        if first and self.on_death is not None:
            self.on_death(self.error)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
