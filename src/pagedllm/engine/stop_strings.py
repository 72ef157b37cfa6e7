"""Stop strings on the streamed text.

Pure Python, no torch. Owns: deciding when a request's *text* says stop, and
how much of the text is safe to show. Does not own: the token-level stops
(EOS, stop token ids, max_tokens, the model's context: the scheduler's
`_check_stop`, the one rule for those), or detokenization (the tokenizer's
incremental detokenizer produces the `new_text` fed here).

`StopStringMatcher` is fed each step's new detokenized text and returns the
part that is safe to emit. It holds back the longest suffix that could still
grow into a stop string, so a stop string never leaks partially into streamed
output, even when it straddles tokens.

Which stop wins: generation stops as soon as the text contains any stop string,
i.e. at the occurrence that *ends* first; among occurrences that end at the same
character, the longest (it starts earliest). This does not depend on how the
text is split into pieces.

Invariant (after every call): the concatenation of everything emitted so far is
a prefix of the final answer, where the final answer is the whole text cut right
before the winning stop string (or right after it, with
`include_stop_str_in_output`), or the whole text when nothing matched and
`flush()` was called.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.sampling_params import SamplingParams


class StopStringMatcher:
    """Incremental stop-string matching for one request.

    Usage per step: `emit, stop = m.feed(new_text)`; stream `emit`; when `stop`
    is not None the request is finished with that stop string (and `feed` must
    not be called again). At the end without a match, `m.flush()` returns the
    held-back tail. Feed with `check=num_output_tokens > params.min_tokens`
    (the first `min_tokens` outputs never stop, as in vLLM): occurrences that
    complete while `check` is False are ignored and emitted as plain text.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.stop: tuple[str, ...] = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.held = ""  # text received but not yet emitted: a possible stop-string start
        self.matched: str | None = None

    @classmethod
    def from_params(cls, params: SamplingParams) -> StopStringMatcher:
        return cls(params.stop, params.include_stop_str_in_output)

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, new_text: str, check: bool = True) -> tuple[str, str | None]:
        """Take this step's new text; return (text safe to emit now, matched stop or None)."""
        if self.matched is not None:
            raise RuntimeError("StopStringMatcher.feed called after a stop string matched")
        buf = self.held + new_text
        if check:
            hit = self._first_match(buf)
            if hit is not None:
                start, stop = hit
                self.matched, self.held = stop, ""
                end = start + len(stop) if self.include_stop_str_in_output else start
                return buf[:end], stop
        # No match: hold back the longest suffix that is a proper prefix of a stop
        # string. Nothing before it can start a stop string that completes later.
        keep = self._partial_suffix_len(buf)
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """End of generation without a stop string: release the held-back text."""
        out, self.held = self.held, ""
        return out

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        """(start, stop) of the occurrence in `buf` that ends first (ties: longest)."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self.stop:
            i = buf.find(stop)  # the earliest start is also the earliest end of this stop
            if i >= 0:
                key = (i + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _partial_suffix_len(self, buf: str) -> int:
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest
