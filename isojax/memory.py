"""Compiled memory of the update step, read before any array exists.

The step is lowered from shapes alone (an ``nnx.eval_shape`` model,
``abstract_train_state``, ``abstract_batch``) and compiled; XLA's
``memory_analysis`` then says what one device needs. ``dry_run`` does this for
an experiment config: ``python -m isojax.main ... --dry_run`` prints it and
exits, so a 7B run's fit is known before a GPU hour is spent on it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from isojax import batching, models, rl, run_setup
from isojax import data as data_lib
from isojax.models import Decoder, ModelConfig
from isojax.rl import ppo
from isojax.run_plan import plan_run

GIB = 1024 ** 3

__all__ = ["MODEL_SHAPES", "StepMemory", "abstract_decoder", "dry_run", "dry_run_mesh",
           "extrapolated_step_memory", "model_shape", "per_device_bytes", "step_memory",
           "use_cpu_devices"]


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """Bytes per device of one compiled update step.

  Attributes:
    state: the train state (params, optimiser moments, ref params), this
      device's shards.
    batch: this device's rows of the batch.
    temporaries: XLA's temporary buffers (activations, gradients, logits, ...).
    output_not_aliased: outputs that do not reuse a donated input (metrics).
    code: the compiled program itself.
    backend: the platform that compiled it ("cpu", "gpu", "tpu"; "" unknown):
      temporaries are that compiler's (a CPU compile takes the XLA attention
      kernel where a GPU takes cuDNN's, and fuses differently).
  """

  state: int
  batch: int
  temporaries: int
  output_not_aliased: int
  code: int
  backend: str = ""

  @property
  def total(self) -> int:
    """What the device must hold while the step runs."""
    return self.state + self.batch + self.temporaries + self.output_not_aliased + self.code

  def fits(self, device_memory_gib: float) -> bool:
    return self.total <= device_memory_gib * GIB

  def report(self, device_memory_gib: float | None = None) -> str:
    rows = [("state (params + optimiser)", self.state), ("batch", self.batch),
            ("temporaries", self.temporaries), ("outputs (not aliased)",
                                                self.output_not_aliased),
            ("code", self.code), ("total", self.total)]
    on = f" on {self.backend}" if self.backend else ""
    lines = [f"compiled update step{on}, bytes per device:"]
    lines += [f"  {name:<28s}{b / GIB:10.3f} GiB" for name, b in rows]
    if device_memory_gib is not None:
      verdict = "fits" if self.fits(device_memory_gib) else "does NOT fit"
      lines.append(f"  {verdict} in {device_memory_gib:g} GiB per device "
                   f"({100 * self.total / (device_memory_gib * GIB):.1f} % used)")
    return "\n".join(lines)


def per_device_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded arrays or ShapeDtypeStructs.

  Uses the largest shard (``NamedSharding.shard_shape``); a leaf without a
  sharding counts whole.
  """
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = tuple(leaf.shape)
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      shape = sharding.shard_shape(shape)
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def step_memory(train_step, state, batch) -> StepMemory:
  """Lowers and compiles ``train_step`` on ``state``/``batch`` (arrays or shapes).

  Raises ValueError if the backend reports no memory analysis.
  """
  compiled = train_step.lower(state, batch).compile()
  ma = compiled.memory_analysis()
  if ma is None:
    raise ValueError(f"the {jax.default_backend()} backend gives no memory_analysis")
  return StepMemory(state=per_device_bytes(state), batch=per_device_bytes(batch),
                    temporaries=int(ma.temp_size_in_bytes),
                    output_not_aliased=max(0, int(ma.output_size_in_bytes)
                                           - int(ma.alias_size_in_bytes)),
                    code=int(ma.generated_code_size_in_bytes),
                    backend=jax.default_backend())


def abstract_decoder(cfg):
  """An ``isojax.models.Decoder`` of ``cfg`` with shapes only (no parameter memory)."""
  return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))


def use_cpu_devices(num_devices: int) -> None:
  """Makes JAX run on ``num_devices`` CPU devices, so that ``dry_run`` compiles a
  mesh of the GPUs a run will have on a machine without them (a login node).

  Must run before anything starts JAX's backends (the first device query).

  Raises:
    ValueError: if ``num_devices`` < 1, or the backends already started with
      fewer CPU devices.
  """
  if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
    raise ValueError(f"number of devices for the dry run must be an int >= 1, got "
                     f"{num_devices!r}")
  flag = f"--xla_force_host_platform_device_count={num_devices}"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
  jax.config.update("jax_platforms", "cpu")
  if len(jax.devices()) < num_devices:
    raise ValueError(f"JAX started with {len(jax.devices())} {jax.default_backend()} "
                     f"devices before {num_devices} CPU devices could be made")


def dry_run_mesh(config, num_devices: int | None = None):
  """config.mesh as the run builds it, over the first ``num_devices`` devices
  (default: all this machine has), which ``mesh.fsdp=-1`` then fills.

  Raises:
    ValueError: if the mesh does not fit those devices; it says how to compile
      for a mesh of more devices than this machine has.
  """
  devices = jax.devices()
  if num_devices is not None:
    if len(devices) < num_devices:
      raise ValueError(f"the dry run was asked for {num_devices} devices, but JAX has "
                       f"{len(devices)} {jax.default_backend()} devices")
    devices = devices[:num_devices]
  try:
    return run_setup._mesh(config, devices)
  except ValueError as e:
    m = config.mesh
    wanted = math.prod(s for s in (m.data, m.fsdp, m.tensor) if s != -1)
    if wanted <= len(devices) and -1 not in (m.data, m.fsdp, m.tensor):
      raise
    raise ValueError(f"{e} ({jax.default_backend()}); the run's devices need not be "
                     f"here: --dry_run_devices=N compiles on N CPU devices") from e


def dry_run(config, num_devices: int | None = None) -> tuple[StepMemory, dict]:
  """The memory of the update step ``isojax.main`` would build for ``config``.

  Reads the model's config.json (no weights), the training prompts (for the
  batch width, as the run does) and compiles the step from shapes, on the
  mesh of ``dry_run_mesh(config, num_devices)``.

  Returns:
    (StepMemory, a dict describing what was compiled: B, T, micro-batch, mesh).
  """
  run_plan = plan_run(config)
  path = run_setup.model_path(config)
  config_file = path / "config.json"
  if not config_file.exists():
    raise ValueError(f"{config_file} not found: config.model.path={str(path)!r} is not a "
                     f"Hugging Face model directory")
  # The run's model options, as load_pretrained gets them (where the config has
  # the field).
  options = {k: config.model[k] for k in ("remat", "attention", "lm_head_fp32")
             if k in config.model}
  cfg = models.ModelConfig.from_hf_dict(
      json.loads(config_file.read_text()), dtype=jnp.dtype(config.model.dtype),
      param_dtype=jnp.dtype(config.model.param_dtype), **options)
  model = abstract_decoder(cfg)
  mesh = dry_run_mesh(config, num_devices)
  tokenizer = models.Tokenizer.from_pretrained(path)
  train, _ = run_setup.load_problem_sets(config)
  ids = data_lib.encode_prompts(tokenizer, train, chat_template=config.data.chat_template)
  width = batching.prompt_bucket(max(len(x) for x in ids)) + run_plan.max_tokens
  point = run_plan.point
  n_est = config.rl.n_est or point.n  # a decoupled baseline adds Bp * n_est rewards
  step = run_setup.make_step(config, run_plan, model, mesh)
  state = run_setup.abstract_state(run_plan, model, mesh)  # with a critic for PPO
  batch = rl.abstract_batch(point.batch, width, mesh=mesh,
                            baseline_size=point.bp * n_est if n_est > point.n else None)
  what = {"batch": point.batch, "seq_len": width, "micro_batch": run_plan.micro_batch,
          "mesh": dict(mesh.shape), "params": sum(
              math.prod(x.shape) for x in jax.tree.leaves(state.params))}
  return step_memory(step, state, batch), what


# Architecture numbers of the paper's model families (Hugging Face config.json),
# for compile-only memory checks and benchmarks with random weights.
MODEL_SHAPES = {
    "qwen2.5-0.5b": dict(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896,
                         intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                         head_dim=64, tie_word_embeddings=True, attention_bias=True,
                         rope_theta=1e6),
    "qwen2.5-1.5b": dict(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=1536,
                         intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                         head_dim=128, tie_word_embeddings=True, attention_bias=True,
                         rope_theta=1e6),
    "qwen2.5-7b": dict(architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
                       head_dim=128, tie_word_embeddings=False, attention_bias=True,
                       rope_theta=1e6),
    "qwen3-4b": dict(architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=2560,
                     intermediate_size=9728, num_layers=36, num_heads=32, num_kv_heads=8,
                     head_dim=128, tie_word_embeddings=True, qk_norm=True, rope_theta=1e6),
}


def model_shape(name: str, **overrides):
  """The ``ModelConfig`` of a ``MODEL_SHAPES`` entry, with field overrides."""
  if name not in MODEL_SHAPES:
    raise ValueError(f"unknown model shape {name!r}; known: {sorted(MODEL_SHAPES)}")
  return ModelConfig(**{**MODEL_SHAPES[name], **overrides})


def extrapolated_step_memory(cfg, loss_cfg, optim_cfg, *, batch_size: int, seq_len: int,
                             group_size: int, mesh=None, probe_layers=(2, 4), value_cfg=None,
                             critic_optim=None, **step_kwargs) -> StepMemory:
  """Step memory of ``cfg`` from compiles of ``probe_layers`` layers, extrapolated.

  With ``value_cfg`` (and the critic's ``critic_optim``) it is PPO's joint step,
  with a critic of ``cfg``'s architecture (``isojax.rl.ppo``).

  Compiling a 28-layer step on a CPU takes minutes; every layer adds the same
  parameters, optimiser state and (with per-layer remat) the same saved
  activations, so each figure is linear in the layer count: two small compiles
  give the slope and intercept. Exact for state and batch; for temporaries as
  exact as XLA's buffer assignment is regular across layers. The probes have at
  least two layers: a remat model scans its layers, and XLA unrolls a scan of
  one, whose buffers are then not the loop's (the Qwen2.5-1.5B and 7B shapes
  from 2 and 4 layers are within 1 % of the full-depth compile; from 1 and 2
  layers the 7B's temporaries came out negative).
  """
  def measure(layers):
    model = abstract_decoder(cfg.replace(num_layers=layers))
    sizes = dict(batch_size=batch_size, mesh=mesh)
    if value_cfg is None:
      step = rl.make_train_step(model, loss_cfg, optim_cfg, group_size=group_size, **sizes,
                                **step_kwargs)
      state = rl.abstract_train_state(model, loss_cfg, optim_cfg, **sizes)
    else:
      critic = run_setup.abstract_critic(model)
      step = ppo.make_ppo_train_step(model, critic, loss_cfg, value_cfg, optim_cfg,
                                     critic_optim, group_size=group_size, **sizes,
                                     **step_kwargs)
      state = ppo.abstract_ppo_train_state(model, critic, loss_cfg, optim_cfg, critic_optim,
                                           **sizes)
    return step_memory(step, state, rl.abstract_batch(batch_size, seq_len, mesh=mesh))

  lo, hi = probe_layers
  a, b = measure(lo), measure(hi)
  n = cfg.num_layers

  def line(x, y):
    return int(round(x + (y - x) * (n - lo) / (hi - lo)))

  return StepMemory(backend=a.backend,
                    **{f.name: line(getattr(a, f.name), getattr(b, f.name))
                       for f in dataclasses.fields(StepMemory) if f.name != "backend"})
