"""The client of `pagedllm bench serve`, alone: how many streamed events per
second it reads from a server that costs next to nothing.

    python scripts/bench_client.py                          # 1000 x 256 tokens, full speed
    python scripts/bench_client.py --tokens-per-s 100       # one token per stream per 10 ms
    python scripts/bench_client.py --client-processes 4 --stub-cpus 4-7 --client-cpus 0-3

It starts the stub server (`python -m pagedllm.bench.serve_stub`) in its own
process, sends it `--num-requests` streamed completions of exactly
`--output-len` tokens each with the client of `pagedllm bench serve` (its
`run_rate` and `send_completion`; arrivals at `--request-rate`, default all
at once), and prints a table, then one JSON line (the last line of stdout).

Events are every SSE event the client read: the text events (one token each),
the usage event and `data: [DONE]`, so `output_len + 2` per request. Events/s
is their sum over the run's duration (first send to last finish, as `bench
serve` times a run). The client's and the stub's CPU time over the run say
which side was the limit: a client near 100 % of a core is the bottleneck,
and events per client CPU-second is what one core of the client can read
when it has that core to itself (on a shared machine the wall-clock figure
also counts the time other programs held the cores).

The run is checked: every request must complete with exactly `--output-len`
tokens and `--output-len + 2` events, or the script exits 1. With
`--stub-cpus` / `--client-cpus` (CPU lists such as "0" or "2-3", Linux) each
side is pinned to its own cores. `--profile PATH` writes a cProfile of the
client (one process) for `python -m pstats PATH`. `--serve-bench PATH`
measures another serve_bench.py (an older commit's, for a before/after).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib
import importlib.util
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pagedllm.bench import workloads  # noqa: E402

PROG = "bench_client.py"


def cpu_list(text: str) -> set[int]:
    """ "0,2-3" -> {0, 2, 3}, CPUs this process may use."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a CPU list like 0 or 0,2-3, got {text!r}"
        ) from None
    if not cpus <= os.sched_getaffinity(0):
        raise argparse.ArgumentTypeError(
            f"{text!r}: this process may run on CPUs {sorted(os.sched_getaffinity(0))} only"
        )
    return cpus


def at_least_1(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


def machine() -> str:
    """`nproc` and the CPU model, as docs/benchmarks.md records a machine."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{len(os.sched_getaffinity(0))} CPUs ({model}), Python {platform.python_version()}"


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def start_stub(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    """The stub in its own process (pinned to --stub-cpus); returns it and its URL."""
    cmd = [sys.executable, "-m", "pagedllm.bench.serve_stub", "--port", "0"]
    if args.tokens_per_s is not None:
        cmd += ["--tokens-per-s", str(args.tokens_per_s)]
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    stub = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env=os.environ | {"PYTHONPATH": path}
    )
    if args.stub_cpus:
        os.sched_setaffinity(stub.pid, args.stub_cpus)
    assert stub.stdout is not None
    line = stub.stdout.readline().strip()
    if not line.startswith("listening on "):
        stub.kill()
        raise SystemExit(f"{PROG}: error: the stub did not start (it said {line!r})")
    return stub, line.removeprefix("listening on ")


def load_serve_bench(path: str | None) -> Any:
    """This tree's serve_bench, or the one at `path` (an older one, for a before/after)."""
    if path is None:
        return importlib.import_module("pagedllm.bench.serve_bench")
    spec = importlib.util.spec_from_file_location("serve_bench_under_test", path)
    if spec is None or spec.loader is None or not Path(path).is_file():
        raise SystemExit(f"{PROG}: error: --serve-bench {path}: no such Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def workload(args: argparse.Namespace) -> workloads.Workload:
    prompts = [workloads.random_prompt(args.prompt_len, seed=i) for i in range(args.num_requests)]
    return workloads.Workload(
        "client",
        prompts,
        [args.output_len] * args.num_requests,
        f"{args.num_requests} requests x {args.prompt_len} prompt ids -> {args.output_len} tokens",
    )


def run(sb: Any, args: argparse.Namespace, url: str) -> tuple[list[Any], int, float]:
    """The measured run with serve_bench module `sb`: the results, the peak in flight and
    the client's CPU seconds over the run (its client processes' included, not their start)."""
    endpoint = sb.Endpoint.parse(url)
    client = sb.Client(endpoint, "stub", {}, ignore_eos=True, timeout_s=args.timeout)
    work = workload(args)
    rate, cap, seed = args.request_rate, args.max_concurrency, args.seed
    cpu = [0.0]

    async def go() -> tuple[list[Any], int]:
        await sb.served_models(endpoint, {}, 10)
        if args.client_processes == 1:
            cpu[0] = -own_cpu_s()
            out = await sb.run_rate(client, work, rate, cap, seed)
            cpu[0] += own_cpu_s()
            return out
        processes = sb.ClientProcesses(client, args.client_processes)
        try:
            await processes.start()
            pids = processes.pids()
            cpu[0] = -own_cpu_s() - sum(map(process_cpu_s, pids))
            out = await sb.run_rate(client, work, rate, cap, seed, processes)
            cpu[0] += own_cpu_s() + sum(map(process_cpu_s, pids))
            return out
        finally:
            processes.close()

    if args.profile:
        profiler = cProfile.Profile()
        results, peak = profiler.runcall(asyncio.run, go())
        profiler.dump_stats(args.profile)
    else:
        results, peak = asyncio.run(go())
    return results, peak, cpu[0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Benchmark the client of `pagedllm bench serve` alone, against a stub "
        "server in its own process: streamed events read per second.",
    )
    p.add_argument("--num-requests", type=at_least_1, default=1000, metavar="N")
    p.add_argument(
        "--output-len", type=at_least_1, default=256, metavar="N", help="tokens per request"
    )
    p.add_argument(
        "--prompt-len", type=at_least_1, default=16, metavar="N", help="prompt ids per request"
    )
    p.add_argument(
        "--tokens-per-s",
        type=float,
        metavar="R",
        help="the stub's pace: one token per stream every 1/R s (default: as fast as it can)",
    )
    p.add_argument("--request-rate", type=float, default=math.inf, metavar="R")
    p.add_argument("--max-concurrency", type=at_least_1, metavar="N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, metavar="S")
    p.add_argument(
        "--client-processes",
        type=at_least_1,
        default=1,
        metavar="N",
        help="send from N client processes (bench serve's --client-processes; default 1)",
    )
    p.add_argument("--stub-cpus", type=cpu_list, metavar="LIST", help="pin the stub to these")
    p.add_argument("--client-cpus", type=cpu_list, metavar="LIST", help="pin the client")
    p.add_argument("--profile", metavar="PATH", help="write a cProfile of the client to PATH")
    p.add_argument(
        "--serve-bench",
        metavar="PATH",
        help="the serve_bench.py to measure (default: this tree's), e.g. an older one from "
        "`git show COMMIT:src/pagedllm/bench/serve_bench.py > old.py`",
    )
    p.add_argument("--json", metavar="PATH", help="also write the JSON line to PATH")
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.tokens_per_s is not None and not args.tokens_per_s > 0:
        p.error(f"--tokens-per-s is tokens per second, > 0, got {args.tokens_per_s:g}")
    if not args.request_rate > 0:
        p.error(f"--request-rate is requests per second, > 0 (or inf), got {args.request_rate:g}")
    if args.profile and args.client_processes > 1:
        p.error("--profile profiles one client process: leave out --client-processes")
    sb = load_serve_bench(args.serve_bench)
    if args.client_processes > 1 and not hasattr(sb, "ClientProcesses"):
        p.error(f"{args.serve_bench} has no client processes: leave out --client-processes")
    if args.client_cpus:
        os.sched_setaffinity(0, args.client_cpus)  # the client processes inherit it

    stub, url = start_stub(args)
    try:
        stub_cpu0 = process_cpu_s(stub.pid)
        results, peak, client_cpu = run(sb, args, url)
        stub_cpu = process_cpu_s(stub.pid) - stub_cpu0
    finally:
        stub.terminate()
        stub.wait(10)

    out = summary(sb, args, argv, results, peak, client_cpu, stub_cpu)
    print(table(out))
    line = json.dumps(out)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    if not out["exact"]:
        wrong = next((r for r in results if not r.ok), None)
        why = wrong.error if wrong is not None else "a request's tokens or events are off"
        print(f"{PROG}: error: the counts are not exact: {why}", file=sys.stderr)
        return 1
    return 0


def summary(
    sb: Any,
    args: argparse.Namespace,
    argv: list[str],
    results: list[Any],
    peak: int,
    client_cpu: float,
    stub_cpu: float,
) -> dict[str, Any]:
    record = sb.run_record(args.request_rate, args.max_concurrency, peak, results)
    n = args.output_len
    # A serve_bench from before the client counted its events (a6c9faf and older,
    # for a before/after): the stub sends output_len + 2 events per request.
    counted = all(hasattr(r, "events") for r in results)
    events_of = [r.events if counted else n + 2 for r in results]
    events = sum(e for r, e in zip(results, events_of) if r.ok)
    expected = args.num_requests * (n + 2)
    exact = events == expected and all(
        r.ok and r.output_tokens == n and e == n + 2 for r, e in zip(results, events_of)
    )
    duration = record["duration_s"]

    def per_s(x: float) -> float | None:
        return round(x / duration, 1) if duration else None

    return {
        "bench": "serve-client",
        "machine": machine(),
        "load_average": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "num_requests": args.num_requests,
        "output_len": n,
        "stub_tokens_per_s": args.tokens_per_s,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "max_concurrency_observed": peak,
        "client_processes": args.client_processes,
        "completed": record["completed"],
        "failed": record["failed"],
        "first_error": record["first_error"],
        "events": events,
        "events_expected": expected,
        "events_counted": counted,
        "exact": exact,
        "duration_s": duration,
        "events_per_s": per_s(events),
        "output_tokens_per_s": record["output_tokens_per_s"],
        "client_cpu_s": round(client_cpu, 3),
        "stub_cpu_s": round(stub_cpu, 3),
        "client_cpu_pct": per_s(100 * client_cpu),
        "stub_cpu_pct": per_s(100 * stub_cpu),
        "events_per_client_cpu_s": round(events / client_cpu, 1) if client_cpu else None,
        "ttft_ms": record["ttft_ms"],
        "itl_ms": record["itl_ms"],
        "e2e_ms": record["e2e_ms"],
        "command": " ".join(["python scripts/bench_client.py", *argv]),
    }


def table(out: dict[str, Any]) -> str:
    pace = out["stub_tokens_per_s"]
    pace = "as fast as it can" if pace is None else f"{pace:g} tokens/s per stream"

    def rate(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}"

    rows = [
        ("machine", f"{out['machine']}, load average {out['load_average']:.2f}"),
        ("workload", f"{out['num_requests']} requests x {out['output_len']} tokens, stub {pace}"),
        ("client processes", out["client_processes"]),
        ("peak in flight", out["max_concurrency_observed"]),
        ("completed / failed", f"{out['completed']} / {out['failed']}"),
        ("events, exact", f"{out['events']:,} of {out['events_expected']:,}, {out['exact']}"),
        ("duration (s)", f"{out['duration_s']:.3f}"),
        ("events/s", rate(out["events_per_s"])),
        ("events/client CPU-s", rate(out["events_per_client_cpu_s"])),
        ("client CPU", f"{out['client_cpu_s']:.2f} s ({rate(out['client_cpu_pct'])} % of a core)"),
        ("stub CPU", f"{out['stub_cpu_s']:.2f} s ({rate(out['stub_cpu_pct'])} % of a core)"),
        ("TTFT p50 / p99 (ms)", f"{out['ttft_ms']['p50']} / {out['ttft_ms']['p99']}"),
        ("ITL p50 / p99 (ms)", f"{out['itl_ms']['p50']} / {out['itl_ms']['p99']}"),
    ]
    return "\n".join(f"{name:<21}{value}" for name, value in rows)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
