"""Saturating fits: reward vs compute per n, and the compute-optimal n*(C) law.

Both laws are linear in two parameters and nonlinear in two. Each fit searches the two
nonlinear ones exhaustively on a grid, solving the linear ones in closed form (weighted
least squares, bounds respected) at every grid point, then polishes the best grid
point with scipy's bounded least squares over the same two parameters (variable
projection: the linear part stays exactly optimal throughout). No starting values are
needed, and the global grid makes local minima harmless. Everything is float64.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import optimize, special

from isojax.analysis.runs import UNITS

# Search ranges of the nonlinear parameters. A fit that ends on one of these edges was
# not pinned down by its data, and says so in `flags`.
SIGMOID_B_RANGE = (0.02, 20.0)
# The values each sigmoid parameter can take (fit_sigmoid's constraints): a
# confidence interval cut to them keeps its coverage.
SIGMOID_SUPPORT = {"a": (0.0, 1.0), "b": (0.0, math.inf), "c_mid": (0.0, math.inf),
                   "r0": (0.0, 1.0)}
SIGMOID_PARAMS = tuple(SIGMOID_SUPPORT)  # SigmoidFit's parameters: a, b, c_mid, r0
SIGMOID_CMID_MARGIN_DECADES = 2.0  # C_mid is searched this far beyond the data
NSTAR_K_RANGE = (0.05, 100.0)
NSTAR_X0_MARGIN_DECADES = 1.0
# R0, A, B and C_mid free, plus one point so the residuals check the fit (one fewer
# with R0 given).
SIGMOID_MIN_POINTS = 5
_GRID = (40, 64)  # (slope values, midpoint values)
_BOUND_TOL = 1e-6
_TINY = 1e-300


def _scalar(value, what: str, name: str) -> float:
  """One real number given as `name` (a Python or NumPy scalar, or a 0-d array)."""
  if np.ndim(value) != 0 or isinstance(value, (str, bytes, bool, np.bool_)):
    raise ValueError(f"{what}: {name} must be one number, got {value!r}")
  try:
    return float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{what}: {name} must be one number, got {value!r}") from None


def _validate(x, y, weights, what: str, min_points: int):
  x = np.asarray(x, dtype=np.float64).ravel()
  y = np.asarray(y, dtype=np.float64).ravel()
  if x.shape != y.shape:
    raise ValueError(f"{what}: compute has {x.size} points but the target has {y.size}")
  if x.size == 0:  # before the weights, whose check would blame them
    raise ValueError(f"{what}: no points to fit")
  w = np.ones_like(x) if weights is None else np.asarray(weights, np.float64).ravel()
  if w.shape != x.shape:
    raise ValueError(f"{what}: weights has {w.size} entries, expected {x.size}")
  if not (np.isfinite(x).all() and np.isfinite(y).all() and np.isfinite(w).all()):
    raise ValueError(f"{what}: inputs contain NaN or inf")
  if np.any(x <= 0):
    raise ValueError(f"{what}: compute must be > 0 (got min {x.min()!r})")
  if np.any(w < 0) or not np.any(w > 0):
    raise ValueError(f"{what}: weights must be >= 0 and not all zero")
  used = int(np.count_nonzero(w > 0))
  # Points repeated at one compute (seeds evaluated at the same steps) constrain the
  # curve only there: its residuals check its shape only with more distinct compute
  # values than free parameters; the repeats check just the noise.
  distinct = int(np.unique(x[w > 0]).size)
  if distinct < min_points:
    raise ValueError(f"{what}: {used} points with positive weight at {distinct} "
                     f"distinct compute values; need at least {min_points} (free "
                     f"parameters + 1) so the fit is checked by its own residuals")
  return x, y, w


def _sigmoid_linear(s, y, w, r0):
  """Weighted LS of y ≈ r0*(1-s) + a*s for each row of s (GxN) under
  0 <= r0 <= a <= 1 (r0 free) or r0 <= a <= 1 (r0 given). Returns (sse, r0, a)."""
  u = 1.0 - s
  wy = w * y
  syy = float(np.sum(wy * y))
  suu, svv, suv = (w * u * u).sum(-1), (w * s * s).sum(-1), (w * u * s).sum(-1)
  suy, svy = (u * wy).sum(-1), (s * wy).sum(-1)

  def sse(r, a):
    e = syy - 2 * (r * suy + a * svy) + r * r * suu + 2 * r * a * suv + a * a * svv
    return np.maximum(e, 0.0)

  if r0 is not None:
    a = np.clip((svy - r0 * suv) / np.maximum(svv, _TINY), max(r0, 0.0), 1.0)
    r = np.full_like(a, r0)
    return sse(r, a), r, a
  # Feasible set: the triangle 0 <= r0 <= a <= 1. A convex quadratic attains its
  # minimum there at the free minimiser (when inside) or on one of the three edges.
  det = suu * svv - suv * suv
  ok = det > 1e-12 * np.maximum(suu * svv, _TINY)
  safe = np.where(ok, det, 1.0)
  r_free, a_free = (svv * suy - suv * svy) / safe, (suu * svy - suv * suy) / safe
  ones = np.ones_like(suu)
  flat = np.clip(np.sum(wy) / np.sum(w), 0.0, 1.0) * ones  # a = r0: a constant
  candidates = [
      (r_free, a_free, ok & (r_free >= 0) & (r_free <= a_free) & (a_free <= 1)),
      (0 * ones, np.clip(svy / np.maximum(svv, _TINY), 0, 1), True),  # edge r0 = 0
      (np.clip((suy - suv) / np.maximum(suu, _TINY), 0, 1), ones, True),  # edge a = 1
      (flat, flat, True),  # edge a = r0
  ]
  best = (np.full_like(suu, np.inf), 0 * ones, 0 * ones)
  for r, a, valid in candidates:
    e = np.where(valid, sse(r, a), np.inf)
    better = e < best[0]
    best = tuple(np.where(better, new, old) for new, old in zip((e, r, a), best))
  return best


def _law_linear(s, y, w):
  """Weighted LS of y ≈ L*s + b for each row of s (unbounded). Returns (sse, L, b)."""
  sw, swy, syy = np.sum(w), np.sum(w * y), np.sum(w * y * y)
  ss, ssy, s1 = (w * s * s).sum(-1), (w * s * y).sum(-1), (w * s).sum(-1)
  det = ss * sw - s1 * s1
  ok = det > 1e-12 * np.maximum(ss * sw, _TINY)
  safe = np.where(ok, det, 1.0)
  L = np.where(ok, (ssy * sw - s1 * swy) / safe, 0.0)
  b = np.where(ok, (ss * swy - s1 * ssy) / safe, swy / sw)
  e = syy - 2 * (L * ssy + b * swy) + L * L * ss + 2 * L * b * s1 + b * b * sw
  return np.maximum(e, 0.0), L, b


def _grid_then_polish(t, y, w, slopes, mids, solve, model):
  """Minimises sum w*(model - y)^2 over (slope, mid) with s = expit(slope*(t - mid)).

  solve(s_GxN, y, w) -> (sse_G, p_G, q_G) gives the optimal linear part;
  model(s, p, q) evaluates the curve. Returns (slope, mid, p, q, sse).
  """
  S, Mid = np.meshgrid(slopes, mids, indexing="ij")
  s_GxN = special.expit(S.reshape(-1, 1) * (t[None, :] - Mid.reshape(-1, 1)))
  sse_G = solve(s_GxN, y, w)[0]
  g = int(np.argmin(sse_G))
  lo = np.array([math.log(slopes[0]), mids[0]])
  hi = np.array([math.log(slopes[-1]), mids[-1]])
  sqrt_w = np.sqrt(w)

  def linear_part(theta):
    s = special.expit(math.exp(theta[0]) * (t - theta[1]))
    _, p, q = solve(s[None, :], y, w)
    return s, float(p[0]), float(q[0])

  def residual(theta):
    s, p, q = linear_part(theta)
    return sqrt_w * (model(s, p, q) - y)

  start = np.clip([math.log(S.flat[g]), Mid.flat[g]], lo, hi)
  best_theta, best_sse = start, float(sse_G[g])
  try:
    res = optimize.least_squares(residual, start, bounds=(lo, hi), method="trf",
                                 x_scale=[1.0, max(1.0, float(np.ptp(t)))],
                                 xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=300)
    if 2 * res.cost <= best_sse:  # never accept a polish that is worse than the grid
      best_theta, best_sse = res.x, 2 * float(res.cost)
  except ValueError:  # a pathological residual; the grid optimum is still valid
    pass
  s, p, q = linear_part(best_theta)
  sse = float(np.sum(w * (model(s, p, q) - y) ** 2))
  return math.exp(best_theta[0]), float(best_theta[1]), p, q, sse


def _quality(y, pred, w):
  resid = pred - y
  rms = float(np.sqrt(np.mean(resid**2)))
  ybar = np.sum(w * y) / np.sum(w)
  ss_tot = float(np.sum(w * (y - ybar) ** 2))
  r2 = 1.0 - float(np.sum(w * resid**2)) / ss_tot if ss_tot > 0 else float("nan")
  return rms, r2


def _near(v, bound, scale=1.0):
  return abs(v - bound) <= _BOUND_TOL * max(1.0, abs(scale))


@dataclasses.dataclass(frozen=True)
class SigmoidFit:
  """R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), fitted to (compute, reward).

  Attributes:
    a: asymptotic reward A, in [0, 1].
    b: the exponent B > 0 (steepness in log compute).
    c_mid: compute at which half of the gain A - R0 is reached.
    r0: reward as C -> 0 (fitted in [0, A], or the value given).
    r0_fixed: whether r0 was given rather than fitted.
    rms: root mean square residual (unweighted).
    r2: coefficient of determination (weighted; NaN when the data are constant).
    n_points: number of points fitted.
    compute_range: (min, max) compute of the data: the curve is supported there.
    flags: the parameters that ended at a bound or search edge, e.g. "a=1 (upper
      bound)", "c_mid at upper search edge", "flat (a == r0)". Empty when clean.
  """

  a: float
  b: float
  c_mid: float
  r0: float
  r0_fixed: bool
  rms: float
  r2: float
  n_points: int
  compute_range: tuple[float, float]
  flags: tuple[str, ...] = ()

  @property
  def at_bound(self) -> bool:
    """True when any parameter ended at a bound or search edge."""
    return bool(self.flags)

  def predict(self, compute) -> np.ndarray:
    """Reward at `compute` (array-like, > 0)."""
    c = np.asarray(compute, dtype=np.float64)
    with np.errstate(divide="ignore"):  # C = 0: log C = -inf, and the limit R0 is right
      s = special.expit(self.b * (np.log(c) - math.log(self.c_mid)))
    return self.r0 + (self.a - self.r0) * s

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def fit_sigmoid(compute, reward, *, r0=None, weights=None) -> SigmoidFit:
  """Fits R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) (ScaleRL's saturating form).

  Constraints: 0 <= A <= 1, B > 0, C_mid > 0 and, the curve being monotone, R0 <= A
  (with R0 >= 0 when fitted). B is searched in SIGMOID_B_RANGE and C_mid within
  SIGMOID_CMID_MARGIN_DECADES of the data; a parameter that ends at a bound or search
  edge is named in `flags`.

  Args:
    compute: compute of each point (> 0), e.g. rollouts.
    reward: reward of each point.
    r0: if given, R0 is fixed to it (e.g. the base model's reward) instead of fitted.
    weights: optional non-negative weight per point.

  Raises:
    ValueError: on bad inputs (a reward outside [0, 1] among them), or fewer points
      than free parameters + 1 (5 with R0 fitted, 4 with R0 given).
  """
  if r0 is not None:
    r0 = _scalar(r0, "fit_sigmoid", "r0")
    if not (math.isfinite(r0) and 0.0 <= r0 <= 1.0):
      raise ValueError(f"fit_sigmoid: r0 must be in [0, 1], got {r0!r}")
  c, y, w = _validate(compute, reward, weights, "fit_sigmoid",
                      min_points=SIGMOID_MIN_POINTS - (r0 is not None))
  # A and R0 are bounded to [0, 1]: a reward on another scale would be fitted by a
  # curve pinned at those bounds, and its n* read off that wrong curve.
  if y.min() < 0.0 or y.max() > 1.0:
    i = int(np.argmin(y) if y.min() < 0.0 else np.argmax(y))
    raise ValueError(f"fit_sigmoid: reward must be in [0, 1] (a success rate), got "
                     f"{y[i]:g} at compute {c[i]:g} (range {y.min():g} to {y.max():g}); "
                     f"rescale it first, e.g. (r + 1) / 2 for a reward in [-1, 1] or "
                     f"r / 100 for a percentage")
  logc = np.log(c)
  margin = SIGMOID_CMID_MARGIN_DECADES * math.log(10.0)
  slopes = np.geomspace(*SIGMOID_B_RANGE, _GRID[0])
  mids = np.linspace(logc.min() - margin, logc.max() + margin, _GRID[1])
  b, log_cmid, r_fit, a, _ = _grid_then_polish(
      logc, y, w, slopes, mids, lambda s, yy, ww: _sigmoid_linear(s, yy, ww, r0),
      lambda s, p, q: p * (1 - s) + q * s)
  fit = SigmoidFit(a=a, b=b, c_mid=math.exp(log_cmid), r0=r_fit,
                   r0_fixed=r0 is not None, rms=0.0, r2=0.0, n_points=int(c.size),
                   compute_range=(float(c.min()), float(c.max())))
  rms, r2 = _quality(y, fit.predict(c), w)
  flags = []
  if _near(a, 0.0):
    flags.append("a=0 (lower bound)")
  if _near(a, 1.0):
    flags.append("a=1 (upper bound)")
  if r0 is None and _near(r_fit, 0.0):
    flags.append("r0=0 (lower bound)")
  if _near(a, r_fit):
    flags.append("flat (a == r0): b and c_mid are not identified")
  if _near(math.log(b), math.log(SIGMOID_B_RANGE[0])):
    flags.append(f"b at lower search edge {SIGMOID_B_RANGE[0]}")
  if _near(math.log(b), math.log(SIGMOID_B_RANGE[1])):
    flags.append(f"b at upper search edge {SIGMOID_B_RANGE[1]}")
  if _near(log_cmid, mids[0], mids[0]):
    flags.append("c_mid at lower search edge (far below the data)")
  if _near(log_cmid, mids[-1], mids[-1]):
    flags.append("c_mid at upper search edge (far beyond the data)")
  return dataclasses.replace(fit, rms=rms, r2=r2, flags=tuple(flags))


@dataclasses.dataclass(frozen=True)
class NStarFit:
  """log2 n*(C) = L / (1 + exp(-k (log10 C - x0))) + b, the IsoCompute n* law.

  Attributes:
    L: the total rise of log2 n* (negative for a decreasing law, e.g. Bp*(M)).
    k: steepness per decade of compute, > 0.
    x0: log10 of the compute at the law's midpoint.
    b: log2 n* as C -> 0.
    rms, r2, n_points: fit quality in log2 units, as for SigmoidFit.
    compute_range: (min, max) compute of the data.
    unit: what compute counts ("rollouts", "tokens" or "steps").
    flags: parameters at a search edge, or "constant" when n* never changes.
  """

  L: float
  k: float
  x0: float
  b: float
  rms: float
  r2: float
  n_points: int
  compute_range: tuple[float, float]
  unit: str = "rollouts"
  flags: tuple[str, ...] = ()

  @property
  def at_bound(self) -> bool:
    return bool(self.flags)

  def predict_log2(self, compute) -> np.ndarray:
    """log2 n* at `compute`."""
    x = np.log10(np.asarray(compute, dtype=np.float64))
    return self.L * special.expit(self.k * (x - self.x0)) + self.b

  def predict(self, compute) -> np.ndarray:
    """n* at `compute` (a real number; `plan` rounds it to a power of two)."""
    # A bootstrap law at a search edge can put log2 n* past 1024: n* = inf is
    # the right value there (its interval is then unbounded), not a warning.
    with np.errstate(over="ignore"):
      return np.exp2(self.predict_log2(compute))

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def fit_n_star(compute, n_star, *, weights=None, unit: str = "rollouts") -> NStarFit:
  """Fits log2 n* = L / (1 + exp(-k (log10 C - x0))) + b (rapid growth, then saturation).

  k is searched in NSTAR_K_RANGE and x0 within NSTAR_X0_MARGIN_DECADES of the data;
  L and b are unbounded (L < 0 describes a decreasing quantity such as Bp*(M)).

  Args:
    compute: compute of each point (> 0).
    n_star: compute-optimal n at each point (> 0; powers of two or running averages).
    weights: optional non-negative weight per point.
    unit: the compute unit, recorded on the fit (`plan` requires "rollouts").

  Raises:
    ValueError: on bad inputs or fewer than 5 points.
  """
  if unit not in UNITS:
    raise ValueError(f"fit_n_star: unit={unit!r}; choose from {list(UNITS)}")
  c, n, w = _validate(compute, n_star, weights, "fit_n_star", min_points=5)
  if np.any(n <= 0):
    raise ValueError(f"fit_n_star: n_star must be > 0 (got min {n.min()!r})")
  x, y = np.log10(c), np.log2(n)
  margin = NSTAR_X0_MARGIN_DECADES
  slopes = np.geomspace(*NSTAR_K_RANGE, _GRID[0])
  mids = np.linspace(x.min() - margin, x.max() + margin, _GRID[1])
  k, x0, L, b, _ = _grid_then_polish(x, y, w, slopes, mids, _law_linear,
                                     lambda s, p, q: p * s + q)
  flags = []
  if np.ptp(y) == 0:
    flags.append("constant (n* never changes): L, k, x0 are not identified")
  if _near(math.log(k), math.log(NSTAR_K_RANGE[0])):
    flags.append(f"k at lower search edge {NSTAR_K_RANGE[0]}")
  if _near(math.log(k), math.log(NSTAR_K_RANGE[1])):
    flags.append(f"k at upper search edge {NSTAR_K_RANGE[1]} (a step)")
  if _near(x0, mids[0], mids[0]) or _near(x0, mids[-1], mids[-1]):
    flags.append("x0 at a search edge (midpoint outside the data)")
  fit = NStarFit(L=L, k=k, x0=x0, b=b, rms=0.0, r2=0.0, n_points=int(c.size),
                 compute_range=(float(c.min()), float(c.max())), unit=unit,
                 flags=tuple(flags))
  rms, r2 = _quality(y, fit.predict_log2(c), w)
  return dataclasses.replace(fit, rms=rms, r2=r2)
