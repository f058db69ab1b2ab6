"""Rollout backends behind one interface: `generate(...) -> Rollouts`.

`JaxSampler` samples in this process (the embedded default); `VLLMSampler`
talks to a `vllm serve` process over HTTP and pushes new weights to it.
"""

from isojax.rollout.base import Rollouts, Sampler, validate_request
from isojax.rollout.jax_sampler import JaxSampler
from isojax.rollout.vllm_client import VLLMSampler

__all__ = ["Rollouts", "Sampler", "validate_request", "JaxSampler", "VLLMSampler"]
