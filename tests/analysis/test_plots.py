"""Figures: built from analysis data, labelled, log-scaled where the paper is."""

import io
import types

import numpy as np
import pytest
from matplotlib.figure import Figure

from isojax.analysis import fit_frontier, fixed_batch, read_runs, sensitivity
from isojax.analysis import fit_sigmoid, frontier
from isojax.analysis import plots

from . import fake_runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("plots")
  configs = fake_runs.bp8_configs() + [(64, 4), (32, 8), (16, 16), (4, 64), (16, 8)]
  fake_runs.make_sweep(root, configs=configs, budget=8 * 64 * 500, noise=0.01, n_evals=30,
                       hist_bins=8, hist_layout="flat")  # the run loop's layout
  return read_runs(root).runs


def _labelled(ax):
  return ax.get_xlabel() and ax.get_ylabel()


def test_frontier_and_records_figures(runs):
  sweep = fit_frontier([r for r in runs if r.bp == 8], metric="val/avg@4", label="bp=8")
  fig = plots.plot_frontier(sweep)
  ax = fig.axes[0]
  assert isinstance(fig, Figure) and _labelled(ax) and ax.get_xscale() == "log"
  assert "rollouts" in ax.get_xlabel()
  fig = plots.plot_records(sweep.curves)
  assert len([a for a in fig.axes if a.get_visible()]) == 5
  fig = plots.plot_n_star([sweep])
  ax = fig.axes[0]
  assert ax.get_xscale() == "log" and ax.get_yscale() == "log"  # log2 n* axis
  assert "n*" in ax.get_ylabel()


def test_frontier_figure_shades_where_n_star_is_censored():
  # n=4 stops at C=1e3 below a plateau above n=64's: past 1e3 the frontier's n*=64
  # is censored, and the figure must not show it as a finding.
  c1, c2 = np.geomspace(10, 1e3, 12), np.geomspace(100, 1e5, 12)
  r1, r2 = fake_runs.sigmoid(c1, 0.99, 1, 1e3, 0.1), fake_runs.sigmoid(c2, 0.95, 1, 1e3, 0.1)
  fits = {4: fit_sigmoid(c1, r1), 64: fit_sigmoid(c2, r2)}
  fr = frontier(fits, np.geomspace(10, 1e5, 50))
  assert fr.censored.any() and not fr.censored.all()
  sweep = types.SimpleNamespace(
      curves=types.SimpleNamespace(points={4: (c1, r1), 64: (c2, r2)}, fits=fits),
      frontier=fr, unit="rollouts", metric="val/avg@4", label="censored")
  ax = _drawn(plots.plot_frontier(sweep)).axes[0]
  bands = [p for p in ax.patches if p.get_label().startswith("n* censored")]
  assert len(bands) == 1
  box = bands[0].get_bbox()  # data coordinates
  assert box.x0 < fr.compute[fr.censored][0] and box.x1 >= fr.compute[fr.censored][-1]
  assert box.x0 > fr.compute[fr.censored.argmax() - 1]  # not over a decided point
  assert not plots.plot_frontier(types.SimpleNamespace(
      **{**vars(sweep), "frontier": frontier({64: fits[64]})})).axes[0].patches


def test_fixed_batch_sensitivity_and_hist_figures(runs):
  fig = plots.plot_fixed_batch(fixed_batch(runs, batch=256, metric="val/avg@4"))
  assert all(_labelled(ax) and ax.get_xscale() == "log" for ax in fig.axes)
  fig = plots.plot_sensitivity(sensitivity(runs, metric="val/avg@4"))
  assert "range" in fig.axes[0].get_title() and "range" in fig.axes[1].get_title()
  fig = plots.plot_pass1_hist(runs)
  assert fig is not None and "pass@1" in fig.axes[0].get_xlabel()
  bars = fig.axes[0].patches
  assert len(bars) == 16  # n=4 and n=64, 8 bins each
  assert sum(b.get_height() for b in bars) == pytest.approx(2.0)  # fractions
  no_hist = [r for r in runs if False]
  assert plots.plot_pass1_hist(no_hist) is None


def test_n_colors_are_ordered_by_n():
  colours = plots.n_colors([64, 4, 16])
  assert list(colours) == [4, 16, 64]
  assert len({tuple(np.round(c, 6)) for c in colours.values()}) == 3


def _drawn(fig):
  fig.savefig(io.BytesIO(), format="png", dpi=40)  # where log axes fail, if they do
  return fig


def test_configurations_without_points_are_noted_not_drawn(runs, tmp_path):
  # A run evaluated only at step 0 (compute 0): nothing for a log compute axis.
  fake_runs.write_run(tmp_path / "live", {"bp": 8, "n": 128, "m": 100},
                      [{"step": 0, "rollouts": 0, "val/avg@4": 0.1},
                       {"step": 1, "rollouts": 1024, "train/reward": 0.1}])
  live = read_runs(tmp_path).runs
  sweep = fit_frontier([r for r in runs if r.bp == 8] + list(live), metric="val/avg@4",
                       label="bp=8")
  assert sweep.curves.points[128][0].size == 0 and 128 in sweep.curves.skipped
  fig = _drawn(plots.plot_records(sweep.curves))
  empty = [a for a in fig.axes if "no evaluation at rollouts > 0" in
           " ".join(t.get_text() for t in a.texts)]
  assert len(empty) == 1 and not empty[0].axison
  assert sum(a.get_xscale() == "log" for a in fig.axes) == 5
  _drawn(plots.plot_frontier(sweep))
  alone = fit_frontier(list(live), metric="val/avg@4")
  fig = _drawn(plots.plot_records(alone.curves))
  assert fig.axes[0].get_xscale() == "linear"
