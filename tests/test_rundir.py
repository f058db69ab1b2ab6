"""The run directory's layout and its one metrics reader, with both policies."""

import errno
import logging
import os

import pytest

from isojax import files, rundir


def _write(tmp_path, text: str):
  path = tmp_path / rundir.METRICS_FILE
  path.write_text(text)
  return path


def test_strict_read_skips_a_torn_last_line_and_names_a_corrupt_one(tmp_path):
  path = _write(tmp_path, '{"step": 0}\n{"step": 1, "x": 2.5}\n{"step": 2, "x"')
  assert rundir.read_metrics(path).records == ({"step": 0}, {"step": 1, "x": 2.5})
  _write(tmp_path, '{"step": 0}\nnot json\n{"step": 2}\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
    rundir.read_metrics(path)
  for bad in ('{"no_step": 1}', '{"step": true}', '{"step": NaN}', '{"step": "3"}'):
    _write(tmp_path, '{"step": 0}\n' + bad + '\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
      rundir.read_metrics(path)


def test_tolerant_read_reports_what_it_skips(tmp_path):
  path = _write(tmp_path, '{"step": 0}\n\nnot json\n[1]\n{"step": 3, "r": NaN}\n{"step": 4}')
  lines = rundir.read_metrics(path, tolerant=True)
  assert [r["step"] for r in lines.records] == [0, 3, 4]  # the unterminated line parses
  assert lines.corrupt == (3, 4)


def test_a_missing_file_has_no_records(tmp_path):
  for tolerant in (False, True):
    assert rundir.read_metrics(tmp_path / "none.jsonl", tolerant=tolerant).records == ()


def test_last_record_reads_the_last_complete_line(tmp_path):
  assert rundir.last_record(tmp_path) is None
  _write(tmp_path, "".join(f'{{"step": {i}, "pad": "{"x" * 300}"}}\n' for i in range(100))
         + '{"step": 100, "tor')
  assert rundir.last_record(tmp_path)["step"] == 99
  # Records longer than the tail read first (many validation sets' metrics).
  _write(tmp_path, "".join(f'{{"step": {i}, "pad": "{"x" * 20_000}"}}\n' for i in range(3))
         + '{"step": 3, "tor')
  assert rundir.last_record(tmp_path)["step"] == 2


def test_is_done_reads_the_done_file(tmp_path):
  assert not rundir.is_done(tmp_path)
  (tmp_path / rundir.DONE_FILE).write_text("{}\n")
  assert rundir.is_done(tmp_path)


def test_log_tail_is_the_last_lines_or_why_there_are_none(tmp_path):
  log = tmp_path / "x.log"
  log.write_text("".join(f"line {i}\n" for i in range(50)))
  assert files.log_tail(log, lines=3) == "line 47\nline 48\nline 49"
  assert files.log_tail(tmp_path / "missing.log").startswith("(no log:")


def test_a_run_directory_that_cannot_be_locked_says_so(tmp_path, monkeypatch, caplog):
  def no_flock(path, holder):  # as a cluster mount without flock answers
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK), path)

  monkeypatch.setattr(rundir, "try_flock", no_flock)
  with caplog.at_level(logging.WARNING):
    assert rundir.lock_run_dir(tmp_path) is None
  assert f"{tmp_path / rundir.RUN_LOCK_FILE} cannot be locked" in caplog.text
  assert "nothing stops a second run" in caplog.text
