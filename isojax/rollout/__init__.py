"""Rollout backends behind one interface: `generate(...) -> Rollouts`.

`isojax.rollout.jax_sampler.JaxSampler` samples in this process (the embedded
default); `isojax.rollout.vllm_client.VLLMSampler` talks to a `vllm serve` process
over HTTP and pushes new weights to it; `isojax.rollout.interruption` wraps either
to interrupt rollouts at a thinking budget (ScaleRL). Each backend is imported
where it is used, so that `isojax.rollout.vllm_server` (which only starts a
process) loads no JAX.
"""

from isojax.rollout.base import Rollouts, Sampler, validate_request

__all__ = ["Rollouts", "Sampler", "validate_request"]
