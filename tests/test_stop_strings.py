"""Stop strings across token boundaries, held back so they never leak; stop token ids."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.engine.stop_strings import StopStringMatcher
from pagedllm.sampling_params import SamplingParams


def reference_answer(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The text cut at the stop occurrence that ends first (ties: the longest)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end if include else end - len(stop)], stop
    return text, None


def run(pieces: list[str], stops: list[str], include: bool):
    """Feed pieces; return (emitted so far after each call, matched stop)."""
    m = StopStringMatcher(stops, include)
    emitted, history, fed = "", [], ""
    for piece in pieces:
        out, stop = m.feed(piece)
        fed += piece
        emitted += out
        history.append(emitted)
        if stop is not None:
            return history, stop
        # Nothing is lost: what is not emitted yet is held.
        assert emitted + m.held == fed
    history.append(emitted + m.flush())
    return history, None


def test_stop_straddling_tokens():
    history, stop = run(["Hello wo", "rld! ST", "O", "P and more"], ["STOP"], False)
    assert stop == "STOP"
    assert history == ["Hello wo", "Hello world! ", "Hello world! ", "Hello world! "]


def test_include_stop_str():
    history, stop = run(["a<", "/s", "> tail"], ["</s>"], True)
    assert stop == "</s>" and history[-1] == "a</s>"


def test_partial_prefix_released_when_it_does_not_grow():
    m = StopStringMatcher(["abc"])
    assert m.feed("xab") == ("x", None)
    assert m.feed("d") == ("abd", None)
    assert m.feed("ab") == ("", None)
    assert m.flush() == "ab"


def test_first_ending_stop_wins():
    # "b" completes before "abc" could; same end -> the longer one.
    assert run(["a", "b", "c"], ["abc", "b"], False) == (["", "a"], "b")
    assert run(["xabc"], ["bc", "abc"], False) == (["x"], "abc")


def test_no_stops_passes_through():
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", None)
    assert m.flush() == ""


def test_check_false_ignores_completed_stops_but_keeps_holding():
    m = StopStringMatcher(["END"])
    assert m.feed("xEND", check=False) == ("xEND", None)
    assert m.feed("E", check=False) == ("", None)  # might still become END
    assert m.feed("ND!") == ("", "END")


def test_feed_after_stop_is_an_error():
    m = StopStringMatcher(["x"])
    m.feed("x")
    assert m.stopped and m.matched == "x"
    with pytest.raises(RuntimeError):
        m.feed("more")


def test_from_params():
    m = StopStringMatcher.from_params(SamplingParams(stop="##", include_stop_str_in_output=True))
    assert m.stop == ("##",) and m.include_stop_str_in_output


def test_empty_stop_refused():
    with pytest.raises(ValueError):
        StopStringMatcher(["a", ""])


@st.composite
def split_text(draw):
    alphabet = "ab c"
    text = draw(st.text(alphabet, max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    pieces = [text[i:j] for i, j in zip(bounds, bounds[1:])]
    stops = draw(st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3))
    return text, pieces, stops


@settings(max_examples=400, deadline=None)
@given(split_text(), st.booleans())
def test_streamed_equals_reference_and_never_leaks(case, include):
    text, pieces, stops = case
    answer, want_stop = reference_answer(text, stops, include)
    history, stop = run(pieces, stops, include)
    assert stop == want_stop
    assert history[-1] == answer
    # Every intermediate emission is a prefix of the answer: no partial stop leaked.
    assert all(answer.startswith(h) for h in history)
