"""Sampling: logits -> token ids, on the device (called by the runner).

`sampler.py` turns a batch's logits into one token per request (greedy,
temperature, top-k/p, min-p, penalties, seeds, log-probs). Stop strings are
the engine's (`engine/stop_strings.py`), token stops the scheduler's.
"""

from pagedllm.sampling.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_logprobs,
    make_generator,
)

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_logprobs",
    "make_generator",
]
