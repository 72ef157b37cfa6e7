"""How many CPU threads torch uses: a count that holds up beside a busy neighbour.

Owns: torch's intra-op thread count (`torch.set_num_threads`), and how a CPU
step shares the count between torch and numpy's OpenBLAS (`threads_for_step`;
`model/cpu_blas.py` finds OpenBLAS's setter and pins it to one thread until
then). Does not own: when the policy is applied (`LLMEngine` applies it when it is built; the CLI and
`pagedllm bench` before they load a model, so the load runs under it too).

The problem. torch runs its CPU ops on an OpenMP pool of one thread per core,
and a thread that finishes its share spins, waiting for the others. Beside a
busy process, one of our two threads is often descheduled, and the other
spins through its time slice waiting for it: each parallel op then waits for
the scheduler. Measured on the development machine (2-vCPU AMD EPYC under
KVM, SmolLM2-135M float32, 2026-11-30; `pagedllm bench latency --output-len
128` (decode tok/s; time to first token of its 128-token prompt) and
`pagedllm bench ttft --runs 3` (1024-token prompt), with `--threads` and the
environment below; "busy": one `python3 -c "while True: pass"` beside us;
only runs in which no other process used the CPU; ranges over 1-3 runs):

    policy                      alone                              beside a busy process
                                decode   TTFT 128  TTFT 1024 load  decode  TTFT 128  TTFT 1024 load
    torch default (2 threads)   19-22    0.3 s     2.1-2.2 s 1.2s  6.1*    1.0 s*    6.6-9.4 s 3.0s*
    1 thread                    19-23    0.45 s    4.0-4.1 s 1.5s  18.3    0.55 s    3.8-4.2 s 1.7-2.0s
    2, OMP_WAIT_POLICY=PASSIVE  14-16    0.45-0.6s 2.2-2.5 s 1.5s  20-22   0.5-0.6 s 4.0-4.2 s 1.5-1.9s
    2, GOMP_SPINCOUNT=10000     20.4     0.42 s    2.3 s     1.3s  11.6    1.1 s     4.3 s     2.5s

    * the best run; with a little more load from elsewhere, 1.1-3.6 tok/s,
      time to first token 2-13 s, load 7-19 s.

Batch-1 decode gains nothing from a second thread (its projections run on
numpy's single BLAS thread); prefill does (time to first token of a
1024-token prompt 2.1 s instead of 4.0 s, alone). Beside a busy process the
default collapses (decode 3x slower at best and up to 18x with a little more
load; the model load 2.5-15x). PASSIVE waiting
(sleep, don't spin) keeps prefill's gain and survives contention, but wakes
its sleeping thread for every parallel op, which under KVM costs a quarter of
decode speed when the machine is otherwise idle. A short spin still collapses.

The policy: **one thread fewer than the cores this process may use, at least
one** (`os.sched_getaffinity`): 1 on the 2-core machines we develop and run
CI on, the only count that neither collapses nor slows decode. On larger
machines the same rule leaves one core to a neighbour, so that no thread of
ours shares a core with it (that reasoning is not measured beyond 2 cores;
pass `--threads N` to choose). `OMP_NUM_THREADS`, when the user sets it, wins
(torch has read it). The inter-op pool is left alone: pagedllm never starts it
(a generate runs 3 OS threads whether it is set to 1, 2 or 8).

Decode with more than one thread (issue 38 item 3). A batch-1 decode step's
projections are matrix-vector products through numpy's OpenBLAS (`model/
cpu_blas.py`), pinned to one thread, and its other ops are too small for a
second torch thread to pay (measured: decode 40 ms a step with 2 torch threads,
36 ms with 1). What a second core can do is stream weights: a 113 MB LM head
read at 25.7 GB/s by one OpenBLAS thread, 37.9 GB/s by two (read-only
ceiling 28-39 GB/s: one thread does not reach it). So with N > 1 threads,
`threads_for_step` gives each step one pool or the other, never both (torch's
and OpenBLAS's spinning threads on the same cores made a step 313 ms instead
of 34): a step whose projections all go through numpy (at most
`linear.NUMPY_MATMUL_MAX_ROWS` rows, float32) runs torch on 1 thread and
OpenBLAS on N; any other step (prefill) torch on N and OpenBLAS on 1. The
switch costs two calls when the kind of step changes, nothing otherwise.
Measured (SmolLM2 float32, 2026-12-04, load 1.7-1.9 from other processes,
scripts/profile_cpu_decode.py): 36.2 ms a step with 1 thread, 34.0 with 2.
The default stays 1 thread on 2 cores (above): beside a busy process, two
spinning threads of any pool collapse. `OMP_WAIT_POLICY` is left unset
(PASSIVE's cost is in the table above) and no thread is pinned to a core
(pinned to one core with taskset, a 1-thread step took 37-42 ms against 40-41
unpinned: no clear gain; docs/benchmarks.md, issue 38).

An explicit `threads` always wins, and stays chosen: a later call with
`threads=None` (the engine's own, after the CLI's `--threads N`) keeps it.
Calling it twice is safe. Importing this module does not import torch.
"""

from __future__ import annotations

import os

POLICY_SUMMARY = "one fewer than the usable cores, at least 1"

_chosen: int | None = None  # set by an explicit call; later calls with None keep it
_applied: int | None = None  # the count the last apply_thread_policy set
_step_mode: tuple[int, int] | None = None  # (torch, OpenBLAS) threads set by threads_for_step


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def too_many_threads(threads: int) -> str | None:
    """Why `threads` is more than this machine can run, or None when it is not.

    The bound is the usable cores: a thread more than that only waits for a core
    (see above: spinning threads collapse then), and far more fail outright
    (5,000 hung for minutes, 20,000 failed in libgomp, 100,000 crashed the
    process). Checked before a model loads (`EngineConfig`, the `--threads` flag)."""
    cores = usable_cores()
    if threads <= cores:
        return None
    return (
        f"at most {cores}, the CPU cores this process may use, got {threads}; give 1 to "
        f"{cores}, or leave it unset for the default ({max(1, cores - 1)})"
    )


def default_threads() -> int:
    """The policy's count when nobody chose one (see the module docstring)."""
    if os.environ.get("OMP_NUM_THREADS"):
        import torch

        return torch.get_num_threads()  # the user's choice, already read by torch
    return max(1, usable_cores() - 1)


def apply_thread_policy(threads: int | None = None) -> int:
    """Set torch's CPU threads; return the count now in effect.

    `threads`: an exact count (>= 1), which later calls with None keep; None:
    the count an earlier call chose, else `default_threads()`.
    """
    global _chosen, _applied, _step_mode
    import torch

    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a whole number >= 1, got {threads!r}")
        _chosen = threads
    count = _chosen if _chosen is not None else default_threads()
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    _applied, _step_mode = count, None  # the next threads_for_step sets both pools again
    return count


def threads_for_step(numpy_projections: bool) -> tuple[int, int]:
    """Before a CPU forward pass: give the policy's threads (the last
    `apply_thread_policy`'s count) to torch or to numpy's OpenBLAS (see "Decode
    with more than one thread" above). `numpy_projections`: every projection of
    this step goes through numpy. Returns the (torch, OpenBLAS) threads now set;
    calls nothing when they are unchanged."""
    global _applied, _step_mode
    import torch

    from pagedllm.model import cpu_blas

    if _applied is None:  # no policy applied (a runner built by hand): torch's count
        _applied = torch.get_num_threads()
    threads = _applied
    mode = (1, threads) if numpy_projections and threads > 1 else (threads, 1)
    if mode != _step_mode:
        if torch.get_num_threads() != mode[0]:
            torch.set_num_threads(mode[0])
        cpu_blas.set_blas_threads(mode[1])
        _step_mode = mode
    return mode
