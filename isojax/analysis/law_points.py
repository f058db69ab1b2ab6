"""The frontier points the n*(C) law is fitted to (IsoCompute playbook Fig. 7, Fig. 15).

Along the frontier, the attaining n is a staircase in C: it jumps from one tried n to
the next. A sigmoid fitted to that staircase sampled on a log grid tends to a step
wherever the staircase has only a jump or two. The playbook fits the law to points
that estimate the underlying trend instead, in one of two ways:

  "running_average" (Fig. 7, the default): at each compute of the frontier grid, the
    mean of log2 n* over the grid points within `window` decades around it (the
    window shrinks symmetrically near the ends of the frontier, so it never leans to
    one side). A jump between two tried n becomes a ramp, and a run of jumps becomes
    the line through them, whose sigmoid the law is.
  "bins" (Fig. 15): the compute at which the frontier first enters each higher
    reward bin (the record-breaking points of the envelope, same bin width as the
    per-run records), with the n attaining the frontier there: "the compute budget C
    required for a specific n to reach a higher performance bin". Dense where the
    frontier climbs, sparse on its plateau.

Both are computed from the fitted frontier (a `Frontier`), so they move with it under
the bootstrap, and only from its points where n* is decided (`Frontier.decided`):
where a configuration that ended early might attain the frontier, the n* drawn there
is an artefact of where its runs stopped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from isojax.analysis import fits as fits_lib
from isojax.analysis.records import record_breaking_points

DEFAULT_METHOD = "running_average"
DEFAULT_WINDOW_DECADES = 0.5


@dataclasses.dataclass(frozen=True)
class LawPoints:
  """Points (compute, n*) of a frontier for the n*(C) law, with how they were made.

  Attributes:
    method: "running_average" or "bins".
    compute: compute of each point, increasing.
    n_star: the n* estimate at each point (a geometric mean for running_average,
      the attaining n for bins).
    reward: the frontier's reward at each point.
    window_decades: the running-average window (None for bins).
    bin_width: the reward bin (None for running_average).
  """

  method: str
  compute: np.ndarray
  n_star: np.ndarray
  reward: np.ndarray
  window_decades: float | None = None
  bin_width: float | None = None


def running_average_points(fr, *, window_decades: float = DEFAULT_WINDOW_DECADES
                           ) -> LawPoints:
  """Fig. 7: the running average of log2 n* over `window_decades` of log10 C."""
  if not window_decades > 0:
    raise ValueError(f"running average: window_decades must be > 0, got "
                     f"{window_decades!r}")
  c, n = fr.n_star_points()
  x, y = np.log10(c), np.log2(n)
  mean = np.empty_like(y)
  for i in range(x.size):
    half = min(window_decades / 2, x[i] - x[0], x[-1] - x[i])
    near = np.abs(x - x[i]) <= half + 1e-12
    mean[i] = y[near].mean()
  return LawPoints("running_average", c, np.exp2(mean), fr.reward[fr.decided],
                   window_decades=float(window_decades))


def bin_points(fr, *, bin_width: float = 0.005) -> LawPoints:
  """Fig. 15: where the frontier first enters each higher reward bin, and its n*."""
  c, n = fr.n_star_points()
  reward = fr.reward[fr.decided]
  idx = record_breaking_points(c, reward, bin_width=bin_width)
  return LawPoints("bins", c[idx], n[idx], reward[idx], bin_width=float(bin_width))


METHODS: dict[str, Callable] = {
    "running_average": lambda fr, window_decades, bin_width: running_average_points(
        fr, window_decades=window_decades),
    "bins": lambda fr, window_decades, bin_width: bin_points(fr, bin_width=bin_width),
}


def law_points(fr, method: str = DEFAULT_METHOD, *,
               window_decades: float = DEFAULT_WINDOW_DECADES,
               bin_width: float = 0.005) -> LawPoints:
  """The points of `fr` (a Frontier) the n*(C) law is fitted to, by `method`."""
  if method not in METHODS:
    raise ValueError(f"n* law points: unknown method {method!r}; choose from "
                     f"{sorted(METHODS)}")
  return METHODS[method](fr, window_decades, bin_width)


def fit_law(fr, *, unit: str = "rollouts", method: str = DEFAULT_METHOD,
            window_decades: float = DEFAULT_WINDOW_DECADES, bin_width: float = 0.005
            ) -> tuple[LawPoints, fits_lib.NStarFit]:
  """The law points of `fr` and the n*(C) law fitted to them.

  Raises:
    ValueError: from `fit_n_star` (e.g. fewer than 5 points).
  """
  points = law_points(fr, method, window_decades=window_decades, bin_width=bin_width)
  return points, fits_lib.fit_n_star(points.compute, points.n_star, unit=unit)
