"""SamplingParams: vLLM's ranges, ValueError naming the field, and resolution of unset fields."""

from __future__ import annotations

import dataclasses

import pytest

from pagedllm.sampling_params import SamplingParams

BAD = [
    ("max_tokens", 0),
    ("max_tokens", "5"),
    ("max_tokens", 5.0),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", "1"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3),
    ("frequency_penalty", None),
    ("seed", 1.5),
    ("logprobs", -1),
    ("logprobs", 21),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", "3"),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["2"]),
    ("stop_token_ids", 7),
    ("ignore_eos", 1),
    ("include_stop_str_in_output", "yes"),
    ("skip_special_tokens", None),
]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_bad_value_raises_naming_the_field(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_error_states_the_range():
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"in \[-2, 2\]"):
        SamplingParams(presence_penalty=-3)


def test_min_tokens_at_most_max_tokens():
    SamplingParams(max_tokens=4, min_tokens=4)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_replace_validates_again():
    p = SamplingParams()
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-1.0)


def test_good_values_and_normalisation():
    p = SamplingParams(
        temperature=1,
        top_k=-1,
        top_p=1,
        min_p=0,
        repetition_penalty=1.2,
        presence_penalty=-2,
        frequency_penalty=2,
        seed=-5,
        stop="###",
        stop_token_ids=[7, 8],
        logprobs=0,
        prompt_logprobs=20,
    )
    assert p.top_k == 0  # -1 is vLLM's "off", stored as 0
    assert p.stop == ("###",)
    assert p.stop_token_ids == (7, 8)
    assert isinstance(p.temperature, float) and isinstance(p.presence_penalty, float)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams().stop == () and SamplingParams().stop_token_ids == ()


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.8, top_k=1).greedy
    assert not SamplingParams(temperature=0.8, top_k=2).greedy
    assert not SamplingParams().greedy  # unset temperature reads as vLLM's 1.0
    assert SamplingParams.greedy_params(max_tokens=3).greedy
    assert SamplingParams.greedy_params(max_tokens=3).max_tokens == 3


def test_resolved_fills_from_generation_config_then_vllm():
    gen = {"temperature": 0.6, "top_p": 0.9, "do_sample": True, "bos_token_id": 1}
    p = SamplingParams(top_k=5).resolved(gen)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        0.6,
        0.9,
        5,  # the user's value wins
        0.0,  # vLLM's default
        1.0,
    )
    assert p.is_resolved and not SamplingParams().is_resolved
    # ModelConfig.generation_defaults is a tuple of pairs.
    q = SamplingParams().resolved((("top_k", 50), ("min_p", 0.05)))
    assert (q.temperature, q.top_k, q.min_p) == (1.0, 50, 0.05)
    assert SamplingParams().resolved() == SamplingParams(
        temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0
    )


def test_do_sample_false_means_greedy_unless_user_sets_temperature():
    gen = {"do_sample": False, "temperature": 0.6}
    assert SamplingParams().resolved(gen).greedy
    assert SamplingParams().resolved(gen).temperature == 0.0
    assert SamplingParams(temperature=0.7).resolved(gen).temperature == 0.7


def test_resolved_rejects_bad_model_default():
    with pytest.raises(ValueError, match="generation_config.*top_p"):
        SamplingParams().resolved({"top_p": 0.0})


def test_resolved_is_idempotent():
    p = SamplingParams(temperature=0.5).resolved({"top_p": 0.8})
    assert p.resolved({"top_p": 0.1}) is p
