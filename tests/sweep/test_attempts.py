"""The attempts file a launcher keeps per point (isojax/sweep/attempts.py)."""

import json

from isojax.sweep import attempts

COMMAND = ["python", "-m", "isojax.main", "--workdir=x"]


def test_an_event_after_a_torn_line_is_kept_on_a_line_of_its_own(tmp_path):
  attempts.record_attempt(str(tmp_path), event="start", pid=1, command=COMMAND,
                          config_digest="d")
  with open(tmp_path / attempts.ATTEMPTS_FILE, "a") as f:
    f.write('{"time": 1.0, "event": "en')  # the end event of a launcher killed mid-write
  attempts.record_attempt(str(tmp_path), event="start", pid=2, command=COMMAND,
                          config_digest="d")
  attempts.record_attempt(str(tmp_path), event="end", pid=2, rc=0, done=True)
  lines = (tmp_path / attempts.ATTEMPTS_FILE).read_text().splitlines()
  assert lines[1] == '{"time": 1.0, "event": "en'
  assert [json.loads(line)["pid"] for line in lines[2:]] == [2, 2]
  assert attempts.finished_as(str(tmp_path), COMMAND, "d")
  assert not attempts.finished_as(str(tmp_path), COMMAND, "another digest")
