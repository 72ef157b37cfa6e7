"""One request's text as its token ids come: incremental detokenizing and stop strings.

Owns: turning each step's new ids into the text safe to show, and deciding
when the text says stop. Used where the text work runs: inside `LLMEngine`
for the offline `LLM`, and in the HTTP process for `pagedllm serve` (the
engine core then sends ids only). Pure Python, no torch.

The rules, the same in both places:
- a token that finished the request by id (EOS, a stop token id) is not text;
- ids past the tokenizer's vocabulary (a model's padded embedding rows) have
  no text;
- the first `min_tokens` outputs never stop on a stop string;
- a stop string is never shown in part (StopStringMatcher holds back a tail
  that could still grow into one).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.engine.stop_strings import StopStringMatcher
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import IncrementalDetokenizer, Tokenizer

# A prompt given as ids may end inside a UTF-8 character (at most 3 of its 4
# bytes, so in at most its last 3 tokens) that the first generated token
# completes. Priming the decoder with the prompt's last 8 ids is enough: bytes of
# an earlier character, cut in the middle, decode to text that is dropped anyway.
PRIMING_IDS = 8


class RequestText:
    """Detokenizer and stop-string matcher of one request.

    `feed(new_ids, ...)` returns (text to show, matched stop string or None);
    after a match the request is finished by its caller and `feed` is not
    called again."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        params: SamplingParams,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = params.min_tokens
        self.matcher = StopStringMatcher.from_params(params) if params.stop else None
        self.detokenizer = None
        if tokenizer is not None:
            vocab = tokenizer.vocab_size
            prime = [t for t in prompt_ids[-PRIMING_IDS:] if 0 <= t < vocab]
            self.detokenizer = IncrementalDetokenizer(
                tokenizer, prompt_ids=prime, skip_special_tokens=params.skip_special_tokens
            )

    def feed(
        self,
        new_ids: Sequence[int],
        num_output_tokens: int,
        finished: bool,
        stop_token: int | str | None = None,
    ) -> tuple[str, str | None]:
        """This step's ids -> (new text, the stop string that matched or None).

        `num_output_tokens`: the request's outputs so far, these included;
        `finished`/`stop_token`: whether a token-level rule ended it and the
        id that did (that id is not text)."""
        if self.detokenizer is None:
            return "", None
        if finished and new_ids and stop_token is not None and new_ids[-1] == stop_token:
            new_ids = new_ids[:-1]
        vocab = self.tokenizer.vocab_size
        piece = self.detokenizer.add_many([t for t in new_ids if t < vocab])
        if finished:
            piece += self.detokenizer.finish()
        if self.matcher is None:
            return piece, None
        emit, matched = self.matcher.feed(piece, check=num_output_tokens > self.min_tokens)
        if matched is None and finished:
            emit += self.matcher.flush()
        return emit, matched
