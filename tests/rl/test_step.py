"""The jitted update step: gradient vs a direct full-batch reference, micro-batch
and sharding invariance, a stored one-step regression, skipping, bad input.

Compiles are the cost here (a few seconds each on a quiet CPU), so steps are
built once per module and shared between tests.
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from isojax import sharding as shd
from isojax.models import Decoder, ModelConfig
from isojax.rl import Batch, LossConfig, OptimConfig, init_train_state, make_train_step
from isojax.rl.losses import RATIO_METRICS, policy_loss

B, T, N = 8, 12, 4  # rows, tokens, rollouts per prompt (Bp = 2)
PROMPT = 5  # prompt width (left-padded); completion columns [PROMPT, T)

# Adam's first step is -lr * g / (|g| + eps): with lr = eps = 1e5 it is -g to
# ~1e-5 relative, so parameter deltas expose the gradient (scale included).
SGD_LIKE = OptimConfig(lr_base=1e5, lr_rule="constant", warmup_steps=0, weight_decay=0.0,
                       eps=1e5, max_grad_norm=None)
LOSS = LossConfig(kind="ppo_clip", agg="prompt_mean", kl_coef=0.2, kl_estimator="k3",
                  entropy_coef=0.05, tis_cap=1.2, zero_var_filter="regularizers")


def tiny_config(**kw):
  base = dict(architecture="Qwen2ForCausalLM", vocab_size=64, hidden_size=32,
              intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
              tie_word_embeddings=True, attention_bias=True)
  return ModelConfig(**{**base, **kw})


def make_batch(seed=0, rewards=(1, 0, 0, 1, 1, 1, 1, 1)):
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, 64, (B, T)).astype(np.int32)
  attn = np.zeros((B, T), np.int32)
  loss_mask = np.zeros((B, T), np.float32)
  prompt_len = [5, 3, 5, 4, 2, 2, 5, 3]
  completion_len = [7, 4, 1, 7, 5, 2, 6, 3]
  for b in range(B):
    attn[b, PROMPT - prompt_len[b]:PROMPT + completion_len[b]] = 1
    loss_mask[b, PROMPT:PROMPT + completion_len[b]] = 1
  ids = ids * attn
  sampler = (-rng.uniform(0.5, 4.0, (B, T)) * loss_mask).astype(np.float32)
  return Batch(input_ids_BxT=jnp.asarray(ids), attention_mask_BxT=jnp.asarray(attn),
               loss_mask_BxT=jnp.asarray(loss_mask), sampler_logp_BxT=jnp.asarray(sampler),
               rewards_B=jnp.asarray(np.asarray(rewards, np.float32)))


@pytest.fixture(scope="module")
def model():
  return Decoder(tiny_config(), rngs=nnx.Rngs(0))


def perturbed_state(model, mesh=None):
  """A state whose params differ from ref_params (so KL and its gradient are live)."""
  state = init_train_state(model, LOSS, SGD_LIKE, batch_size=B, mesh=mesh)
  keys = iter(jax.random.split(jax.random.key(1), 64))
  noisy = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(next(keys), p.shape), state.params)
  return state.replace(params=jax.device_put(noisy, jax.tree.map(lambda p: p.sharding,
                                                                 state.params)))


def run(model, *, micro, mesh=None, chunk=None, batch=None, step=None):
  if step is None:
    step = make_train_step(model, LOSS, SGD_LIKE, batch_size=B, group_size=N,
                           micro_batch_size=micro, mesh=mesh, logits_chunk=chunk)
  state = perturbed_state(model, mesh)
  before = jax.tree.map(np.asarray, state.params)
  new, metrics = step(state, make_batch() if batch is None else batch)
  delta = jax.tree.map(lambda a, b: np.asarray(a) - b, new.params, before)
  return delta, {k: float(v) for k, v in metrics.items()}, new


@pytest.fixture(scope="module")
def step8(model):
  """Single device, one micro-batch; not donating, so tests can reuse states."""
  return make_train_step(model, LOSS, SGD_LIKE, batch_size=B, group_size=N,
                         micro_batch_size=8, donate=False)


@pytest.fixture(scope="module")
def full_batch_run(model, step8):
  return run(model, micro=8, step=step8)


def reference_grad_and_loss(model, old_is_sampler=False):
  """jax.grad of policy_loss on the model's full logits, advantages from NumPy;
  the ratio against the current forward or (``old_is_sampler``) the sampler's."""
  batch = make_batch()
  state = perturbed_state(model)
  graphdef, _ = nnx.split(model, nnx.Param)
  ids = batch.input_ids_BxT

  def logp_entropy(params):
    logits = nnx.merge(graphdef, params)(ids, attention_mask=batch.attention_mask_BxT)
    logsm = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(logsm, ids[:, 1:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logsm) * logsm, axis=-1)
    pad = jnp.zeros((B, 1))
    return jnp.concatenate([pad, lp], 1), jnp.concatenate([pad, ent], 1)

  r = np.asarray(batch.rewards_B).reshape(-1, N)
  std = r.std(1, ddof=1, keepdims=True)
  adv = np.where(std > 0, (r - r.mean(1, keepdims=True)) / (std + 1e-6), 0.0).ravel()
  ref_logp = jax.lax.stop_gradient(logp_entropy(state.ref_params)[0])

  def loss_fn(params):
    lp, ent = logp_entropy(params)
    old = None if old_is_sampler else jax.lax.stop_gradient(lp)
    return policy_loss(lp, old, jnp.asarray(adv, jnp.float32),
                       batch.loss_mask_BxT, LOSS, sampler_logp_BxT=batch.sampler_logp_BxT,
                       ref_logp_BxT=ref_logp, entropy_BxT=ent, group_size=N,
                       zero_var_Bp=r.max(1) == r.min(1))

  (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(state.params)
  return jax.tree.map(np.asarray, grads), float(loss), metrics


def assert_trees_close(a, b, atol, rtol=0.0):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=atol, rtol=rtol, err_msg=jax.tree_util.keystr(path))


def test_step_gradient_matches_direct_full_batch_reference(model, full_batch_run):
  delta, metrics, _ = full_batch_run
  grads, loss, ref_metrics = reference_grad_and_loss(model)
  scale = max(np.abs(g).max() for g in jax.tree.leaves(grads))
  assert scale > 1e-3
  assert_trees_close(jax.tree.map(lambda d: -d, delta), grads, atol=2e-5 * scale, rtol=1e-3)
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
  for k in ("pg_loss", "kl_loss", "entropy", "tis_weight_mean", "logp_gap_max"):
    np.testing.assert_allclose(metrics[k], float(ref_metrics[k]), rtol=1e-5, err_msg=k)
  assert metrics["kl_ref"] > 0 and metrics["skipped"] == 0
  assert metrics["zero_var_frac"] == 0.5 and metrics["tokens"] == 35
  # The ratio metrics are identically 0 on-policy (one update per batch): not reported.
  assert all(float(ref_metrics[k]) == 0.0 for k in RATIO_METRICS)
  assert not set(RATIO_METRICS) & set(metrics)


def test_sampler_ratio_step_matches_direct_reference(model):
  """old_logp="sampler": the ratio is pi / mu against Batch.sampler_logp_BxT (far from
  the model's log-probs here, so the low clip binds), and the ratio metrics are reported."""
  step = make_train_step(model, LOSS, SGD_LIKE, batch_size=B, group_size=N,
                         micro_batch_size=4, old_logp="sampler", donate=False)
  delta, metrics, _ = run(model, micro=4, step=step)
  grads, loss, ref_metrics = reference_grad_and_loss(model, old_is_sampler=True)
  scale = max(np.abs(g).max() for g in jax.tree.leaves(grads))
  assert scale > 1e-3
  assert_trees_close(jax.tree.map(lambda d: -d, delta), grads, atol=2e-5 * scale, rtol=1e-3)
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
  for k in ("pg_loss", "tis_weight_mean", "logp_gap_max", *RATIO_METRICS):
    np.testing.assert_allclose(metrics[k], float(ref_metrics[k]), rtol=1e-5, err_msg=k)
  assert metrics["clip_frac_low"] > 0  # mu far above pi on some A < 0 tokens
  _, current, _ = run(model, micro=4, step=make_train_step(
      model, LOSS, SGD_LIKE, batch_size=B, group_size=N, micro_batch_size=4, donate=False))
  assert abs(current["loss"] - metrics["loss"]) > 1e-4
  with pytest.raises(ValueError, match=r"old_logp='behaviour'; choose from"):
    make_train_step(model, LOSS, SGD_LIKE, batch_size=B, group_size=N, old_logp="behaviour")


def test_micro_batch_invariance(model, full_batch_run):
  """micro 2 (with a chunked lm head) vs micro 8; micro 4 is covered sharded below."""
  delta8, m8, _ = full_batch_run
  delta2, m2, _ = run(model, micro=2, chunk=4)
  assert_trees_close(delta2, delta8, atol=1e-5)
  for k in m8:
    np.testing.assert_allclose(m2[k], m8[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_sharded_8_devices_equals_single_device(model, full_batch_run):
  assert jax.device_count() == 8, "tests/conftest.py should give 8 fake CPU devices"
  mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
  delta8, m8, _ = full_batch_run
  # A batch committed to one device (of the mesh) moves to the step's placement.
  batch = jax.device_put(make_batch(), jax.devices()[5])
  delta, m, new = run(model, micro=4, mesh=mesh, batch=batch)
  assert_trees_close(delta, delta8, atol=1e-5)
  for k in m8:
    np.testing.assert_allclose(m[k], m8[k], rtol=1e-5, atol=1e-6, err_msg=k)
  q = jax.tree.leaves(new.params["layers"][0]["attn"]["q_kernel"])[0]
  assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)


# One step of the Easy-set recipe on a fixed model (nnx.Rngs(0)) and batch. Recorded
# once on jax 0.10.2 / flax 0.12.8, CPU; update these only for an intended change.
REGRESSION = {"loss": 0.01159990206360817, "grad_norm": 0.27305349707603455,
              "update_norm": 0.0012724577024567623, "entropy": 4.149089336395264}


def test_one_step_regression():
  model = Decoder(tiny_config(), rngs=nnx.Rngs(0))
  loss_cfg = LossConfig(kind="ppo_clip", clip_high=0.28, agg="token_mean", kl_coef=1e-3,
                        entropy_coef=1e-3, tis_cap=2.0)
  optim_cfg = OptimConfig(lr_base=1e-3, batch_base=1024)
  step = make_train_step(model, loss_cfg, optim_cfg, batch_size=B, group_size=N,
                         micro_batch_size=4)
  state = init_train_state(model, loss_cfg, optim_cfg, batch_size=B)
  before = jax.tree.map(np.asarray, state.params)
  new, metrics = step(state, make_batch(seed=3, rewards=(1, 0, 1, 0, 0, 0, 1, 0)))
  delta = [np.asarray(a, np.float64) - b
           for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(before))]
  got = {k: float(metrics[k]) for k in ("loss", "grad_norm", "entropy")}
  got["update_norm"] = float(np.sqrt(sum((d ** 2).sum() for d in delta)))
  print("regression numbers:", repr(got))
  assert int(new.step) == 1
  np.testing.assert_allclose(got["update_norm"], float(metrics["update_norm"]), rtol=1e-4)
  for k, v in REGRESSION.items():
    np.testing.assert_allclose(got[k], v, rtol=1e-5, err_msg=k)


def test_non_finite_leaves_state_unchanged(model, step8):
  step = step8
  state = perturbed_state(model)
  batch = make_batch()
  bad = batch.replace(rewards_B=batch.rewards_B.at[0].set(jnp.nan))
  with pytest.raises(ValueError, match="rewards_B has 1 non-finite"):
    step(state, bad)  # the host-side check stops it before any update
  new, metrics = step.jitted(state, bad)  # bypass the check: the step must skip
  assert float(metrics["skipped"]) == 1.0 and float(metrics["update_norm"]) == 0.0
  assert int(new.step) == int(state.step) == 0
  assert_trees_close(jax.tree.map(np.asarray, new), jax.tree.map(np.asarray, state), atol=0)
  new, metrics = step.jitted(state, batch)  # the same state still updates normally
  assert float(metrics["skipped"]) == 0.0 and int(new.step) == 1


def test_decoupled_baseline_reaches_the_step(model, step8):
  # n_est = 2n baseline rollouts per prompt; the n trained ones are among them.
  batch = make_batch()
  r = np.asarray(batch.rewards_B).reshape(-1, N)
  base = np.concatenate([r, [[0, 0, 1, 0], [0, 0, 0, 0]]], axis=1)  # [Bp, 2N]
  adv = (r - base.mean(1, keepdims=True)) / (base.std(1, ddof=1, keepdims=True) + 1e-6)
  batch = batch.replace(baseline_rewards_B=jnp.asarray(base.ravel(), jnp.float32))
  _, metrics = step8(perturbed_state(model), batch)
  np.testing.assert_allclose(float(metrics["adv_abs_mean"]), np.abs(adv).mean(), rtol=1e-6)
  assert float(metrics["zero_var_frac"]) == 0.0  # group 2 is all-1 but its baseline is not


def test_state_layout(model):
  state = init_train_state(model, LossConfig(kl_coef=0.0), OptimConfig(), batch_size=B)
  assert state.ref_params is None and int(state.step) == 0
  with_ref = init_train_state(model, LOSS, OptimConfig(), batch_size=B)
  assert with_ref.ref_params is not None
  # the state owns its buffers: donating it must not delete the model's arrays
  leaf = jax.tree.leaves(with_ref.params)[0]
  assert leaf.unsafe_buffer_pointer() != jax.tree.leaves(nnx.state(model, nnx.Param))[
      0].unsafe_buffer_pointer()


def _bad(batch, **changes):
  return dataclasses.replace(batch, **changes)


@pytest.mark.parametrize("mutate, match", [
    (lambda b: _bad(b, loss_mask_BxT=b.loss_mask_BxT[:, :-1]), "loss_mask_BxT has shape"),
    (lambda b: _bad(b, rewards_B=b.rewards_B[:6]), "rewards_B has shape"),
    (lambda b: _bad(b, sampler_logp_BxT=b.sampler_logp_BxT.at[2, 7].set(-jnp.inf)),
     "sampler_logp_BxT has 1 non-finite.*index \\(2, 7\\)"),
    (lambda b: _bad(b, rewards_B=b.rewards_B.at[3].set(jnp.inf)), "rewards_B has 1 non-finite"),
    # A negative log-likelihood given for the log-probs.
    (lambda b: _bad(b, sampler_logp_BxT=-b.sampler_logp_BxT),
     r"sampler_logp_BxT is [0-9.]+ > 0 at row 0, column 5 \(\d+ trained tokens\).*"
     "negative log-likelihood"),
    (lambda b: _bad(b, loss_mask_BxT=b.loss_mask_BxT.at[0, 0].set(1.0)), "\\[:, 0\\] must be 0"),
    # Row 2 without its prompt: its first real token, at PROMPT, is trained.
    (lambda b: _bad(b, attention_mask_BxT=b.attention_mask_BxT.at[2, :PROMPT].set(0)),
     "1 on the first real token of row 2"),
    # Row 1's prompt right-padded: its first completion token follows a pad.
    (lambda b: _bad(b, attention_mask_BxT=b.attention_mask_BxT.at[1, PROMPT - 1].set(0)),
     "1 at row 1, column 5, after a pad \\(attention_mask_BxT is 0 at column 4\\)"),
    (lambda b: _bad(b, attention_mask_BxT=b.attention_mask_BxT.at[0, 6].set(0)),
     "loss_mask_BxT is 1 where attention_mask_BxT is 0"),
    (lambda b: _bad(b, input_ids_BxT=b.input_ids_BxT.astype(jnp.float32)), "integer"),
    (lambda b: _bad(b, input_ids_BxT=b.input_ids_BxT.at[1, 9].set(64)),
     "outside \\[0, vocab_size=64\\), 1 in all, the first 64 at row 1, column 9"),
    (lambda b: _bad(b, input_ids_BxT=b.input_ids_BxT.at[5, 0].set(-1)),
     "1 in all, the first -1 at row 5, column 0"),
    (lambda b: _bad(b, baseline_rewards_B=jnp.zeros(6)), "baseline_rewards_B has shape"),
])
def test_bad_batch_raises_before_update(model, mutate, match):
  step = make_train_step(model, LOSS, SGD_LIKE, batch_size=B, group_size=N,
                         micro_batch_size=4)
  with pytest.raises(ValueError, match=match):
    step(None, mutate(make_batch()))  # raises on the host; the state is never touched


def test_bad_sizes():
  model = Decoder(tiny_config(num_layers=1), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="group_size=3 does not divide batch_size=8"):
    make_train_step(model, LOSS, SGD_LIKE, batch_size=8, group_size=3)
  with pytest.raises(ValueError, match="group_size=0 does not divide batch_size=8"):
    make_train_step(model, LOSS, SGD_LIKE, batch_size=8, group_size=0)
  with pytest.raises(ValueError, match="micro_batch_size=3 does not divide"):
    make_train_step(model, LOSS, SGD_LIKE, batch_size=8, group_size=4, micro_batch_size=3)
  with pytest.raises(ValueError, match="logits_chunk=0"):
    make_train_step(model, LOSS, SGD_LIKE, batch_size=8, group_size=4, logits_chunk=0)
  mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
  with pytest.raises(ValueError, match="batch shards"):
    make_train_step(model, LOSS, SGD_LIKE, batch_size=8, group_size=4, micro_batch_size=2,
                    mesh=mesh)
  step = make_train_step(model, LOSS, SGD_LIKE, batch_size=16, group_size=4)
  with pytest.raises(ValueError, match="built for batch_size=16"):
    step(None, make_batch())


def test_batch_of_python_lists_gives_the_array_result(model, step8):
  """A notebook's batch: fields as (nested) lists, rewards as ints."""
  batch = make_batch()
  as_lists = Batch(**{f.name: np.asarray(getattr(batch, f.name)).tolist()
                      for f in dataclasses.fields(Batch) if f.name != "baseline_rewards_B"})
  as_lists = as_lists.replace(rewards_B=[int(r) for r in as_lists.rewards_B])
  _, want = step8(perturbed_state(model), batch)
  _, got = step8(perturbed_state(model), as_lists)
  for k in want:
    np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-6, err_msg=k)
  ragged = as_lists.replace(loss_mask_BxT=[row[:-1] for row in as_lists.loss_mask_BxT[:2]]
                            + as_lists.loss_mask_BxT[2:])
  with pytest.raises(ValueError, match="Batch.loss_mask_BxT is not an array: .*inhomogeneous"):
    step8(None, ragged)


def test_state_built_for_another_step_is_named(model):
  step = make_train_step(model, LOSS, SGD_LIKE, batch_size=B, group_size=N)
  batch = make_batch()
  no_ref = init_train_state(model, dataclasses.replace(LOSS, kl_coef=0.0), SGD_LIKE,
                            batch_size=B)
  with pytest.raises(ValueError, match=r"lacks state\.ref_params\['embed'\] .*"
                                       r"only when LossConfig\.kl_coef > 0"):
    step(no_ref, batch)
  clipped = init_train_state(model, LOSS, OptimConfig(), batch_size=B)  # one more transform
  with pytest.raises(ValueError, match=r"does not match the step: it lacks state\.opt_state"):
    step(clipped, batch)
  narrow = Decoder(tiny_config(hidden_size=16, intermediate_size=32), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"state\.params\['embed'\] of float32\[64, 16\] "
                                       r"where the step expects float32\[64, 32\]"):
    step(init_train_state(narrow, LOSS, SGD_LIKE, batch_size=B), batch)
  with pytest.raises(ValueError, match=r"the state \(NoneType\) does not match"):
    step(None, batch)


def test_update_to_non_finite_weights_is_skipped(model):
  # Finite loss and gradient, but a learning rate that overflows float32: the
  # update would write inf/NaN into the weights. It must count as skipped.
  huge = dataclasses.replace(SGD_LIKE, lr_base=1e39, eps=1e-8)
  step = make_train_step(model, LOSS, huge, batch_size=B, group_size=N,
                         micro_batch_size=8, donate=False)
  state = perturbed_state(model)
  new, metrics = step(state, make_batch())
  assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
  assert float(metrics["skipped"]) == 1.0 and int(new.step) == 0
  assert_trees_close(jax.tree.map(np.asarray, new), jax.tree.map(np.asarray, state), atol=0)


def test_a_new_batch_width_compiles_again_with_a_warning(model, step8):
  """Right-padding a batch changes its width T (one more compile, said once per
  width) and nothing else: the same loss and gradient."""
  batch = make_batch()
  wide = Batch(**{f.name: (jnp.pad(getattr(batch, f.name), ((0, 0), (0, 4)))
                           if f.name.endswith("BxT") else getattr(batch, f.name))
                  for f in dataclasses.fields(Batch)})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    step8(perturbed_state(model), batch)
    step8(perturbed_state(model), batch)
  with pytest.warns(UserWarning, match=r"compiles again for a batch of width T=16 "
                                       r"\(compiled so far for T in \[12\]\)"):
    _, got = step8(perturbed_state(model), wide)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _, got_again = step8(perturbed_state(model), wide)
  _, want = step8(perturbed_state(model), batch)
  for k in ("loss", "grad_norm", "tokens"):
    np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-5, err_msg=k)
    assert float(got_again[k]) == float(got[k]), k
