"""Sampling and stopping: logits -> token ids, and when a request is done.

`sampler.py` turns a batch's logits into one token per request (greedy,
temperature, top-k/p, min-p, penalties, seeds, log-probs); `stop.py` checks
stop strings on the streamed text and stop token ids on the sampled ids.
"""

from pagedllm.sampling.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_logprobs,
    make_generator,
)
from pagedllm.sampling.stop import StopStringMatcher, check_stop_token

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "StopStringMatcher",
    "check_stop_token",
    "compute_logprobs",
    "make_generator",
]
