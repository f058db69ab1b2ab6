"""Outcome rewards (0.0 / 1.0): exact match for synthetic tasks, math-verify for math.

math-verify guards its parsing and verification with `signal.alarm`, which only works
in the main thread. We switch its own timeouts off and run it in a worker process that
we kill when one answer exceeds our wall-clock limit: a pathological answer (e.g.
"\\boxed{9^{9^{9}}}", which sympy tries to evaluate) scores 0.0 within the limit, from
any thread, and the next call gets a fresh worker.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import queue
import re
import select
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

_WS = re.compile(r"\s+")
# A "$", "\[" or "\(" that opens math mode: an answer holding one is parsed as
# written, not wrapped in "$...$" ("$\[2\]$" parses to no number, so no response
# could match it). "\$" is a literal dollar sign (MATH's money answers such as
# "\$1.17"), not a delimiter.
_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\\[|\\\(")
# A LaTeX space between digit groups ("5\,000", "12\;345"): math-verify reads the
# groups as a product, so "5\,000" is 5 * 000 = 0 (and a response of 0 would match
# it). A space before exactly three digits separates thousands: the groups are joined.
# "~" is left alone: between numbers it also reads as a range ("10~100").
_DIGIT_GROUP_SPACE = re.compile(r"(?<=\d)\\[,;:> ](?=\d{3}(?!\d))")


def exact_match(response: str, answer: str) -> float:
  """1.0 if the response equals the answer, ignoring all whitespace; 0.0 for an
  empty answer (which an empty response would otherwise match)."""
  gold = _WS.sub("", answer)
  return float(bool(gold) and _WS.sub("", response) == gold)


def _verify_in_process(response: str, answer: str) -> float:
  """math-verify with its signal-based timeouts disabled (call only in a worker)."""
  from math_verify import parse, verify

  response = _DIGIT_GROUP_SPACE.sub("", response)
  answer = _DIGIT_GROUP_SPACE.sub("", answer)
  delimited = _MATH_DELIMITER.search(answer) or "\\boxed" in answer
  gold_text = answer if delimited else f"${answer}$"
  gold = parse(gold_text, parsing_timeout=None)
  if not gold:
    gold = parse(answer, parsing_timeout=None)
  pred = parse(response, parsing_timeout=None)
  if not gold or not pred:
    return 0.0
  return float(verify(gold, pred, timeout_seconds=None))


def _worker_main() -> None:
  """Worker loop: one JSON [response, answer] per stdin line -> one score per line."""
  import logging
  logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" notes
  out = sys.stdout
  sys.stdout = sys.stderr  # keep stray prints off the reply channel
  try:
    import math_verify  # noqa: F401  (import cost paid before "ready")
  except Exception as e:
    out.write(json.dumps({"error": repr(e)}) + "\n")
    out.flush()
    return
  out.write(json.dumps({"ready": True}) + "\n")
  out.flush()
  for line in sys.stdin:
    response, answer = json.loads(line)
    try:
      score = _verify_in_process(response, answer)
    except Exception:  # an unparsable answer is a wrong answer
      score = 0.0
    out.write(json.dumps({"score": score}) + "\n")
    out.flush()


class MathVerifier:
  """math-verify scoring with a per-answer wall-clock limit, usable from any thread.

  One worker subprocess (a fresh interpreter, so nothing of the trainer's process is
  copied or re-imported) scores answers one at a time; calls are serialised by a
  lock. When an answer takes longer than `timeout_s`, the worker is killed, the answer
  scores 0.0 and a new worker is started for the next call.

  Args:
    timeout_s: per-answer limit in seconds (wall clock, excluding worker start-up).
    startup_timeout_s: how long to wait for a new worker to import math-verify.
  """

  def __init__(self, timeout_s: float = 5.0, startup_timeout_s: float = 120.0):
    if timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    self.timeout_s = float(timeout_s)
    self.startup_timeout_s = float(startup_timeout_s)
    self.num_timeouts = 0
    self._lock = threading.Lock()
    self._proc = None
    atexit.register(self.close)

  def _readline(self, timeout_s: float) -> dict | None:
    ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
    if not ready:
      return None
    line = self._proc.stdout.readline()
    if not line:
      raise EOFError("math-verify worker exited")
    return json.loads(line)

  def _start(self) -> None:
    env = dict(os.environ)
    # The child must import isojax the way this process did, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    self._proc = subprocess.Popen(
        [sys.executable, "-c",
         "from isojax.data.rewards import _worker_main; _worker_main()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env=env)
    try:
      msg = self._readline(self.startup_timeout_s)
    except EOFError:
      msg = {"error": "exited during start-up"}
    if msg is None or "ready" not in msg:
      self._kill()
      detail = "timed out" if msg is None else msg.get("error")
      raise RuntimeError(f"math-verify worker failed to start ({detail}, limit "
                         f"{self.startup_timeout_s}s)")

  def _kill(self) -> None:
    if self._proc is not None:
      self._proc.kill()
      self._proc.wait(timeout=10)
      for f in (self._proc.stdin, self._proc.stdout):
        try:
          f.close()
        except OSError:
          pass
    self._proc = None

  def __call__(self, response: str, answer: str) -> float:
    """1.0 if `response` is mathematically equivalent to `answer`, else 0.0 (also
    for an empty answer, which an empty response would otherwise match)."""
    if not answer.strip():
      return 0.0
    # Cheap, and spares the worker round trip; only the ends' whitespace is ignored
    # ("2 3" is not "23").
    if response.strip() == answer.strip():
      return 1.0
    with self._lock:
      if self._proc is None or self._proc.poll() is not None:
        self._kill()
        self._start()
      try:
        self._proc.stdin.write(json.dumps([response, answer]) + "\n")
        self._proc.stdin.flush()
        msg = self._readline(self.timeout_s)
      except (EOFError, OSError, ValueError):
        self._kill()  # the worker died (e.g. out of memory): a wrong answer
        return 0.0
      if msg is None:
        self.num_timeouts += 1
        self._kill()
        return 0.0
      return float(msg["score"])

  def score_batch(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """Scores for paired responses and answers (each under its own time limit)."""
    if len(responses) != len(answers):
      raise ValueError(f"{len(responses)} responses for {len(answers)} answers")
    return [self(r, a) for r, a in zip(responses, answers)]

  def close(self) -> None:
    """Stop the worker process (also registered with atexit)."""
    with self._lock:
      self._kill()


class MathVerifierPool:
  """`num_workers` MathVerifiers side by side, for scoring large batches in parallel.

  Each call borrows an idle verifier (blocking while all are busy); `score_batch`
  spreads a batch over all of them from a thread pool. Same 0/1 semantics and
  per-answer limit as `MathVerifier`.
  """

  def __init__(self, num_workers: int = 4, timeout_s: float = 5.0,
               startup_timeout_s: float = 120.0):
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    self.timeout_s = float(timeout_s)
    self._verifiers = [MathVerifier(timeout_s, startup_timeout_s)
                       for _ in range(num_workers)]
    self._idle = queue.SimpleQueue()
    for v in self._verifiers:
      self._idle.put(v)

  @property
  def num_timeouts(self) -> int:
    return sum(v.num_timeouts for v in self._verifiers)

  def __call__(self, response: str, answer: str) -> float:
    v = self._idle.get()
    try:
      return v(response, answer)
    finally:
      self._idle.put(v)

  def score_batch(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    if len(responses) != len(answers):
      raise ValueError(f"{len(responses)} responses for {len(answers)} answers")
    with concurrent.futures.ThreadPoolExecutor(len(self._verifiers)) as ex:
      return list(ex.map(self, responses, answers))

  def close(self) -> None:
    for v in self._verifiers:
      v.close()


_DEFAULT_VERIFIER: MathVerifier | None = None
_DEFAULT_LOCK = threading.Lock()


def math_verify_reward(response: str, answer: str) -> float:
  """math-verify equivalence (0.0/1.0) through a shared `MathVerifier` (5 s limit)."""
  global _DEFAULT_VERIFIER
  with _DEFAULT_LOCK:
    if _DEFAULT_VERIFIER is None:
      _DEFAULT_VERIFIER = MathVerifier()
  return _DEFAULT_VERIFIER(response, answer)


REWARD_FNS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match,
    "math_verify": math_verify_reward,
}


def get_reward_fn(name: str, **kwargs) -> Callable[[str, str], float]:
  """A reward function by name ("exact_match" or "math_verify").

  kwargs (math_verify only): `timeout_s` for a dedicated verifier, `num_workers` > 1
  for a `MathVerifierPool` (parallel `score_batch`).
  """
  if name not in REWARD_FNS:
    raise ValueError(f"unknown reward {name!r}; choose from {sorted(REWARD_FNS)}")
  if name == "math_verify" and kwargs:
    if kwargs.get("num_workers", 1) > 1:
      return MathVerifierPool(**kwargs)
    kwargs.pop("num_workers", None)
    return MathVerifier(**kwargs)
  if kwargs:
    raise ValueError(f"reward {name!r} takes no options, got {sorted(kwargs)}")
  return REWARD_FNS[name]
