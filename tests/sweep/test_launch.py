"""Tests for launch/sweep.py's own flags."""

import pytest

from tests.test_sweep import TINY, _launch


@pytest.mark.parametrize("flags", [["--submit"], ["--nodes=2", "--partition=gpu"],
                                   ["--sbatch_arg=--qos=high"]])
def test_slurm_flags_without_slurm_are_refused(tmp_path, flags):
  root = tmp_path / "r"
  proc = _launch(f"--config={TINY}", f"--root={root}", "--bp=4", "--n=2", "--budget=64",
                 *flags, check=False)
  assert proc.returncode != 0
  named = ", ".join(f.partition("=")[0] for f in flags)
  assert f"{named} only apply to a SLURM array: add --slurm" in proc.stderr
  assert not root.exists()  # nothing ran here
