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

import atexit
import os
import signal
import socket
import sys
import threading
import traceback
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


@dataclass(frozen=True)
class WorkerSetup:
    """What every rank loads (plain values: it crosses a process boundary)."""

    model: str  # an HF directory or a .gguf file
    device_type: str  # "cuda" (rank r on cuda:r) or "cpu"
    dtype: str | None
    max_positions: int
    threads: int | None
    load_format: str = "auto"  # or "dummy": random weights, this rank's slice


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_failure(message: str) -> None:
    print(f"pagedllm: {message}", file=sys.stderr, flush=True)
    os._exit(1)


class TPWorkers:
    """Rank 0's handle on the workers: start, send each step, stop."""

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
                "and this process already has one: run one tensor-parallel engine per process"
            )
        if setup.device_type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(
                f"tensor_parallel_size {size} needs {size} GPUs; this machine has "
                f"{torch.cuda.device_count()}"
            )
        os.environ.update(TP_ENV)
        self.size = size
        self.on_failure = on_failure or _default_failure
        self.closing = False
        self.broken: str | None = None  # why the ranks are out of step, once they are
        port = _free_port()
        ctx = mp.get_context("spawn")
        self._steps, self._errors, self.procs = [], [], []
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
            self._steps.append(step_send)
            self._errors.append(err_recv)
            self.procs.append(proc)
        self._watchdog = threading.Thread(
            target=self._watch, name="pagedllm-tp-watchdog", daemon=True
        )
        self._watchdog.start()
        if setup.device_type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl" if setup.device_type == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        self.tp = TensorParallel(0, size)
        atexit.register(self.close)

    # ------------------------------------------------------------ rank 0's side
    def send(self, message: tuple[str, Any]) -> None:
        """Hand every worker the same message: ("runner", kwargs), ("step", HostBatch)
        or ("stop", None)."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        for conn in self._steps:
            conn.send(message)

    def mark_broken(self, error: BaseException) -> None:
        """Rank 0 failed inside a step the workers had started: they wait in a
        collective that rank 0 left, so no later step can line up with theirs."""
        self.broken = (
            f"a tensor-parallel step failed on rank 0 ({type(error).__name__}: {error}) after "
            "the workers had started it; the ranks are out of step: restart the engine"
        )

    def close(self) -> None:
        """Stop the workers (they leave their loop and the process group), then ours."""
        if self.closing:
            return
        self.closing = True
        import torch.distributed as dist

        for conn in self._steps:
            try:
                conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass  # that worker is gone already
        for proc in self.procs:
            proc.join(STOP_WAIT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _watch(self) -> None:
        """Wait for any worker to exit; one that exits while we run is a failure."""
        pending = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        while pending:
            for sentinel in wait(list(pending)):
                rank, proc = pending.pop(sentinel)
                if self.closing:
                    continue
                proc.join()
                error = "no error message (killed?)"
                conn = self._errors[rank - 1]
                try:
                    if conn.poll(1.0):
                        error = conn.recv()
                except (EOFError, OSError):
                    pass  # it died before it could say why
                self.on_failure(
                    f"tensor-parallel worker rank {rank} exited with code {proc.exitcode}: {error}"
                )
                return


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
    from pagedllm.runner.model_runner import ModelRunner

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
    )
    kind, kwargs = steps.recv()
    if kind != "runner":
        raise RuntimeError(f"expected the runner's settings first, got {kind!r}")
    runner = ModelRunner(model, **kwargs)
    while True:
        kind, host = steps.recv()
        if kind == "stop":
            break
        with torch.inference_mode():
            batch = runner.forward_batch(host)
            model.compute_logits(model.forward(batch, runner.kv_caches))
    dist.destroy_process_group()
