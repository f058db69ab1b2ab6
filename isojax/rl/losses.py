"""Policy-gradient losses of the GRPO family, with KL and entropy regularisers.

Every algorithmic choice is a small pure function in a table keyed by name:
``PG_LOSSES`` (ppo_clip / cispo / cispo_two_sided / gspo) and ``KL_ESTIMATORS``
(k1 / k2 / k3), both in ``isojax.rl.objectives``, and ``AGGREGATIONS`` (how
token terms are averaged, ``isojax.rl.aggregation``). ``LossConfig`` picks one
of each.

Aggregation weights (``isojax.rl.aggregation``) are computed once per batch so
that micro-batch losses add up to the batch loss. ``policy_loss`` is the
one-call form for a whole batch; the update step uses ``token_weights`` once and
``weighted_policy_loss`` per micro-batch.

Metrics: token fractions and means are over all trained tokens of the batch
(not filtered). ``clip_frac_low``/``_high``: tokens whose ratio lies below
1 - clip_low / above 1 + clip_high where that clip changes the loss (A < 0 /
A > 0 for ppo_clip and gspo; any A for the CISPO weight, which has no lower clip
unless two-sided, so its ``clip_frac_low`` is 0);
``clip_frac_dual``: tokens capped by the dual clip; ``approx_kl_old``: k3
estimate of KL(pi_old || pi); ``kl_ref``: the configured estimator's token mean
(``kl_loss``: as aggregated into the loss); ``entropy`` likewise
(``entropy_term``); ``tis_weight_*``: min(exp(old - sampler), tis_cap) (the
uncapped ratio when tis_cap is None); ``logp_gap_*``: |old - sampler| (with the
ratio taken against the sampler, ``old_logp_BxT=None``, both use the current
policy's log-probs in place of old).

Conventions: ``adv_B`` comes from ``compute_advantages``; which groups are
zero-variance comes in as flags from ``advantages.zero_variance_groups`` (the
rule's one definition). Rollouts are grouped contiguously by prompt
(``group_size`` rollouts each), as everywhere in isojax.
"""

import dataclasses

import jax
import jax.numpy as jnp

from isojax.rl.advantages import ESTIMATORS, zero_variance_groups
from isojax.rl.aggregation import AGGREGATIONS, ZERO_VAR_FILTERS, TokenWeights, token_weights
from isojax.rl.objectives import KL_ESTIMATORS, PG_LOSSES
from isojax.rl.value import VALUE_ESTIMATORS

__all__ = ["LossConfig", "TokenWeights", "AGGREGATIONS", "KL_ESTIMATORS",
           "PG_LOSSES", "MAX_METRICS", "RATIO_FIELDS", "RATIO_METRICS", "policy_loss",
           "token_weights", "weighted_policy_loss"]


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The RL objective. Frozen: derived values never get written back.

  Attributes:
    kind: "ppo_clip" (token-level clipped surrogate, GRPO/DAPO); "cispo"
      (MiniMax-M1 / ScaleRL: -sg(min(r, 1 + clip_high)) * A * log pi, the IS
      weight truncated from above only; clip_low is not used);
      "cispo_two_sided" (the same with the weight clipped to
      [1 - clip_low, 1 + clip_high], the general form of MiniMax-M1's
      equation, which MiniMax-M1 runs with no lower bound); or "gspo"
      (sequence-level geometric-mean ratio s_i, clipped; every token of a
      sequence carries s_i, so with agg="seq_mean_token_mean" this is exactly
      the GSPO objective, whose clip ranges are ~1e-3, not 0.2).
      With one on-policy update per batch (old_logp == logp: the update
      step's default ``old_logp="current"``) the ratio is 1, no clip binds,
      and CISPO and PPO-clip give the same gradient, -A * grad log pi per
      token (PPO-clip's grad of -r A is -A r grad log pi, and r = 1); they
      differ only on a stale batch (old_logp != logp: several updates per
      batch, or pi_old a lagging policy).
    clip_low, clip_high: ratio clipped to [1 - clip_low, 1 + clip_high]
      (clip-higher: clip_high > clip_low); "cispo" uses clip_high only.
    clip_dual: dual-clip constant c > 1 for negative advantages (the token
      loss is capped at -c*A); None disables it. ppo_clip and gspo only.
      The three clip settings act on the ratio pi / pi_old only, which is
      exactly 1 with one on-policy update per batch: they bind on stale
      batches (the update step's ``old_logp="sampler"``). An on-policy run
      refuses values other than the defaults (``check_on_policy``).
    agg: "token_mean" | "seq_mean_token_mean" | "seq_mean_token_sum" |
      "prompt_mean" (ScaleRL: mean over the tokens of each prompt's group,
      then mean over prompts).
    tis_cap: truncated importance sampling between sampler and trainer: the
      token loss is multiplied by min(exp(old_logp - sampler_logp), tis_cap)
      (no gradient); exactly 1 when the ratio is taken against the sampler
      itself (stale batches), whose clip then truncates instead. None
      disables it.
    kl_coef, kl_estimator: coefficient and estimator ("k1", "k2", "k3") of
      KL(pi || pi_ref) added to the loss; 0 disables the reference policy. As a
      loss, k1 does not pull towards pi_ref (its expected gradient is zero), k2
      descends KL(pi || pi_ref), k3 (the default, GRPO's) KL(pi_ref || pi)
      (`objectives.KL_ESTIMATORS`).
    entropy_coef: coefficient of the entropy bonus (subtracted from the loss).
    zero_var_filter: "off"; "all" drops groups with all-equal rewards from the
      whole loss (they leave the denominators too); "regularizers" drops them
      from the KL and entropy terms only (playbook Fig. 3).
    adv_estimator, adv_std_eps: how the update step turns rewards into
      advantages (see ``isojax.rl.advantages``; "gae" is the critic's, see
      ``isojax.rl.value`` and ``isojax.rl.ppo``).
  """

  kind: str = "ppo_clip"
  clip_low: float = 0.2
  clip_high: float = 0.2
  clip_dual: float | None = None
  agg: str = "token_mean"
  tis_cap: float | None = None
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0
  zero_var_filter: str = "off"
  adv_estimator: str = "grpo"
  adv_std_eps: float = 1e-6

  def __post_init__(self):
    for field, table in (("kind", PG_LOSSES), ("agg", AGGREGATIONS),
                         ("kl_estimator", KL_ESTIMATORS),
                         ("zero_var_filter", ZERO_VAR_FILTERS),
                         ("adv_estimator", {**ESTIMATORS, **VALUE_ESTIMATORS})):
      if getattr(self, field) not in table:
        raise ValueError(f"LossConfig.{field}={getattr(self, field)!r}; "
                         f"choose from {sorted(table)}")
    for field in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "adv_std_eps"):
      if not getattr(self, field) >= 0:
        raise ValueError(f"LossConfig.{field}={getattr(self, field)} must be >= 0")
    # clip_high and tis_cap may be inf (no cap); an infinite coefficient makes every
    # loss non-finite (each update skipped), an infinite eps every advantage 0.
    for field in ("kl_coef", "entropy_coef", "adv_std_eps"):
      if getattr(self, field) == float("inf"):
        raise ValueError(f"LossConfig.{field}={getattr(self, field)} must be finite")
    if self.clip_dual is not None and not self.clip_dual > 1:
      raise ValueError(f"LossConfig.clip_dual={self.clip_dual} must be > 1 or None")
    if self.clip_dual is not None and self.kind.startswith("cispo"):
      raise ValueError(f"LossConfig.clip_dual={self.clip_dual} caps the clipped surrogate "
                       f"of ppo_clip and gspo; kind={self.kind!r} has none (it would be "
                       f"ignored): set clip_dual=None")
    if not self.clip_low < 1:  # the ratio is positive: 1 - clip_low <= 0 clips nothing
      raise ValueError(f"LossConfig.clip_low={self.clip_low} must be < 1")
    if self.tis_cap is not None and not self.tis_cap >= 1:
      # TIS truncates large weights pi / mu; a cap below 1 would scale every token down.
      raise ValueError(f"LossConfig.tis_cap={self.tis_cap} must be >= 1 or None")

  @classmethod
  def from_config(cls, source, *, name: str | None = None) -> "LossConfig":
    """The LossConfig whose fields are read from ``source`` by name.

    Args:
      source: a mapping or an object with the fields as attributes (an
        ``ml_collections.ConfigDict`` is both; isojax.rl does not import it).
        Entries that are not LossConfig fields (learning rate, micro-batch, ...)
        are left to whoever else reads ``source``.
      name: what ``source`` is called in errors (e.g. "config.rl").

    Raises:
      ValueError: naming every LossConfig field that ``source`` lacks, or a
        bad value (``__post_init__``).
    """
    values, missing = {}, []
    for field in dataclasses.fields(cls):
      try:
        values[field.name] = _read_field(source, field.name)
      except LookupError:
        missing.append(field.name)
    if missing:
      raise ValueError(f"{name or type(source).__name__} has no LossConfig field "
                       f"{', '.join(missing)}; every LossConfig field must be set")
    try:
      return cls(**values)
    except ValueError as e:
      if name is None:
        raise
      # __post_init__ names the dataclass; the one who set the value knows `name`.
      raise ValueError(str(e).replace("LossConfig.", f"{name}.")) from None

  def check_on_policy(self, *, name: str = "LossConfig") -> None:
    """Raises ValueError naming a clip setting that differs from its default.

    With one on-policy update per batch the ratio pi / pi_old is exactly 1, so
    no clip (nor CISPO's weight cap, ``clip_high``) can bind: such a setting
    would change nothing, silently. ``name`` prefixes the field in the message.
    """
    defaults = LossConfig()
    for field in RATIO_FIELDS:
      value, default = getattr(self, field), getattr(defaults, field)
      if value != default:
        raise ValueError(
            f"{name}.{field}={value} (default {default}) cannot affect this run: every "
            "batch gets one on-policy update, so the ratio pi/pi_old is exactly 1 and no "
            "clip binds. It takes effect on stale batches (several updates per sampling "
            "policy); leave it at its default otherwise")

  @property
  def drops_zero_variance(self) -> bool:
    """Zero-variance groups leave the policy-gradient term (zero_var_filter="all"),
    so batch-level advantage statistics leave them out too
    (``compute_advantages(..., drop_zero_variance=...)``)."""
    return ZERO_VAR_FILTERS[self.zero_var_filter][0]

  def dropped_groups(self, rewards_B, *, group_size, baseline_rewards_B=None):
    """Per-group flag [Bp]: the group leaves the policy-gradient term entirely.

    Zero-variance groups (``advantages.zero_variance_groups``) when
    ``zero_var_filter="all"``, none otherwise. NumPy arrays in, NumPy out: the
    run counts the rollouts it paid for and did not train on.
    """
    zero_var_Bp = zero_variance_groups(rewards_B, group_size=group_size,
                                       baseline_rewards_B=baseline_rewards_B)
    return zero_var_Bp & self.drops_zero_variance


# LossConfig fields that act only through the ratio pi / pi_old.
RATIO_FIELDS = ("clip_low", "clip_high", "clip_dual")
# Metrics of the ratio pi / pi_old: identically 0 when old_logp is the same
# forward pass under stop_gradient (one on-policy update per batch).
RATIO_METRICS = (*(f.replace("clip_", "clip_frac_") for f in RATIO_FIELDS), "approx_kl_old")


def _read_field(source, name):
  """source[name], else source.name; LookupError when it has neither."""
  try:
    return source[name]
  except (KeyError, TypeError):
    if hasattr(source, name):
      return getattr(source, name)
    raise LookupError(name) from None


# Metrics combined across micro-batches by max; every other metric is a sum.
MAX_METRICS = ("tis_weight_max", "logp_gap_max")


def _wsum(w_BxT, x_BxT):
  return jnp.sum(w_BxT * x_BxT)


def _ratio_metrics(logp_BxT, old_logp_BxT, flags, on_BxT, diag_BxT):
  """clip_frac_* of the PG loss's clip flags and approx_kl_old (``RATIO_METRICS``)."""
  m = {name.replace("clip_", "clip_frac_"): _wsum(diag_BxT,
                                                  flags.get(name, jnp.zeros_like(on_BxT)))
       for name in RATIO_FIELDS}
  log_r_BxT = logp_BxT - old_logp_BxT
  m["approx_kl_old"] = jax.lax.stop_gradient(
      _wsum(diag_BxT, jnp.exp(log_r_BxT) - 1.0 - log_r_BxT))
  return m


def _sampler_metrics(trainer_logp_BxT, sampler_logp_BxT, on_BxT, diag_BxT, cfg):
  """TIS weights [B, T] (min(exp(trainer - sampler), tis_cap)) and the sampler metrics."""
  is_BxT = jnp.exp(trainer_logp_BxT - sampler_logp_BxT)
  gap_BxT = jnp.abs(trainer_logp_BxT - sampler_logp_BxT)
  tis_BxT = is_BxT if cfg.tis_cap is None else jnp.minimum(is_BxT, cfg.tis_cap)
  m = {"tis_weight_mean": _wsum(diag_BxT, tis_BxT),
       "tis_weight_max": jnp.max(jnp.where(on_BxT, tis_BxT, 0.0), initial=0.0),
       "tis_frac_truncated": (jnp.zeros(()) if cfg.tis_cap is None else
                              _wsum(diag_BxT, is_BxT > cfg.tis_cap)),
       "logp_gap_mean": _wsum(diag_BxT, gap_BxT),
       "logp_gap_max": jnp.max(jnp.where(on_BxT, gap_BxT, 0.0), initial=0.0)}
  return tis_BxT, m


def weighted_policy_loss(logp_BxT, old_logp_BxT, adv_B, mask_BxT, weights: TokenWeights,
                         cfg: LossConfig, *, sampler_logp_BxT=None, ref_logp_BxT=None,
                         entropy_BxT=None):
  """Loss and metrics with precomputed aggregation weights.

  Every returned quantity is a weighted *sum* over the given rows (or a max,
  for the names in ``MAX_METRICS``), so evaluating micro-batches with slices
  of whole-batch ``weights`` and adding the results gives the batch values.
  ``adv_B`` is one advantage per rollout [B] or per token [B, T].

  ``old_logp_BxT=None`` takes the ratio against the behaviour policy, the
  sampler's log-probs (a stale batch: pi_old is whatever sampled each token).
  The TIS factor min(exp(old - sampler), tis_cap) is then exactly 1 and is not
  applied: the whole trainer-vs-sampler weight pi / mu sits in the ratio, which
  the clip (CISPO: the cap) truncates. The tis_* and logp_gap_* metrics then
  compare the current policy with the sampler (drift since sampling plus
  numerics): ``tis_weight_*`` is min(pi / mu, tis_cap) in value.
  """
  sg = jax.lax.stop_gradient
  mask_BxT = jnp.asarray(mask_BxT, jnp.float32)
  on_BxT = mask_BxT > 0

  def clean(x_BxT):
    # Untrained positions may hold anything (padding); zero them before any
    # exp so neither the value nor the gradient can pick up inf/nan there.
    return None if x_BxT is None else jnp.where(on_BxT, x_BxT.astype(jnp.float32), 0.0)

  old_is_sampler = old_logp_BxT is None
  if old_is_sampler and sampler_logp_BxT is None:
    raise ValueError("old_logp_BxT is None (ratio against the sampler) but "
                     "sampler_logp_BxT is None")
  logp_BxT, old_logp_BxT = clean(logp_BxT), clean(old_logp_BxT)
  sampler_logp_BxT, ref_logp_BxT = clean(sampler_logp_BxT), clean(ref_logp_BxT)
  entropy_BxT = clean(entropy_BxT)
  old_logp_BxT = sg(sampler_logp_BxT if old_is_sampler else old_logp_BxT)
  # Per rollout [B] -> [B, 1] (group baselines), or per token [B, T] (a critic's GAE).
  adv_BxT = sg(jnp.asarray(adv_B, jnp.float32))
  adv_BxT = adv_BxT if adv_BxT.ndim == 2 else adv_BxT[:, None]

  pg_BxT, flags = PG_LOSSES[cfg.kind](logp_BxT, old_logp_BxT, adv_BxT, mask_BxT, cfg)
  m = _ratio_metrics(logp_BxT, old_logp_BxT, flags, on_BxT, weights.diag_BxT)
  if sampler_logp_BxT is not None:
    trainer_logp_BxT = sg(logp_BxT) if old_is_sampler else old_logp_BxT
    tis_BxT, sampler_m = _sampler_metrics(trainer_logp_BxT, sg(sampler_logp_BxT), on_BxT,
                                          weights.diag_BxT, cfg)
    m.update(sampler_m)
    if cfg.tis_cap is not None and not old_is_sampler:
      pg_BxT = pg_BxT * tis_BxT
  elif cfg.tis_cap is not None:
    raise ValueError("LossConfig.tis_cap is set but sampler_logp_BxT is None")

  m["pg_loss"] = _wsum(weights.pg_BxT, pg_BxT)
  loss = m["pg_loss"]

  if ref_logp_BxT is not None:
    kl_BxT = KL_ESTIMATORS[cfg.kl_estimator](logp_BxT, sg(ref_logp_BxT))
    m["kl_ref"] = sg(_wsum(weights.diag_BxT, kl_BxT))
    m["kl_loss"] = _wsum(weights.reg_BxT, kl_BxT)
    loss = loss + cfg.kl_coef * m["kl_loss"]
  elif cfg.kl_coef > 0:
    raise ValueError("LossConfig.kl_coef > 0 but ref_logp_BxT is None")

  if entropy_BxT is not None:
    m["entropy"] = sg(_wsum(weights.diag_BxT, entropy_BxT))
    m["entropy_term"] = _wsum(weights.reg_BxT, entropy_BxT)
    loss = loss - cfg.entropy_coef * m["entropy_term"]
  elif cfg.entropy_coef > 0:
    raise ValueError("LossConfig.entropy_coef > 0 but entropy_BxT is None")

  m["loss"] = loss
  return loss, {k: sg(v).astype(jnp.float32) for k, v in m.items()}


def policy_loss(logp_BxT, old_logp_BxT, adv_B, mask_BxT, cfg: LossConfig, *,
                sampler_logp_BxT=None, ref_logp_BxT=None, entropy_BxT=None,
                group_size=None, zero_var_Bp=None):
  """The RL loss of a whole batch.

  Args:
    logp_BxT: log pi(token) under the parameters being trained.
    old_logp_BxT: log pi_old(token), the policy the ratio is taken against
      (no gradient flows into it); None: the sampler's (``sampler_logp_BxT``,
      the behaviour policy of a stale batch; see ``weighted_policy_loss``).
    adv_B: per-sequence advantages (``compute_advantages``).
    mask_BxT: 1 on trained (completion) tokens, 0 elsewhere.
    cfg: ``LossConfig``.
    sampler_logp_BxT: sampler's log-probs; needed for ``tis_cap`` and for the
      TIS / sampler-trainer gap metrics.
    ref_logp_BxT: reference policy log-probs; needed when ``kl_coef > 0``.
    entropy_BxT: per-token policy entropy; needed when ``entropy_coef > 0``.
    group_size: rollouts per prompt (groups contiguous); needed for
      ``agg="prompt_mean"`` and ``zero_var_filter != "off"``.
    zero_var_Bp: bool per group (``advantages.zero_variance_groups`` of the
      rewards the advantages came from); needed for ``zero_var_filter !=
      "off"`` and the ``zero_var_frac`` metric.

  Returns:
    (scalar loss, dict of scalar metrics): loss, pg_loss, ``RATIO_METRICS``,
    kl_ref and kl_loss (with a reference), entropy and entropy_term (with
    entropies), tis_* and logp_gap_* (with sampler log-probs), zero_var_frac
    (with zero_var_Bp); see the module docstring.
  """
  shape = jnp.shape(logp_BxT)
  named = {"old_logp_BxT": old_logp_BxT, "mask_BxT": mask_BxT,
           "sampler_logp_BxT": sampler_logp_BxT, "ref_logp_BxT": ref_logp_BxT,
           "entropy_BxT": entropy_BxT}
  if len(shape) != 2:
    raise ValueError(f"logp_BxT must be 2-D [B, T], got shape {shape}")
  for name, x in named.items():
    if x is not None and jnp.shape(x) != shape:
      raise ValueError(f"{name} has shape {jnp.shape(x)}, expected {shape} like logp_BxT")
  if jnp.shape(adv_B) != shape[:1]:
    raise ValueError(f"adv_B has shape {jnp.shape(adv_B)}, expected ({shape[0]},)")
  if group_size is not None and shape[0] % group_size:
    raise ValueError(f"group_size={group_size} does not divide B={shape[0]}")
  if zero_var_Bp is not None and (group_size is None or
                                  jnp.shape(zero_var_Bp) != (shape[0] // group_size,)):
    raise ValueError(f"zero_var_Bp has shape {jnp.shape(zero_var_Bp)}, expected one flag "
                     f"per group of group_size={group_size} rows of B={shape[0]}")
  adv_B = jnp.asarray(adv_B, jnp.float32)
  weights = token_weights(mask_BxT, cfg, group_size=group_size, zero_var_Bp=zero_var_Bp)
  loss, metrics = weighted_policy_loss(
      logp_BxT, old_logp_BxT, adv_B, mask_BxT, weights, cfg,
      sampler_logp_BxT=sampler_logp_BxT, ref_logp_BxT=ref_logp_BxT,
      entropy_BxT=entropy_BxT)
  if zero_var_Bp is not None:
    metrics["zero_var_frac"] = jnp.mean(jnp.asarray(zero_var_Bp, jnp.float32))
  return loss, metrics
