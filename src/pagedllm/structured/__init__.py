"""Constrained decoding: a request's output held to a JSON schema, any JSON
object, a regular expression, a choice of strings or a grammar (issue 37).

Owns: the constraint as a value (`constraint.py`, stdlib at import), its
compilation against a tokenizer and each request's matcher over llguidance
(`matcher.py`, no torch), and the bitmask on the logits (`bitmask.py`, torch:
imported by the runner only). Does not own: where a request's constraint
comes from (`SamplingParams`, the server's `response_format`), when requests
run (the scheduler knows nothing of grammars) or sampling itself.

## The mechanism

At each step a constrained request's matcher fills one row of a token
bitmask: one bit per vocabulary id, set where the id may come next. The
runner sets the logits of every unset id to -inf before sampling, so that
whatever the sampler draws (greedy, top-p, a seeded draw), the text stays a
prefix of something the constraint accepts. After sampling the matcher
consumes the token (`advance`). The row is filled on the CPU while the GPU
computes the logits, and only the copy (a pinned buffer, 16 KB per request
at Llama 3's vocabulary) and the masking (a few element-wise kernels) are
added to the step.

## What the engine, runner and server call, and when

```
server/LLM, on a request:   StructuredOutput(json=..., ...)          ValueError -> 400 / raise
engine, add_request:        fut = constraint_cache(tokenizer).submit(constraint)
                            (compiles on the cache's thread; the request is scheduled once
                            fut is done; fut.exception() -> the request ends with an error)
                            matcher = fut.result().matcher()         # one per request
runner, once:               bitmask = allocate_bitmask(max_batch, tokenizer.vocab_size)
each step, for the rows whose request has a matcher:
  after the forward pass is queued (GPU busy), on the CPU:
                            fill_bitmask(bitmask, [(i, matcher_i), ...])   # GIL released
  before sampling:          apply_bitmask(logits, bitmask, rows)     # rows: the logits' rows
  after the ids reach the host:
                            matcher.advance(token)  False -> finish with matcher.error
                            matcher.is_finished     -> finish ("stop"; only EOS may follow)
```

A step's mask needs the previous step's token, so the engine queues no step
ahead (async scheduling) while a constrained request runs. Keeping the
overlap would take this order, not built yet: queue step N+1's forward, read
step N's ids, `advance`, fill, then queue step N+1's masking and sampling. Rows of the bitmask are indexed in the order
`fill_bitmask` was given; `apply_bitmask` maps bitmask row i to logits row
`rows[i]`. Unconstrained rows are never touched (bit-identical logits).

Things the wiring must decide: a request whose sampler bans EOS
(`min_tokens`, `ignore_eos`) while its matcher is finished would have every
logit at -inf: end such a request at `is_finished` instead of sampling.
`stop_token_ids` that are not the tokenizer's EOS ids are masked out under a
constraint (the constraint decides where the output ends). The matcher's
vocabulary is the tokenizer's; ids of a wider embedding are never allowed.

## The library: llguidance, not xgrammar

Both take a vocabulary of bytes, compile JSON schemas, regexes and grammars,
and fill the same int32 bitmask layout; vLLM ships both. Measured on this
project's CPU machine (2 shared AMD EPYC cores, loaded by other work: ranges
over three runs, 2026-12-04), with
`PYTHONPATH=src python3 scripts/compare_structured_backends.py`
(llguidance 1.9.1 through this package, xgrammar 0.2.9; compact JSON;
"typical" is an 8-property person with a nested address, a pattern, an enum
and an array; per-step fills replay eight realistic documents token by token):

| | llguidance | xgrammar |
|---|---|---|
| run-time Python dependencies | none (one abi3 Rust wheel, 3 MB) | torch, transformers, triton, pydantic, apache-tvm-ffi |
| `import` | 60-125 ms | 2.0-4.5 s (imports torch and transformers) |
| adapter, SmolLM2 (49,152 ids) / Llama 3 (128,256) | 0.15-0.28 s / 0.38-0.79 s | 0.05-0.07 s / 0.13-0.17 s |
| compile, typical schema (first) | 1.7-4.8 ms | 12-55 ms (91-155 ms in a busier run) |
| compile, 60-property schema | 3.3-7.7 ms | 6.5-12.7 ms |
| a cached schema / a new request's matcher | 0.6 ms (building `StructuredOutput`: the check) / 0.01 ms | 0.1 ms / 0.05 ms |
| one row, per step, SmolLM2 (mean / median / p99) | 25-36 / 19 / 115-153 us | 6 / 3 / 14-15 us |
| one row, per step, Llama 3 | 34-58 / 20-22 / 230-330 us | 15-23 / 5 / 52-67 us |
| 64 rows, Llama 3: serial / own threads (2 cores) | 3.4-7.4 / 0.9-5.1 ms | 1.0-1.2 / 0.75-0.9 ms |
| random-model validity, 34 schemas x 3 (SmolLM2) | 102 / 102 | 96 / 102 |

xgrammar precomputes most of each schema's masks when it compiles, so its
steps are 2-4 times cheaper and its compiles 5-10 times dearer; llguidance
computes masks lazily (an Earley parser over a lexer on the token trie), so a
new schema costs a few milliseconds and a step tens of microseconds. Its
slow steps are inside strings bounded by `maxLength` (up to 1.5 ms at Llama
3's vocabulary, where every token must be checked against the count).

Chosen: llguidance, for three reasons. (1) Dependencies: it needs nothing,
so it is a core dependency that the offline `LLM` and the engine core can
import without torch; xgrammar would pull transformers and triton into every
install and torch into the engine's layer (its module imports torch), and
its import costs seconds. (2) Correctness: every output of the random model
validated; xgrammar ignored `maxLength` beside `format` and the whole of
`allOf` (a warning each, then unconstrained strings), and allows raw control
characters (U+0000-U+001F) inside strings that have a `maxLength` (invalid
JSON; 28 such SmolLM2 tokens allowed after the opening quote; llguidance
allows none). llguidance refuses what it cannot honour (`uniqueItems`, `not`,
`if`/`then`, `contains`...) with a message, which becomes our 400. (3) A new
schema compiles in milliseconds, so a burst of distinct tool schemas does not
queue behind the compile thread. Its cost is the per-step fill: at batch 64
with Llama 3's vocabulary, about 1 ms with its threads on two busy cores,
which the runner fills while the GPU runs the step's forward pass. A 1B
decode step of 64 rows takes about 2.3 ms on the H200, so the fill is not
small beside it, and while a constrained request runs no step is queued
ahead (the engine's async scheduling is off for that step). Not measured on
the GPU yet: `scripts/bench_structured.py` is the benchmark.

## Dependency: core, not the `server` extra

`SamplingParams` carries a `StructuredOutput` and the offline `LLM` must
honour it after `pip install pagedllm`; an extra would make the feature
fail at run time for offline users. llguidance has no dependencies of its
own and one abi3 wheel per platform (every Python from 3.10), so it is a core
dependency, and it
is still imported lazily (on the first constraint built), so a process that
never constrains never loads it.

## Threads

llguidance's matchers are Rust objects behind PyO3, which checks borrows at
run time (two threads on one matcher get an error, never a torn state), and
building a matcher or filling a mask releases the GIL. Compiles run on the
cache's worker thread (`ConstraintCache.submit`); each matcher is used by
the stepping thread only. llguidance calls back into our tokenizer while it
fills a mask whose next bytes are forced (holding the GIL, 10-30 us, about
once per two tokens of JSON); the callback never raises (`matcher.py`).

## Syntaxes

`grammar` takes llguidance's Lark dialect (`start: ...`, `/regex/`
terminals, `%json {...}` to embed a schema) or llama.cpp's GBNF (any text
with `::=`, converted to Lark), so that grammars written for vLLM's
xgrammar (GBNF) and guidance (Lark) backends both work. `regex` is the Rust
`regex` crate's syntax (no look-around or backreferences: refused with a
message). JSON schemas: draft 2020-12's keywords that constrain generation
(types, properties, required, additionalProperties, items/prefixItems,
min/maxItems, enum/const, anyOf/oneOf/allOf, $defs/$ref, string
pattern/format/min/maxLength, numeric bounds, multipleOf).
"""

from pagedllm.structured.constraint import StructuredOutput
from pagedllm.structured.matcher import (
    CompiledConstraint,
    ConstraintCache,
    Matcher,
    TokenizerAdapter,
    advance_matchers,
    bitmask_words,
    constraint_cache,
    fill_bitmask,
    tokenizer_adapter,
)

__all__ = [
    "CompiledConstraint",
    "ConstraintCache",
    "Matcher",
    "StructuredOutput",
    "TokenizerAdapter",
    "advance_matchers",
    "bitmask_words",
    "constraint_cache",
    "fill_bitmask",
    "tokenizer_adapter",
]
