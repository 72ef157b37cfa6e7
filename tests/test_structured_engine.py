"""Constrained decoding through the engine (issue 37): the offline `LLM` with
`SamplingParams(structured=...)` on SmolLM2.

Oracles: `jsonschema` for the outputs; the same greedy requests run alone for
isolation (unconstrained rows are never touched by the masks).
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from pagedllm import LLM, SamplingParams  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm(smollm2, smollm2_path):
    from pagedllm.tokenizer import Tokenizer

    return LLM(model=smollm2, tokenizer=Tokenizer.from_model_path(smollm2_path), kv_cache_mib=32)


def constrained(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=80, temperature=0, **kw)


def sampled_person(seed: int, max_tokens: int) -> SamplingParams:
    """PERSON as compact JSON, sampled at temperature 1 with a seed."""
    structured = {"json": PERSON, "whitespace": "compact"}
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured=structured)


def test_json_schema_outputs_validate_greedy_and_sampled(llm):
    params = [
        constrained(structured={"json": PERSON, "whitespace": "compact"}),
        sampled_person(seed=5, max_tokens=80),
    ]
    for out in llm.chat([ASK, ASK], params):
        assert out.finish_reason == "stop", (out.text, out.error)
        jsonschema.validate(json.loads(out.text), PERSON)


def test_unconstrained_requests_are_untouched_by_constrained_neighbours(llm):
    plain = SamplingParams(max_tokens=16, temperature=0)
    alone = llm.chat([HI, ASK], plain)
    mixed = llm.chat(
        [HI, ASK, ASK],
        [plain, plain, constrained(structured={"json": PERSON, "whitespace": "compact"})],
    )
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[2].text), PERSON)


def test_regex_and_choice(llm):
    date, pick = llm.chat(
        [ASK, ASK],
        [
            constrained(structured={"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}),
            constrained(structured={"choice": ["yes", "no", "maybe"]}),
        ],
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.text) and date.finish_reason == "stop"
    assert pick.text in ("yes", "no", "maybe") and pick.finish_reason == "stop"


def test_a_constraint_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    (out,) = llm.chat(
        [ASK], [SamplingParams(max_tokens=5, temperature=0, structured={"regex": "a{50}"})]
    )
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert set(out.text) == {"a"} and len(out.text) < 50  # a prefix of what it must write


def test_bad_constraints_are_one_line_value_errors():
    for bad in ({"regex": "("}, {"json": {"type": "nope"}}, {"choice": []}, {"json": 3}):
        with pytest.raises(ValueError) as e:
            SamplingParams(structured=bad)
        assert "\n" not in str(e.value)


# ------------------------------------------------- async scheduling (a step ahead)


def pipelined(smollm2, smollm2_path):
    """An engine that queues each decode step's successor before reading its
    tokens (async scheduling, on the CPU too), and a count of the continuations
    whose constrained rows were masked and sampled once the matchers caught up."""
    from pagedllm.tokenizer import Tokenizer

    llm = LLM(
        model=smollm2,
        tokenizer=Tokenizer.from_model_path(smollm2_path),
        kv_cache_mib=32,
        async_scheduling=True,
    )
    runner = llm.engine.runner
    real = runner.sample_deferred
    calls = []

    def counted(step):
        calls.append(step.deferred is not None)
        return real(step)

    runner.sample_deferred = counted
    return llm, calls


MIXED = [
    constrained(structured={"json": PERSON, "whitespace": "compact"}),
    sampled_person(seed=11, max_tokens=60),
    constrained(structured={"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}),
    SamplingParams(max_tokens=24, temperature=0),
]


def test_async_scheduling_runs_constrained_steps_ahead_with_the_same_tokens(
    llm, smollm2, smollm2_path
):
    """Oracle: the same requests without async scheduling. Continuations with
    constrained rows ran (their masks made after the step before was read) and
    every request's tokens, text and finish reason are as without."""
    want = llm.chat([ASK] * 4, MIXED)
    fast, deferred = pipelined(smollm2, smollm2_path)
    got = fast.chat([ASK] * 4, MIXED)
    assert sum(deferred) >= 5, "no constrained continuation ran"
    for a, b in zip(got, want):
        assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
    for out in got[:2]:
        jsonschema.validate(json.loads(out.text), PERSON)
    assert fast.engine._inflight is None and not fast.engine.has_unfinished()


@pytest.mark.parametrize("fail_with", [RuntimeError, KeyboardInterrupt])
def test_a_failed_deferred_sample_rolls_the_matchers_back(llm, smollm2, smollm2_path, fail_with):
    """Sampling a continuation's constrained rows fails after the matchers took
    the step before's tokens: both steps are undone and so are the matchers'
    advances and the seeded row's draws (made when the step was launched), so
    every answer is that of an engine that never failed."""
    want = llm.chat([ASK] * 4, MIXED)
    fast, _ = pipelined(smollm2, smollm2_path)
    eng, runner = fast.engine, fast.engine.runner
    prompts = [eng.tokenizer.encode_chat(ASK) for _ in range(4)]
    reqs = [eng.add_request(p, params) for p, params in zip(prompts, MIXED)]
    counted = runner.sample_deferred
    failed = []

    def failing(step):
        if not failed and step.deferred is not None:
            failed.append(True)
            raise fail_with("the device went away")
        return counted(step)

    runner.sample_deferred = failing
    with pytest.raises(fail_with):
        while eng.has_unfinished():
            eng.step()
    assert failed and eng._inflight is None
    eng.scheduler.check_invariants()
    while eng.has_unfinished():
        eng.step()
    for i in range(4):
        assert reqs[i].output_token_ids == want[i].token_ids
        assert reqs[i].finish_reason == want[i].finish_reason
    jsonschema.validate(json.loads(eng.tokenizer.decode(reqs[1].output_token_ids)), PERSON)


def test_constrained_steps_sample_before_the_mask_with_the_same_ids(
    llm, smollm2, smollm2_path, monkeypatch
):
    """Where a step's sampling is token by token (temperature, penalties: no
    top-k, top-p, min_p or log-probs), the runner queues the sampler at launch
    and puts the mask on its scores once the fill is done (`Sampler.scores`,
    then `Sampler.pick`). Oracle: the same requests with that path turned off,
    the logits masked before the sampler: the same ids for every request (a
    seeded one included), with and without async scheduling."""
    from pagedllm.sampling import Sampler, SamplingMetadata

    picks = []
    real_pick = Sampler.pick
    monkeypatch.setattr(Sampler, "pick", lambda self, s: picks.append(1) or real_pick(self, s))
    fast, _ = pipelined(smollm2, smollm2_path)
    got = [llm.chat([ASK] * 4, MIXED), fast.chat([ASK] * 4, MIXED)]
    assert len(picks) >= 10, "the scores path did not run"
    monkeypatch.setattr(SamplingMetadata, "tokenwise", property(lambda self: False))
    picks.clear()
    want = llm.chat([ASK] * 4, MIXED)
    assert not picks
    for outs in got:
        assert [o.token_ids for o in outs] == [o.token_ids for o in want]
