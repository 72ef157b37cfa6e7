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
  (or, where sampling is token by token, after the sampler's noise: its scores, queued with
  the forward pass, are masked and one argmax picks: Sampler.scores / Sampler.pick)
  after the ids reach the host:
                            oks = advance_matchers(matchers, tokens)  False -> finish with
                            matcher.error; matcher.is_finished -> finish ("stop"; only EOS
                            may follow)
```

A step's mask needs the step before's token. Under async scheduling (on for
CUDA) the engine still queues each decode step's successor before reading
the step's ids, in this order (`LLMEngine._step`): queue step N+1's forward
pass (`ModelRunner.launch` of a continuation leaves its constrained rows'
masking and sampling for later: `LaunchedStep.deferred`); read step N's ids;
`advance_matchers`; `ModelRunner.sample_deferred` fills the masks while
N+1's forward pass runs and queues the masking, the sampling and the copy
of the ids; then step N's bookkeeping. So the fill hides behind the forward
pass, and the bookkeeping behind the sampling. Where the step's sampling is
token by token (`SamplingMetadata.tokenwise`: no top-k, top-p, min_p or
log-probs), `launch` also queues the sampler's scores (l / T - log E), and
after the fill only the mask and an argmax are queued: a forbidden token's
score is -inf either way, so the ids are those of masking first (below a
temperature of 0.1, the same distribution: see `sampling/sampler.py`). A step that fails after the matchers advanced rolls
them back (`Matcher.rollback`). Rows of the bitmask are indexed in the order
`fill_bitmask` was given; `apply_bitmask` maps bitmask row i to logits row
`rows[i]` (`rows=None`: row i to row i, a batch constrained throughout).
Unconstrained rows are never touched (bit-identical logits).

Things the wiring must decide: a request whose sampler bans EOS
(`min_tokens`, `ignore_eos`) while its matcher is finished would have every
logit at -inf: end such a request at `is_finished` instead of sampling. (A
step queued ahead holds no request short of `min_tokens`, the scheduler's
rule; a row whose matcher finished in step N, so that its request ends
there, is masked to EOS in step N+1 and that token is dropped.)
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
queue behind the compile thread. Its cost is the per-step fill, which the
runner makes while the GPU runs the step's forward pass (a step ahead under
async scheduling: above).

## What a constrained step costs

`scripts/bench_structured.py` (batch 64, the Llama-3.2-1B preset with
random weights, Llama 3's 128,256 ids) prints each step's host time by part.
On the H200 (16 CPU cores), before the changes below: a plain
step 2.68 ms (3.16 ms without async scheduling), `typical` 15.3 ms, `long
string` 9.6 ms. Host ms per step: the fill 21.5 (`typical`) and 6.2 (`long
string`), the tokenizer callback 29.7 summed over the fill's threads (so
they mostly waited for the GIL, each behind our BPE), the masking 0.4 (a
copy of the row indices from pageable memory waits for the GPU, then eight
kernels), advancing the matchers 0.2, the rest as for a plain step (the
sampler's launch 1.0-1.2, its metadata 0.2-0.3; update, process and
scheduling 0.1 each); and no step was queued ahead.

Then, a first round: the callback remembers its texts (a
schema's forced keys recur in every request); matchers of one compiled
constraint that consumed the same tokens share one computed row (every
request of a schema reaches its first free token in the same state); the
masking is one Triton kernel that writes -inf where a bit is clear (the
whole batch without gather or scatter); async scheduling stays on (the
order above). On the H200: `typical` 11.8 ms, `long string` 10.0 ms (plain
2.67, 3.44 without async scheduling). Host ms per step: the fill 15.5 and
6.5, the callback 4.2 summed over threads, the masking 0.2-0.3, advancing
0.26; the sampler's launch now waits for the fill (`constrained: sample`).

What the fill was waiting for: llguidance's `LLMatcher.deep_copy` is a
shallow clone whose lexer (and its lazily built automaton) stays shared
with the template behind one mutex, so the 64 copies of one schema compute
their masks one at a time. On that host, 64 rows of one template took as
long on 12 threads as on one (`typical`: 15.0 ms a step on one thread, 16.4
on 12, means over 20 steps; `long string`: 4.4 and 5.2); on this project's
2-core machine two independent templates on two threads filled 1.7 times
as fast as one template. So a constraint now keeps one independent template
per filling thread (`CompiledConstraint.add_copies`, on the cache's thread
after the first request may start; 0.2-0.6 ms each) and hands them out in
turn. Measured on the H200 (2026-12-05, docs/benchmarks.md): `typical`
11.6 -> 6.77 ms a step (2.53x a plain step's 2.67), `long string` 8.0 ->
3.97 ms (1.48x); the fill 4.98 and 1.73 ms.

That run still counted 5.9 ms a step of tokenizer callback (summed over the
fill's threads) for `typical`. Where that went (found on the 2-core
machine, 2026-12-05): with compact JSON about 35 of 64 rows have forced
bytes each step, and llguidance tokenizes them from its own worker
threads. Python does not know those threads, so each call makes a thread
state and waits for the GIL; the Python function itself takes 5-8 us.
(`scripts/bench_fill.py` had seen about one call a step only because it
used flexible whitespace, which forces little.) Now `fill_bitmask` first
asks each row for its forced tokens on the calling thread
(`LLMatcher.compute_ff_tokens`, re-entering our tokenizer with the GIL
held), and the matcher keeps them for its next mask, so the workers never
call Python. `bench_fill.py` (64 rows, compact), median fill per step over
three runs: 2.0-2.5 -> 1.5-2.2 ms on one thread, 2.9-3.3 -> 1.4-1.8 ms on
two; calls off the calling thread 35 -> 0 a step. The masks are unchanged
(tests). The H200's figure is not measured yet.

Tried and not kept: letting llguidance tokenize forced text with its own
Rust copy of the tokenizer.json (`LLTokenizer(path)`), which needs no
callback. That copy splits out the text of special tokens even when asked
not to (`tokenize_str("a<|eot_id|>b", parse_special=False)` gives
`[64, 128009, 65]`; ours gives the plain-text ids), so a constraint whose
forced text holds such a string (a JSON `const`, a regex, a grammar
literal) would allow only the special id and then fail on it. It also cost
0.6 s more the first time a tokenizer is constrained, and on the 2-core
machine the fill was the same within noise.

What is left is llguidance's own work per row. Inside a string bounded by a
short `maxLength` (the person's name, at most 8 characters) no slice of
the vocabulary applies and each row walks the token trie: 1-1.8 ms a row
at Llama 3's vocabulary, 65-90 ms for 64 rows on one core, several times
the forward pass even on 12 threads; other states cost 10-60 us a row. A
real model spends a token or two in such a string where the random model
spends several.

On the 2-core CPU machine with a tiny random model over the same
vocabulary (`--device cpu --model TINY --tokenizer llama3`) the masking
went from 29-34 ms to 11-15 ms a step (numpy unpacks the bits there) and
the callback from 0.6 to 0.3 ms.

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
the stepping thread only. llguidance calls back into our tokenizer for a
mask whose next bytes are forced (about once per two tokens of compact
JSON): 10-30 us for our BPE, a dict lookup once the text was seen
(`_Tokenize` remembers up to 8192 texts); the callback never raises
(`matcher.py`). `fill_bitmask` makes those calls on its own thread before
the parallel fill (`_prime_forced_tokens`), never from llguidance's
threads.

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
