"""Tensor-parallel worker processes: ranks 1..N-1 of an engine whose rank 0 is
the engine's own process.

Rank 0 runs the scheduler, the tokenizer, the sampler and its own shard of the
model. Each step, just before its forward pass, it sends the step's batch (the
`HostBatch`: numpy arrays and ints, never a tensor) down one pipe per worker.
Every worker builds the same `ForwardBatch` from it and runs the same forward
pass on its shard, meeting rank 0 in the collectives (two all-reduces per
layer, the embedding's, the logits' all-gather: `model/parallel.py`). Workers
never sample and keep no scheduler state: the block tables come with each
batch, and the KV pages they write are the same page numbers on every rank.

Process group: `torch.distributed` over NCCL on CUDA (rank r on cuda:r) and
gloo on the CPU (CI tests two CPU ranks). Rank 0 starts the workers with the
spawn method; NVLink multicast stays off in every process (TP_ENV).

Failure: a worker that raises sends its traceback up a second pipe and exits.
Rank 0's watchdog thread waits on the workers' exit; when one exits while the
engine runs, it calls `on_failure(message)` with the rank, the exit code and
the error. The default prints it and ends the process (exit code 1): rank 0
may be blocked inside a collective that will never complete, which no
exception can reach, so exiting is the only way not to hang. A worker whose
rank 0 dies sees its pipe close and exits. Ctrl-C reaches every process of
the terminal; workers ignore it, and rank 0 finishes a step's collectives
before raising it (`deferred_interrupts`), so the ranks never fall out of step.

Owns: starting, feeding and stopping the workers, and each worker's loop.
Does not own: the sharding (`model/parallel.py`), the step (`ModelRunner`).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch

from pagedllm.model.parallel import TensorParallel

# NVLink multicast (NVLS) off in every process the engine starts, workers included.
TP_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# A collective that waits longer than this has lost a rank: NCCL/gloo raise.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
STOP_WAIT_S = 10.0  # how long close() waits for a worker to leave before killing it
WORKER_EXIT_WAIT_S = 1.0  # after a failed step: how long a failing worker may take to exit


@dataclass(frozen=True)
class WorkerSetup:
    """What every rank loads (plain values: it crosses a process boundary)."""

    model: str  # an HF directory or a .gguf file
    device_type: str  # "cuda" (rank r on cuda:r) or "cpu"
    dtype: str | None
    max_positions: int
    threads: int | None
    load_format: str = "auto"  # or "dummy": random weights, this rank's slice
    quantization: str = "none"  # or "fp8": EngineConfig.quantization


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_failure(message: str) -> None:
    print(f"pagedllm: {message}", file=sys.stderr, flush=True)
    os._exit(1)


class _Workers:
    """What the watchdog thread and the shutdown share: the processes, both ends of
    their pipes, and whether a stop is under way (then an exit is no failure)."""

    def __init__(self, on_failure: Callable[[str], None]) -> None:
        self.procs: list = []
        self.steps: list = []  # our sending ends
        self.errors: list = []  # our receiving ends
        self.closing = False
        self.on_failure = on_failure
        self.watchdog: threading.Thread | None = None
        self.reported = False  # a worker's death was reported (once, by whoever saw it)
        self.lock = threading.Lock()


def _report(shared: _Workers, rank: int, proc) -> None:
    """Tell `on_failure` that worker `rank` died, with its error (once)."""
    with shared.lock:
        if shared.closing or shared.reported:
            return
        shared.reported = True
    proc.join()
    error = None
    try:
        if shared.errors[rank - 1].poll(1.0):
            error = shared.errors[rank - 1].recv()
    except (EOFError, OSError):
        pass  # it died before it could say why
    main_path = getattr(sys.modules.get("__main__"), "__file__", None)
    shared.on_failure(worker_exit_message(rank, proc.exitcode, error, main_path))


def worker_exit_message(
    rank: int, exitcode: int | None, error: str | None, main_path: str | None
) -> str:
    """What `on_failure` is told of worker `rank`'s exit: the traceback it sent, or
    else the likely cause, named as PyTorch and vLLM name it for spawned workers.

    A worker that raises always sends its traceback first (`worker_main`), so exit
    code 1 without one means it died before `worker_main` ran: while the spawn
    method ran the main module (`main_path`) again in the new process. A script
    without an `if __name__ == "__main__":` guard does that (multiprocessing's
    RuntimeError, printed by the worker, says so in its own words)."""
    head = f"tensor-parallel worker rank {rank} exited with code {exitcode}"
    if error:
        return f"{head}: {error}"
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        oom = (
            " (sent by the out-of-memory killer, or kill -9)" if -exitcode == signal.SIGKILL else ""
        )
        return f"{head}: killed by {name}{oom}"
    if exitcode == 1 and main_path:
        return (
            f"{head} before it started, with no error message: most likely {main_path} "
            'builds the LLM without an `if __name__ == "__main__":` guard. Workers are started '
            "with the spawn method, which runs the main module again in each of them; build "
            "and use the LLM under that guard"
        )
    return f"{head} before it could send an error message (killed?)"


def _watch(shared: _Workers) -> None:
    """Wait for any worker to exit; one that exits while we run is a failure."""
    pending = {p.sentinel: (rank, p) for rank, p in enumerate(shared.procs, start=1)}
    while pending:
        try:
            ready = wait(list(pending))
        except (OSError, ValueError):  # the processes were closed under us: a shutdown
            return
        for sentinel in ready:
            rank, proc = pending.pop(sentinel)
            if not shared.closing:
                _report(shared, rank, proc)
                return


def _shutdown(shared: _Workers, wait_s: float) -> None:
    """Stop the workers (asked, then killed after `wait_s` in all), close every pipe,
    and leave the process group. Idempotent; runs at close(), at garbage
    collection of the TPWorkers, or at exit."""
    import time

    import torch.distributed as dist

    shared.closing = True  # (weakref.finalize calls this once)
    for conn in shared.steps:
        try:
            conn.send(("stop", None))
        except (BrokenPipeError, OSError):
            pass  # that worker is gone already
    deadline = time.monotonic() + wait_s
    for proc in shared.procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
    if shared.watchdog is not None and shared.watchdog is not threading.current_thread():
        shared.watchdog.join(1.0)  # it sees every exit as asked for, then ends
    for conn in shared.steps + shared.errors:
        conn.close()
    for proc in shared.procs:
        proc.close()
    if dist.is_initialized():
        dist.destroy_process_group()


class TPWorkers:
    """Rank 0's handle on the workers: start, send each step, stop.

    The `ModelRunner` takes it as a `model_runner.RankWorkers` (by its shape: the
    runner imports nothing from here, since the workers import the runner)."""

    def __init__(
        self,
        size: int,
        setup: WorkerSetup,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        import multiprocessing as mp

        import torch.distributed as dist

        if dist.is_initialized():
            raise ValueError(
                "tensor_parallel_size > 1 needs a torch.distributed process group of its own, "
                "and this process already has one (another tensor-parallel engine not yet "
                "closed?): close it first (LLM.close())"
            )
        if setup.device_type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(
                f"tensor_parallel_size {size} needs {size} GPUs; this machine has "
                f"{torch.cuda.device_count()}"
            )
        os.environ.update(TP_ENV)
        self.size = size
        self.broken: str | None = None  # why the ranks are out of step, once they are
        self._shared = shared = _Workers(on_failure or _default_failure)
        # Stops the workers when this object is closed, collected, or at exit; it
        # holds only `shared`, so an engine dropped without close() is collected.
        self._finalizer = weakref.finalize(self, _shutdown, shared, STOP_WAIT_S)
        port = _free_port()
        ctx = mp.get_context("spawn")
        try:
            for rank in range(1, size):
                step_recv, step_send = ctx.Pipe(duplex=False)
                err_recv, err_send = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=worker_main,
                    args=(rank, size, port, setup, step_recv, err_send),
                    name=f"pagedllm-tp{rank}",
                    daemon=True,
                )
                proc.start()
                step_recv.close()  # the worker's ends, not ours
                err_send.close()
                shared.steps.append(step_send)
                shared.errors.append(err_recv)
                shared.procs.append(proc)
            shared.watchdog = threading.Thread(
                target=_watch, args=(shared,), name="pagedllm-tp-watchdog", daemon=True
            )
            shared.watchdog.start()
            if setup.device_type == "cuda":
                torch.cuda.set_device(0)
            dist.init_process_group(
                "nccl" if setup.device_type == "cuda" else "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=size,
                timeout=COLLECTIVE_TIMEOUT,
            )
        except BaseException:  # Ctrl-C while the workers start, say: none is left behind
            self._stop_now()
            raise
        self.tp = TensorParallel(0, size)

    @property
    def procs(self) -> list:
        return self._shared.procs

    @property
    def on_failure(self) -> Callable[[str], None]:
        return self._shared.on_failure

    @on_failure.setter
    def on_failure(self, callback: Callable[[str], None]) -> None:
        self._shared.on_failure = callback

    # ------------------------------------------------------------ rank 0's side
    def send(self, message: tuple[str, Any]) -> None:
        """Hand every worker the same message: ("free_memory", None) (then every rank
        joins `TensorParallel.min_over_ranks` of its free device memory), ("runner",
        kwargs), ("step", HostBatch),
        ("step_fed", HostBatch) (its input ids follow by a broadcast from rank 0:
        `ModelRunner._forward`) or ("stop", None)."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        if self._shared.closing:
            raise RuntimeError("this tensor-parallel engine was closed; build a new one")
        for conn in self._shared.steps:
            conn.send(message)

    def step_failed(self, error: BaseException) -> None:
        """Rank 0's forward pass raised after the workers had started the step. If a
        worker died (its collective then fails on rank 0 too), that death is the
        failure to report (`on_failure`); otherwise rank 0 alone failed: `mark_broken`."""
        import time

        deadline = time.monotonic() + WORKER_EXIT_WAIT_S  # a worker that raised takes a moment
        for rank, proc in enumerate(self._shared.procs, start=1):
            proc.join(max(0.0, deadline - time.monotonic()))
            if not proc.is_alive():
                _report(self._shared, rank, proc)
                break
        self.mark_broken(error)

    def mark_broken(self, error: BaseException) -> None:
        """Rank 0 failed inside a step the workers had started: they wait in a
        collective that rank 0 left, so no later step can line up with theirs. They
        are stopped now (their exit is no failure), and every later step raises."""
        self.broken = (
            f"a tensor-parallel step failed on rank 0 ({type(error).__name__}: {error}) after "
            "the workers had started it; the ranks are out of step: build a new engine"
        )
        self._stop_now()

    def close(self) -> None:
        """Stop the workers (they leave their loop and the process group), then ours."""
        self._finalizer()

    def _stop_now(self) -> None:
        """Kill the workers without asking: they may be inside a collective."""
        self._shared.closing = True
        for proc in self._shared.procs:
            if proc.is_alive():
                proc.kill()
        self._finalizer()


# ---------------------------------------------------------------- worker side
def worker_main(rank, size, port, setup: WorkerSetup, steps, errors) -> None:
    """One worker: join the group, load this rank's shard, then run every step it is sent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    os.environ.update(TP_ENV)
    try:
        _worker_loop(rank, size, port, setup, steps)
    except EOFError:
        os._exit(0)  # rank 0 is gone: nothing left to serve
    except BaseException:
        try:
            errors.send(traceback.format_exc(limit=8).rstrip())
        finally:
            os._exit(1)
    os._exit(0)


def _worker_loop(rank, size, port, setup: WorkerSetup, steps) -> None:
    import torch.distributed as dist

    from pagedllm.cpu_threads import apply_thread_policy
    from pagedllm.model import load_model
    from pagedllm.runner.model_runner import ModelRunner, free_device_bytes
    from pagedllm.utils import gc_frozen

    apply_thread_policy(setup.threads)
    device = rank_device(setup.device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    tp = TensorParallel(rank, size)
    model = load_model(
        setup.model,
        device,
        setup.dtype,
        max_model_len=setup.max_positions,
        tp=tp,
        load_format=setup.load_format,
        quantization=setup.quantization,
    )
    kind, kwargs = steps.recv()
    if kind == "free_memory":  # rank 0 sizes every rank's pool by the least free memory
        tp.min_over_ranks(free_device_bytes(device), device)
        kind, kwargs = steps.recv()
    if kind != "runner":
        raise RuntimeError(f"expected the runner's settings first, got {kind!r}")
    runner = ModelRunner(model, **kwargs)
    with gc_frozen():  # a full collection here would stall every rank's collectives
        while True:
            kind, host = steps.recv()
            if kind == "stop":
                break
            with torch.inference_mode():
                batch = runner.forward_batch(host)
                if kind == "step_fed":  # async scheduling: ids rank 0 sampled, on its device
                    batch.input_ids = tp.broadcast(torch.empty_like(batch.input_ids))
                model.compute_logits(model.forward(batch, runner.kv_caches))
    dist.destroy_process_group()
