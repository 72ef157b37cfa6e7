"""The engine core in a process of its own: what `pagedllm serve` steps.

    HTTP process (server/)                         engine-core process (this file)
    ---------------------                          -------------------------------
    parse, template, tokenize                      LLMEngine: scheduler, KV pool,
    AddRequest / Abort      ---- ZMQ PUSH ---->    runner, sampling
                                                   loop: drain inputs, step, send
    detokenize, stop strings <--- ZMQ PULL ----    one Step message per engine step
    SSE, metrics                                   (every request's new token ids)

Why a process: the HTTP side's Python (parsing, detokenizing, formatting an SSE
event per token) and the loop that steps the engine share one GIL when they
share a process; at saturation the stepping thread then waits for the GIL
between steps, and the GPU idles. In its own process the loop steps whenever
there is work and never waits on HTTP.

Owns: the wire format (msgspec structs, MessagePack), the core's busy loop
(`EngineCoreLoop`), its start-up (`Ready`, or `Failed` with one line) and its
end (a `Shutdown` message, or the HTTP process gone: the core never outlives
it). Does not own: text (the HTTP process detokenizes and matches stop strings
itself, and sends an `Abort` when one matches) or anything a step does: the
same `LLMEngine` class runs the offline `LLM` in one process.

Messages are batched: the core sends one `Step` per engine step carrying every
request's new token ids, finish reason and log-probs, never one message per
token. Rejections (a prompt too long for the pool) ride in the next `Step` as
outputs with finish reason "rejected".
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec

# ------------------------------------------------------------------ messages
# HTTP process -> core


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    id: int  # the client's id (the engine numbers requests itself)
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams' fields, stop strings removed


class Abort(msgspec.Struct, tag="abort", array_like=True):
    ids: list[int]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class EosIds(msgspec.Struct, tag="eos", array_like=True):
    """The tokenizer's end-of-turn ids. The core loads no tokenizer (the HTTP
    process has one, and loading Llama 3's took 0.5-0.8 s of the core's start-up);
    the HTTP process sends these before any request."""

    ids: list[int]


# core -> HTTP process


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The model is loaded and the pool sized: the HTTP process may bind its port."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    model_path: str | None
    load_time_s: float
    worker_pids: list[int]  # tensor-parallel ranks 1..N-1 (processes of the core's own)
    weight_bytes: int = 0  # the model's weights on the device (rank 0's under TP)


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """The core cannot go on (or could not start): one line that says why."""

    message: str


class RequestOutput(msgspec.Struct, array_like=True):
    """One request's part of one step."""

    id: int
    new_token_ids: list[int]
    finish_reason: str | None = None  # a FinishReason's value once finished
    stop_reason: int | str | None = None  # the EOS / stop token id that ended it
    logprobs: list[dict[int, float]] | None = None  # one entry per new token
    error: str | None = None  # why it was rejected or failed


class Gauges(msgspec.Struct, array_like=True):
    """The engine's counters after a step (what /metrics shows)."""

    running: int
    waiting: int
    pages_used: int
    pages_free: int
    pages_total: int
    prefix_cache_hit_rate: float
    preemptions: int
    admission_waits: int
    steps: int  # engine steps so far
    weight_bytes: int = 0  # the model's weights on the device (rank 0's under TP)


class Step(msgspec.Struct, tag="step", array_like=True):
    outputs: list[RequestOutput]
    gauges: Gauges


ToCore = AddRequest | Abort | Shutdown | EosIds
FromCore = Ready | Failed | Step


def params_to_wire(params: Any) -> dict[str, Any]:
    """A SamplingParams as plain values (its own checks run again in the core)."""
    wire = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    if wire.get("structured") is not None:  # plain values (a StructuredOutput is no msgpack type)
        wire["structured"] = wire["structured"].as_kwargs()
    return wire


# ------------------------------------------------------------------ set-up


@dataclass(frozen=True)
class CoreSetup:
    """What the core process needs to build its engine (pickled once, at spawn)."""

    config: Any  # EngineConfig (model path, load format, every engine flag)
    # model_source.ModelSpec of the HTTP process's tokenizer: the core loads it only
    # when a constrained request first needs the vocabulary (structured/).
    tokenizer_spec: Any = None
    input_address: str = ""  # the HTTP process binds both; the core connects
    output_address: str = ""
    parent_pid: int = 0
    started_at: float = 0.0  # time.time() when the HTTP process spawned us (start-up log)


def run_engine_core(setup: CoreSetup) -> None:
    """The core process's entry point (multiprocessing, spawn). Exits 0 after a
    Shutdown, 1 after a failure (reported first as `Failed`)."""
    import zmq

    # Ctrl-C in a terminal, and a SIGTERM sent to the process group (`timeout`,
    # a service manager), reach this process too: the HTTP process decides how
    # to stop (gracefully), then sends Shutdown. If it dies instead, so does
    # this process (_die_with_parent).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)  # no limit: see EngineCoreClient
    inputs.connect(setup.input_address)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)  # a slow reader never blocks a step
    outputs.setsockopt(zmq.LINGER, 5000)
    outputs.connect(setup.output_address)
    encoder = msgspec.msgpack.Encoder()
    code = 1
    loop = None
    try:
        engine = _build_engine(setup)
        kv = engine.kv_spec
        path = getattr(engine.model, "source_path", None)
        ready = Ready(
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            num_blocks=kv.num_blocks,
            block_size=kv.block_size,
            model_path=None if path is None else str(path),
            load_time_s=round(engine.load_time_s, 3),
            worker_pids=[] if engine.workers is None else [p.pid for p in engine.workers.procs],
            weight_bytes=engine.weight_bytes,
        )
        outputs.send(encoder.encode(ready))
        loop = EngineCoreLoop(engine, inputs, outputs, setup.parent_pid)
        try:
            loop.run()
        finally:
            engine.close()
        code = 0
    except BaseException as e:  # noqa: BLE001 - reported to the HTTP process in one line
        # A failure reported first (a dead tensor-parallel worker) is the cause; the
        # step that then broke (its collective lost a rank) only its consequence.
        why = (loop.failure if loop is not None else None) or _one_line(e)
        with contextlib.suppress(Exception):
            outputs.send(encoder.encode(Failed(why)))
        if not isinstance(e, (ValueError, FileNotFoundError, OSError, _ParentGone)):
            import traceback

            traceback.print_exc()
    finally:
        inputs.close(linger=0)
        outputs.close()
        ctx.term()
    sys.exit(code)


def _build_engine(setup: CoreSetup):
    t0 = time.time()
    import torch  # noqa: F401 - timed on its own: a second or more of every start

    from pagedllm.engine.llm_engine import LLMEngine

    def log(message: str) -> None:
        print(f"[core] {message}", file=sys.stderr, flush=True)

    t1 = time.time()
    engine = LLMEngine(setup.config, None, None, log=log, load_tokenizer=False)
    engine.tokenizer_loader = lambda: _load_tokenizer(setup.tokenizer_spec, engine)
    since = setup.started_at or t0
    log(
        f"ready {time.time() - since:.1f} s after its spawn: started in {t0 - since:.1f} s, "
        f"imports {t1 - t0:.1f} s, engine (model, KV pool, warm-up) {time.time() - t1:.1f} s"
    )
    return engine


def _load_tokenizer(spec: Any, engine: Any) -> Any:
    """The tokenizer the HTTP process uses (its spec's, else the model's own), for
    the vocabulary of constrained decoding; on a worker thread, once."""
    from pagedllm.engine.llm_engine import load_model_tokenizer
    from pagedllm.model_source import load_tokenizer

    tokenizer = load_tokenizer(spec, log=lambda m: None) if spec is not None else None
    path = getattr(engine.model, "source_path", None)
    if tokenizer is None and path is not None:
        tokenizer = load_model_tokenizer(path, lambda m: None)
    return tokenizer


class _ParentGone(Exception):
    """The HTTP process is gone: nobody will read what the core makes."""


class EngineCoreLoop:
    """Drain the inputs, step, send one message per step; idle, block on the inputs.

    The loop steps whenever any request is unfinished and only then looks at the
    sockets without waiting, so a saturated engine never waits on HTTP. Text is
    not this process's work: requests are added with `detokenize=False`.
    """

    PARENT_CHECK_S = 1.0

    def __init__(self, engine: Any, inputs: Any, outputs: Any, parent_pid: int) -> None:
        import zmq

        self.engine = engine
        self.inputs, self.outputs = inputs, outputs
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(inputs, zmq.POLLIN)
        self.decoder = msgspec.msgpack.Decoder(ToCore)
        self.encoder = msgspec.msgpack.Encoder()
        self.requests: dict[int, Any] = {}  # client id -> engine Request
        self.client_ids: dict[int, int] = {}  # engine request id -> client id
        self.pending: list[RequestOutput] = []  # rejections, sent with the next message
        self.stopping = False
        self.failure: str | None = None  # set by another thread: a worker died
        self._last_parent_check = time.monotonic()
        if getattr(engine, "workers", None) is not None:
            engine.workers.on_failure = self._worker_failed

    def _worker_failed(self, message: str) -> None:
        """A tensor-parallel worker died (its monitor thread calls this): the core
        stops. An idle loop stops within a second; one blocked in a step stops
        when the step fails."""
        print(f"[core] {message}", file=sys.stderr, flush=True)
        self.failure = message

    def run(self) -> None:
        from pagedllm.utils import gc_frozen

        engine = self.engine
        with gc_frozen():  # the process's objects stay out of full GC passes
            while not self.stopping:
                busy = engine.has_unfinished()
                self._take_inputs(wait=not busy)
                if engine.has_unfinished():
                    self._send(engine.step())
                elif self.pending:
                    self._send([])
                self._check_parent(busy)
                if self.failure is not None:
                    raise RuntimeError(self.failure)
        for req in list(self.requests.values()):  # Shutdown with requests left
            engine.abort(req, report=False)

    # ------------------------------------------------------------ inputs
    def _take_inputs(self, wait: bool) -> None:
        """Every message waiting; when idle, block until one comes (a second at
        a time, to notice a parent that died without a word)."""
        import zmq

        if wait:
            while not self.poller.poll(int(self.PARENT_CHECK_S * 1000)):
                self._check_parent(busy=False)
                if self.failure is not None:
                    raise RuntimeError(self.failure)
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self.decoder.decode(frame.buffer))

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, Abort):
            for cid in msg.ids:
                req = self.requests.get(cid)
                if req is not None:
                    self.engine.abort(req)  # its final output comes with the next step
        elif isinstance(msg, Shutdown):
            self.stopping = True
        elif isinstance(msg, EosIds):
            self.engine.add_eos_token_ids(msg.ids)

    def _add(self, msg: AddRequest) -> None:
        from pagedllm.sampling_params import SamplingParams
        from pagedllm.scheduler import RequestRejected

        try:
            params = SamplingParams(**msg.params)
            req = self.engine.add_request(msg.prompt_token_ids, params, detokenize=False)
        except (RequestRejected, ValueError, TypeError) as e:
            self.pending.append(RequestOutput(msg.id, [], "rejected", error=str(e)))
            return
        self.requests[msg.id] = req
        self.client_ids[req.request_id] = msg.id

    # ------------------------------------------------------------ outputs
    def _send(self, outs: list[Any]) -> None:
        items, self.pending = self.pending, []
        for out in outs:
            req = out.request
            cid = self.client_ids.get(req.request_id)
            if cid is None:
                continue
            item = RequestOutput(cid, out.new_token_ids)
            state = out.state
            if state is not None and state.logprobs is not None and out.new_token_ids:
                item.logprobs = state.logprobs[-len(out.new_token_ids) :]
            if out.finished:
                item.finish_reason = str(req.finish_reason)
                item.stop_reason = req.stop_reason
                item.error = req.error
                del self.requests[cid], self.client_ids[req.request_id]
            items.append(item)
        self.outputs.send(self.encoder.encode(Step(items, self._gauges())), copy=False)

    def _gauges(self) -> Gauges:
        s = self.engine.scheduler
        bm = self.engine.block_manager
        queried = s.num_cache_query_tokens
        return Gauges(
            running=s.num_running,
            waiting=s.num_waiting,
            pages_used=bm.num_used_blocks,
            pages_free=bm.num_free_blocks,
            pages_total=bm.num_blocks,
            prefix_cache_hit_rate=round(s.num_cache_hit_tokens / queried, 4) if queried else 0.0,
            preemptions=s.num_preemptions,
            admission_waits=s.num_admission_waits,
            steps=self.engine.num_steps,
            weight_bytes=self.engine.weight_bytes,
        )

    def _check_parent(self, busy: bool) -> None:
        now = time.monotonic()
        if busy and now - self._last_parent_check < self.PARENT_CHECK_S:
            return
        self._last_parent_check = now
        if os.getppid() != self.parent_pid:
            raise _ParentGone("the HTTP process is gone; the engine core stops")


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (prctl
    PR_SET_PDEATHSIG), even mid-step; elsewhere the loop's parent check does."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, (ValueError, FileNotFoundError, OSError, _ParentGone)):
        return text
    return f"{type(e).__name__}: {text}"
