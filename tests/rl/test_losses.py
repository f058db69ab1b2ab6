"""Policy losses against an independent NumPy reference written from the formulas.

The reference loops over sequences and tokens; it shares no code with
isojax.rl.losses. Inputs are random, with masks that include empty rows and a
zero-variance group (all advantages 0).
"""

import dataclasses
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.rl.losses import LossConfig, policy_loss, token_weights, weighted_policy_loss

KINDS = ("ppo_clip", "cispo", "cispo_two_sided", "gspo")
AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "prompt_mean")


# ------------------------------------------------------------------ reference
def np_kl(est, lp, rf):
  if est == "k1":
    return lp - rf
  if est == "k2":
    return 0.5 * (lp - rf) ** 2
  d = np.clip(rf - lp, -20.0, 20.0)  # veRL's low_var_kl clamps
  return np.minimum(np.exp(d) - d - 1.0, 10.0)


def np_reference(logp, old, adv, mask, c: LossConfig, n, sampler=None, ref=None, ent=None,
                 logp_sg=None):
  """Returns (loss, metrics). ``logp_sg`` is where stop-gradient quantities
  (the CISPO weight) are evaluated; defaults to ``logp``."""
  logp_sg = logp if logp_sg is None else logp_sg
  B, T = logp.shape
  lo, hi = 1 - c.clip_low, 1 + c.clip_high
  zero_group = [bool(np.all(adv[g * n:(g + 1) * n] == 0)) for g in range(B // n)]
  tok = np.zeros((B, T))
  frac = {"low": 0, "high": 0, "dual": 0}
  tis_w, gaps, akl = [], [], []
  for b in range(B):
    a = adv[b]
    length = mask[b].sum()
    s = None
    if c.kind == "gspo":
      s = np.exp(sum((logp[b, t] - old[b, t]) for t in range(T) if mask[b, t])
                 / max(length, 1))
    for t in range(T):
      if not mask[b, t]:
        continue
      akl.append(np.exp(logp[b, t] - old[b, t]) - 1 - (logp[b, t] - old[b, t]))
      if c.kind.startswith("cispo"):
        # MiniMax-M1 / ScaleRL: IS weight truncated from above; "cispo_two_sided"
        # also from below.
        r = np.exp(logp_sg[b, t] - old[b, t])
        two_sided = c.kind == "cispo_two_sided"
        weight = min(max(r, lo) if two_sided else r, hi)
        term = -weight * a * logp[b, t]
        frac["low"] += two_sided and r < lo
        frac["high"] += r > hi
      else:
        r = np.exp(logp[b, t] - old[b, t]) if c.kind == "ppo_clip" else s
        term = max(-a * r, -a * min(max(r, lo), hi))
        frac["low"] += (a < 0) and (r < lo)
        frac["high"] += (a > 0) and (r > hi)
        if c.clip_dual is not None and a < 0:
          frac["dual"] += term > -c.clip_dual * a
          term = min(term, -c.clip_dual * a)
      if sampler is not None:
        w = np.exp(old[b, t] - sampler[b, t])
        gaps.append(abs(old[b, t] - sampler[b, t]))
        if c.tis_cap is not None:
          tis_w.append((min(w, c.tis_cap), w > c.tis_cap))
          term *= min(w, c.tis_cap)
        else:
          tis_w.append((w, False))
      tok[b, t] = term

  def aggregate(x, keep_group):
    rows = [b for b in range(B) if keep_group[b // n]]
    if c.agg == "token_mean":
      vals = [x[b, t] for b in rows for t in range(T) if mask[b, t]]
      return sum(vals) / len(vals) if vals else 0.0
    if c.agg in ("seq_mean_token_mean", "seq_mean_token_sum"):
      per = []
      for b in rows:
        vals = [x[b, t] for t in range(T) if mask[b, t]]
        if vals:
          per.append(np.mean(vals) if c.agg == "seq_mean_token_mean" else sum(vals))
      return np.mean(per) if per else 0.0
    per = []
    for g in range(B // n):
      if not keep_group[g]:
        continue
      vals = [x[b, t] for b in range(g * n, (g + 1) * n) for t in range(T) if mask[b, t]]
      if vals:
        per.append(np.mean(vals))
    return np.mean(per) if per else 0.0

  everyone = [True] * (B // n)
  nonzero = [not z for z in zero_group]
  pg_keep = nonzero if c.zero_var_filter == "all" else everyone
  reg_keep = nonzero if c.zero_var_filter in ("all", "regularizers") else everyone
  ntok = mask.sum()
  m = {"pg_loss": aggregate(tok, pg_keep), "approx_kl_old": sum(akl) / ntok,
       "zero_var_frac": np.mean(zero_group)}
  m.update({f"clip_frac_{k}": v / ntok for k, v in frac.items()})
  loss = m["pg_loss"]
  if ref is not None:
    kl = np_kl(c.kl_estimator, logp, ref)
    m["kl_loss"] = aggregate(kl, reg_keep)
    m["kl_ref"] = (kl * mask).sum() / ntok
    loss += c.kl_coef * m["kl_loss"]
  if ent is not None:
    m["entropy_term"] = aggregate(ent, reg_keep)
    m["entropy"] = (ent * mask).sum() / ntok
    loss -= c.entropy_coef * m["entropy_term"]
  if sampler is not None:
    m["tis_weight_mean"] = np.mean([w for w, _ in tis_w])
    m["tis_weight_max"] = max(w for w, _ in tis_w)
    m["tis_frac_truncated"] = np.mean([tr for _, tr in tis_w])
    m["logp_gap_mean"] = np.mean(gaps)
    m["logp_gap_max"] = max(gaps)
  m["loss"] = loss
  return loss, m


def make_inputs(seed, B=8, T=7, n=2, dtype=np.float32):
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.05, 3.0, (B, T))
  old = logp + 0.5 * rng.normal(size=(B, T))
  sampler = old + 0.3 * rng.normal(size=(B, T))
  ref = logp + 0.4 * rng.normal(size=(B, T))
  ent = rng.uniform(0.0, 2.0, (B, T))
  adv = rng.normal(size=B)
  adv[n:2 * n] = 0.0  # one zero-variance group
  mask = (rng.uniform(size=(B, T)) < 0.7).astype(dtype)
  mask[3] = 0.0  # an empty sequence
  mask[:, 0] = 0.0
  # garbage on untrained positions must not leak into anything
  logp = np.where(mask > 0, logp, -np.inf)
  return {k: v.astype(dtype) for k, v in dict(logp=logp, old=old, sampler=sampler, ref=ref,
                                               ent=ent, adv=adv, mask=mask).items()}


def zero_var_flags(x, n):
  """The inputs' zero-variance groups: those make_inputs gave all-zero advantages."""
  return np.all(x["adv"].reshape(-1, n) == 0, axis=1)


def run_jax(x, cfg, n, with_extras):
  kw = dict(sampler_logp_BxT=x["sampler"], ref_logp_BxT=x["ref"], entropy_BxT=x["ent"]) \
      if with_extras else {}
  loss, m = policy_loss(x["logp"], x["old"], x["adv"], x["mask"], cfg, group_size=n,
                        zero_var_Bp=zero_var_flags(x, n), **kw)
  return float(loss), {k: float(v) for k, v in m.items()}


def run_ref(x, cfg, n, with_extras):
  x64 = {k: v.astype(np.float64) for k, v in x.items()}
  x64["logp"] = np.where(x["mask"] > 0, x64["logp"], 0.0)
  kw = dict(sampler=x64["sampler"], ref=x64["ref"], ent=x64["ent"]) if with_extras else {}
  return np_reference(x64["logp"], x64["old"], x64["adv"], x64["mask"], cfg, n, **kw)


def check(x, cfg, n, with_extras):
  loss, m = run_jax(x, cfg, n, with_extras)
  rloss, rm = run_ref(x, cfg, n, with_extras)
  assert set(m) == set(rm), set(m) ^ set(rm)
  np.testing.assert_allclose(loss, rloss, rtol=2e-5, atol=1e-6)
  for k in rm:
    np.testing.assert_allclose(m[k], rm[k], rtol=2e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("kind, agg", list(itertools.product(KINDS, AGGS)))
def test_pg_loss_matches_reference(kind, agg):
  cfg = LossConfig(kind=kind, agg=agg, clip_low=0.2, clip_high=0.28)
  check(make_inputs(1), cfg, 2, with_extras=False)


@pytest.mark.parametrize("kind, agg, zv", list(itertools.product(
    KINDS, AGGS, ("off", "all", "regularizers"))))
def test_full_loss_matches_reference(kind, agg, zv):
  cfg = LossConfig(kind=kind, agg=agg, clip_low=0.2, clip_high=0.28, tis_cap=1.5,
                   kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01, zero_var_filter=zv,
                   clip_dual=None if kind.startswith("cispo") else 1.6)
  check(make_inputs(2, B=12, n=3), cfg, 3, with_extras=True)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators(est):
  cfg = LossConfig(kl_coef=0.3, kl_estimator=est)
  check(make_inputs(3), cfg, 2, with_extras=True)


def test_k3_is_clamped_so_one_far_token_cannot_take_the_gradient():
  x = make_inputs(3)
  b, t = np.argwhere(x["mask"] > 0)[0]  # a trained token
  x["ref"] = x["logp"].copy()
  x["ref"][b, t] = x["logp"][b, t] + 12.0  # pi = e^-12 pi_ref there, pi_ref elsewhere
  cfg = LossConfig(kl_coef=1e-3, kl_estimator="k3", agg="token_mean")
  check(x, cfg, 2, with_extras=True)
  kl_ref = lambda lp: policy_loss(lp, x["old"], x["adv"], x["mask"], cfg, group_size=2,  # noqa: E731
                                  ref_logp_BxT=x["ref"])[1]["kl_ref"]
  assert float(kl_ref(jnp.asarray(x["logp"]))) == pytest.approx(10.0 / x["mask"].sum())
  # Above the clamp the token's estimate is constant: it adds no gradient.
  assert float(jax.grad(kl_ref)(jnp.asarray(x["logp"]))[b, t]) == 0.0


def test_cispo_unbounded_below_and_no_tis():
  cfg = LossConfig(kind="cispo", clip_low=0.2, clip_high=0.1, tis_cap=None)
  check(make_inputs(4), cfg, 4, with_extras=True)


def _grad_logp(x, cfg, old):
  f = lambda lp: policy_loss(lp, old, x["adv"], x["mask"], cfg, group_size=2)[0]  # noqa: E731
  return np.asarray(jax.grad(f)(jnp.asarray(x["logp"])))


def test_cispo_weight_has_no_floor_on_a_stale_batch():
  """On a stale batch (old_logp != logp) CISPO's weight min(r, 1 + eps_high) keeps
  ratios below 1 - clip_low, where the two-sided form floors them: the gradients
  differ exactly there, by (1 - clip_low - r) * A / tokens, as NumPy computes it."""
  x = make_inputs(11)
  x["logp"] = np.where(x["mask"] > 0, x["logp"], -1.0)
  one, two = (LossConfig(kind=k, clip_low=0.2, clip_high=0.28, agg="token_mean")
              for k in ("cispo", "cispo_two_sided"))
  r = np.exp(x["logp"].astype(np.float64) - x["old"])
  on = x["mask"] > 0
  floored = on & (r < 0.8)
  assert floored.sum() >= 5 and (on & (r > 1.28)).sum() >= 5  # both clips are exercised
  g1, g2 = _grad_logp(x, one, x["old"]), _grad_logp(x, two, x["old"])
  ntok = x["mask"].sum()
  adv_BxT = np.broadcast_to(x["adv"][:, None], r.shape)
  want1 = np.where(on, -np.minimum(r, 1.28) * adv_BxT / ntok, 0.0)
  want2 = np.where(on, -np.clip(r, 0.8, 1.28) * adv_BxT / ntok, 0.0)
  np.testing.assert_allclose(g1, want1, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(g2, want2, rtol=1e-5, atol=1e-7)
  differs = np.abs(g1 - g2) > 1e-7
  assert np.array_equal(differs, floored & (adv_BxT != 0))
  _, m1 = run_jax(x, one, 2, False)
  assert m1["clip_frac_low"] == 0.0 and m1["clip_frac_high"] > 0


@pytest.mark.parametrize("agg", AGGS)
def test_on_policy_cispo_and_ppo_clip_give_the_same_gradient(agg):
  """One update per batch: old_logp == logp, ratio 1, no clip binds."""
  x = make_inputs(12)
  x["logp"] = np.where(x["mask"] > 0, x["logp"], -1.0)
  grads = [_grad_logp(x, LossConfig(kind=k, agg=agg, clip_low=0.2, clip_high=0.28),
                      jnp.asarray(x["logp"]))
           for k in ("ppo_clip", "cispo", "cispo_two_sided")]
  assert np.abs(grads[0]).max() > 1e-3
  np.testing.assert_allclose(grads[1], grads[0], rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(grads[2], grads[0], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("kind, dual", [("ppo_clip", None), ("ppo_clip", 3.0),
                                        ("gspo", 3.0)])
def test_a_clipped_token_whose_ratio_overflows_leaves_the_gradient_finite(kind, dual):
  """Stale tokens whose ratio pi / mu overflows float32 (log-ratio 300: GSPO's mean
  over 3 tokens too) where a clip binds (A > 0; A < 0 under the dual clip) or
  A = 0: their loss is a constant and they have no gradient, exactly as at a
  merely large ratio (log-ratio 5). Before, exp's inf met the zero cotangent as
  0 * inf = NaN and the update was skipped."""
  logp = jnp.asarray([[0.0, -1.0, -2.0, -0.5]] * 3)
  mask = jnp.asarray([[0.0, 1.0, 1.0, 1.0]] * 3)
  # A < 0 only under the dual clip: without it that loss is +inf, rightly skipped.
  adv = jnp.asarray([1.0, 0.0 if dual is None else -1.0, 0.0])
  cfg = LossConfig(kind=kind, clip_dual=dual)

  def value_and_grad(gap):  # the sampler's log-prob of token 2 lies `gap` below pi's
    sampler = jnp.asarray([[0.0, -1.1, -2.0 - gap, -0.4]] * 3)
    return jax.value_and_grad(lambda lp: policy_loss(lp, None, adv, mask, cfg,
                                                     sampler_logp_BxT=sampler)[0])(logp)

  (loss, grad), (want_loss, want_grad) = value_and_grad(300.0), value_and_grad(5.0)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("clips", [dict(clip_low=0.0), dict(clip_high=0.0),
                                   dict(clip_low=0.0, clip_high=0.0)])
@pytest.mark.parametrize("kind", ["ppo_clip", "gspo"])
def test_a_ratio_on_a_clip_bound_keeps_the_whole_gradient(kind, clips):
  """On-policy the ratio is exactly 1, on a zero clip's bound: PPO's gradient there
  is the unclipped one (min/max would split it at the tie: 0.75 of it)."""
  x = make_inputs(13)
  x["logp"] = np.where(x["mask"] > 0, x["logp"], -1.0)
  agg = "seq_mean_token_mean"  # where GSPO's sequence ratio is exact
  got = _grad_logp(x, LossConfig(kind=kind, agg=agg, **clips), jnp.asarray(x["logp"]))
  want = _grad_logp(x, LossConfig(kind="cispo", agg=agg), jnp.asarray(x["logp"]))
  assert np.abs(want).max() > 1e-3
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


def test_zero_variance_filter_all_changes_denominator():
  # pg terms of a zero-variance group are 0 anyway; "all" removes its tokens
  # from the token count, so the loss scales by total/kept tokens.
  x = make_inputs(5)
  off, _ = run_jax(x, LossConfig(zero_var_filter="off"), 2, False)
  on, _ = run_jax(x, LossConfig(zero_var_filter="all"), 2, False)
  m = x["mask"]
  kept = m.sum() - m[2:4].sum()
  np.testing.assert_allclose(on, off * m.sum() / kept, rtol=1e-5)


def test_micro_batch_slices_sum_to_whole_batch():
  x = make_inputs(6, B=12, n=3)
  for agg in AGGS:
    cfg = LossConfig(agg=agg, kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0,
                     zero_var_filter="regularizers")
    full, fm = run_jax(x, cfg, 3, True)
    w = token_weights(x["mask"], cfg, group_size=3, zero_var_Bp=zero_var_flags(x, 3))
    total, parts = 0.0, []
    for rows in (slice(0, 4), slice(4, 8), slice(8, 12)):  # 4 rows: cuts groups
      l, m = weighted_policy_loss(
          x["logp"][rows], x["old"][rows], x["adv"][rows], x["mask"][rows],
          type(w)(*(a[rows] for a in w)), cfg, sampler_logp_BxT=x["sampler"][rows],
          ref_logp_BxT=x["ref"][rows], entropy_BxT=x["ent"][rows])
      total += float(l)
      parts.append(m)
    np.testing.assert_allclose(total, full, rtol=1e-5)
    np.testing.assert_allclose(sum(float(p["entropy"]) for p in parts), fm["entropy"],
                               rtol=1e-5)
    np.testing.assert_allclose(max(float(p["tis_weight_max"]) for p in parts),
                               fm["tis_weight_max"], rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_matches_finite_differences(kind):
  """d loss / d logp in float64: jax.grad vs central differences of the NumPy
  reference (stop-gradient quantities held at the base point)."""
  cfg = LossConfig(kind=kind, agg="seq_mean_token_mean" if kind == "gspo" else "prompt_mean",
                   clip_low=0.2, clip_high=0.28, tis_cap=1.5, kl_coef=0.1,
                   entropy_coef=0.01, clip_dual=None if kind.startswith("cispo") else 1.6)
  x = make_inputs(7, B=4, T=5, n=2, dtype=np.float64)
  x["logp"] = np.where(x["mask"] > 0, x["logp"], -1.0)
  x["adv"][2:4] = [0.7, -1.2]
  n = 2
  with jax.enable_x64(True):
    def f(logp):
      return policy_loss(logp, jnp.asarray(x["old"]), jnp.asarray(x["adv"]),
                         jnp.asarray(x["mask"]), cfg, sampler_logp_BxT=jnp.asarray(x["sampler"]),
                         ref_logp_BxT=jnp.asarray(x["ref"]), entropy_BxT=jnp.asarray(x["ent"]),
                         group_size=n)[0]
    g = np.asarray(jax.grad(f)(jnp.asarray(x["logp"])))
    assert g.dtype == np.float64
  h = 1e-6
  fd = np.zeros_like(x["logp"])
  for b, t in itertools.product(*map(range, x["logp"].shape)):
    def at(delta):
      lp = x["logp"].copy()
      lp[b, t] += delta
      return np_reference(lp, x["old"], x["adv"], x["mask"], cfg, n, sampler=x["sampler"],
                          ref=x["ref"], ent=x["ent"], logp_sg=x["logp"])[0]
    fd[b, t] = (at(h) - at(-h)) / (2 * h)
  assert np.abs(fd).max() > 1e-3  # the check is not vacuous
  np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)
  assert np.all(g[x["mask"] == 0] == 0)


def test_entropy_gradient_is_minus_coef_times_weights():
  x = make_inputs(8)
  cfg = LossConfig(entropy_coef=0.3, agg="seq_mean_token_sum")
  g = jax.grad(lambda e: policy_loss(x["logp"], x["old"], x["adv"], x["mask"], cfg,
                                     entropy_BxT=e, group_size=2)[0])(jnp.asarray(x["ent"]))
  rows = (x["mask"].sum(1) > 0).sum()
  np.testing.assert_allclose(np.asarray(g), -0.3 * x["mask"] / rows, rtol=1e-6)


@pytest.mark.parametrize("kw, match", [
    (dict(kind="reinforce"), "LossConfig.kind"),
    (dict(agg="sum"), "LossConfig.agg"),
    (dict(kl_estimator="k4"), "LossConfig.kl_estimator"),
    (dict(zero_var_filter="pg"), "LossConfig.zero_var_filter"),
    (dict(clip_dual=0.5), "clip_dual"),
    (dict(kind="cispo", clip_dual=3.0), r"clip_dual=3.0 caps .* kind='cispo' has none"),
    (dict(kind="cispo_two_sided", clip_dual=3.0), "set clip_dual=None"),
    (dict(tis_cap=0.0), "tis_cap"),
    (dict(tis_cap=0.5), r"tis_cap=0.5 must be >= 1 or None"),
    (dict(clip_low=1.0), r"clip_low=1.0 must be < 1"),
    (dict(kl_coef=-1.0), "kl_coef"),
    (dict(kl_coef=float("inf")), r"kl_coef=inf must be finite"),
    (dict(entropy_coef=float("inf")), r"entropy_coef=inf must be finite"),
    (dict(adv_std_eps=float("inf")), r"adv_std_eps=inf must be finite"),
])
def test_bad_config(kw, match):
  with pytest.raises(ValueError, match=match):
    LossConfig(**kw)


def test_loss_config_from_config_reads_its_own_fields():
  """Item or attribute access; the source's other fields are not LossConfig's business."""
  fields = {f.name: getattr(LossConfig(), f.name) for f in dataclasses.fields(LossConfig)}
  want = LossConfig(kind="cispo", tis_cap=None, kl_coef=0.3, zero_var_filter="all")
  given = {**fields, **{k: getattr(want, k) for k in ("kind", "tis_cap", "kl_coef",
                                                       "zero_var_filter")}}
  assert LossConfig.from_config({**given, "lr_base": 1e-6, "micro_batch": 0}) == want
  assert LossConfig.from_config(types.SimpleNamespace(**given, n_est=0)) == want
  del given["agg"], given["clip_dual"]
  with pytest.raises(ValueError, match=r"config\.rl has no LossConfig field clip_dual, agg"):
    LossConfig.from_config(given, name="config.rl")
  with pytest.raises(ValueError, match="LossConfig.tis_cap=0"):
    LossConfig.from_config({**fields, "tis_cap": 0.0})
  # A bad value is named as the source's field, which is what the user set.
  with pytest.raises(ValueError, match=r"^config\.rl\.tis_cap=0\.0 must be >= 1"):
    LossConfig.from_config({**fields, "tis_cap": 0.0}, name="config.rl")
  with pytest.raises(ValueError, match=r"^config\.rl\.kind='bogus'; choose from"):
    LossConfig.from_config({**fields, "kind": "bogus"}, name="config.rl")


def test_clip_settings_away_from_the_defaults_are_refused_on_policy():
  LossConfig(kind="cispo", tis_cap=1.5, kl_coef=0.1).check_on_policy()
  for field, value in (("clip_low", 0.1), ("clip_high", 0.28), ("clip_dual", 3.0)):
    with pytest.raises(ValueError, match=rf"config\.rl\.{field}={value} \(default .*\) "
                                         "cannot affect this run.*on-policy"):
      LossConfig(**{field: value}).check_on_policy(name="config.rl")


def test_bad_inputs():
  x = make_inputs(9)
  with pytest.raises(ValueError, match="mask_BxT has shape"):
    policy_loss(x["logp"], x["old"], x["adv"], x["mask"][:, :3], LossConfig())
  with pytest.raises(ValueError, match="adv_B"):
    policy_loss(x["logp"], x["old"], x["adv"][:3], x["mask"], LossConfig())
  with pytest.raises(ValueError, match="ref_logp_BxT is None"):
    policy_loss(x["logp"], x["old"], x["adv"], x["mask"], LossConfig(kl_coef=0.1))
  with pytest.raises(ValueError, match="sampler_logp_BxT is None"):
    policy_loss(x["logp"], x["old"], x["adv"], x["mask"], LossConfig(tis_cap=2.0))
  with pytest.raises(ValueError, match="group_size"):
    policy_loss(x["logp"], x["old"], x["adv"], x["mask"], LossConfig(agg="prompt_mean"))
  with pytest.raises(ValueError, match="does not divide"):
    policy_loss(x["logp"], x["old"], x["adv"], x["mask"],
                dataclasses.replace(LossConfig(), zero_var_filter="all"), group_size=3)
  with pytest.raises(ValueError, match="needs group_size and zero_var_Bp"):
    policy_loss(x["logp"], x["old"], x["adv"], x["mask"],
                LossConfig(zero_var_filter="regularizers"), group_size=2)
  with pytest.raises(ValueError, match="zero_var_Bp has shape"):
    policy_loss(x["logp"], x["old"], x["adv"], x["mask"], LossConfig(), group_size=2,
                zero_var_Bp=np.zeros(3, bool))


@pytest.mark.parametrize("kind", KINDS)
def test_a_ratio_exactly_on_a_bound_is_not_counted_as_clipped(kind):
  """clip_frac_* count tokens whose clip changes the loss: a ratio exactly on its bound
  (r = 1 on-policy, zero clips) does not, nor does a TIS weight exactly at its cap
  (tis_cap = 1, the smallest allowed, with the sampler equal to pi_old)."""
  x = make_inputs(14)
  x["logp"] = np.where(x["mask"] > 0, x["logp"], -1.0)
  cfg = LossConfig(kind=kind, clip_low=0.0, clip_high=0.0, tis_cap=1.0)
  _, m = policy_loss(x["logp"], x["logp"], x["adv"], x["mask"], cfg, group_size=2,
                     sampler_logp_BxT=x["logp"])
  assert float(m["clip_frac_low"]) == 0.0 and float(m["clip_frac_high"]) == 0.0
  assert float(m["tis_frac_truncated"]) == 0.0
  assert float(m["tis_weight_mean"]) == pytest.approx(1.0)


def test_tis_weight_max_is_over_trained_tokens_only():
  """Padding carries no weight: when every trained token's weight pi_old / mu is below 1
  the reported max is the largest of them, not the 1 = exp(0) of untrained slots."""
  x = make_inputs(15)
  rng = np.random.default_rng(15)
  x["sampler"] = (x["old"] + rng.uniform(0.1, 1.0, x["old"].shape)).astype(np.float32)
  _, m = run_jax(x, LossConfig(), 2, True)
  on = x["mask"] > 0
  want = np.exp(x["old"][on].astype(np.float64) - x["sampler"][on]).max()
  assert want < 0.95
  assert m["tis_weight_max"] == pytest.approx(want, rel=1e-5)
