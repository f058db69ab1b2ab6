"""Where a call's device time goes: the top ops of one traced call.

    profile = profile_call(lambda: step(state, batch), "/tmp/trace")
    print(profile.table())

`bench/gpu_step.py --profile` and `bench/sampler.py --gpu --profile` print this for
one update step / one request, so a short accelerator lease returns the op
breakdown with the timings. The call runs under `jax.profiler` (perfetto trace);
device ops are the events of the trace's device processes (`/device:GPU:0`, ...:
kernels, named by their HLO op where XLA launched them) or, on a CPU backend, the
events that carry an `hlo_op` (XLA:CPU's thunks), less those that enclose others
(a while op around its body's ops). The summary is the call's wall
time, the union of the device ops' intervals (time the device was busy: the rest
is launch, host or synchronisation time), the ops with the most total time, the
device's idle gaps grouped by the ops on either side of them (where the device
waits), and the host events with the most self time (what the host does
meanwhile: launches, synchronisations, a loop's condition copied to the host).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import time

import jax


@dataclasses.dataclass(frozen=True)
class Profile:
  wall_ms: float  # the traced call, host clock
  busy_ms: float  # union of the device ops' intervals
  num_ops: int  # device op events (kernel launches on a GPU)
  top: list[tuple[str, float, int]]  # (op, total ms, count), most total time first
  # ("op before -> op after", idle ms, count): the device's gaps between busy spans
  gaps: list[tuple[str, float, int]] = dataclasses.field(default_factory=list)
  # (host event, self ms, count): host time less that of the events inside it
  host: list[tuple[str, float, int]] = dataclasses.field(default_factory=list)

  def table(self, n: int = 20) -> str:
    lines = [f"device busy {self.busy_ms:.1f} ms of {self.wall_ms:.1f} ms wall "
             f"({self.busy_ms / max(self.wall_ms, 1e-9):.0%}), {self.num_ops} device ops"]
    for what, rows in (("device op", self.top), ("device idle between", self.gaps),
                       ("host event (self time)", self.host)):
      if rows:
        total = sum(ms for _, ms, _ in rows) or 1.0
        lines.append(f"{'total ms':>10}{'share':>7}{'count':>8}{'us each':>9}  {what}")
        lines += [f"{ms:>10.2f}{ms / total:>7.1%}{count:>8}{1e3 * ms / count:>9.1f}  {name}"
                  for name, ms, count in rows[:n]]
    return "\n".join(lines)


def _threads(events: list[dict]) -> list[list[dict]]:
  """Events by thread, each in start order, an enclosing event before those inside."""
  by_thread = collections.defaultdict(list)
  for e in events:
    by_thread[e["pid"], e.get("tid")].append(e)
  return [sorted(t, key=lambda e: (e["ts"], -e.get("dur", 0))) for t in by_thread.values()]


def _leaves(ops: list[dict]) -> list[dict]:
  """The ops that enclose no other op of their thread: XLA:CPU traces a while or
  cond op around the ops of its body, which would count them twice."""
  leaves = []
  for thread in _threads(ops):
    for e, after in zip(thread, thread[1:] + [None]):
      if after is None or after["ts"] >= e["ts"] + e.get("dur", 0):
        leaves.append(e)
  return leaves


def _self_times(events: list[dict]) -> list[tuple[dict, float]]:
  """(event, its duration less its direct children's) for nested events of a thread."""
  out = []
  for thread in _threads(events):
    stack = []  # [event, self time] of the enclosing events
    for e in thread:
      while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0].get("dur", 0):
        out.append(tuple(stack.pop()))
      if stack:
        stack[-1][1] -= e.get("dur", 0)
      stack.append([e, e.get("dur", 0)])
    out += [tuple(x) for x in stack]
  return out


def _op_name(e: dict) -> str:
  return e.get("args", {}).get("hlo_op", e["name"])


def _ranked(totals: collections.Counter, counts: collections.Counter) -> list:
  return [(name, ms, counts[name]) for name, ms in totals.most_common()]


def summarize(events: list[dict], wall_ms: float) -> Profile:
  """A Profile of trace events (Chrome trace format, times in microseconds)."""
  procs = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  device_pids = {pid for pid, name in procs.items() if name.startswith("/device:")}
  on_device = lambda e: (e["pid"] in device_pids if device_pids
                         else "hlo_op" in e.get("args", {}))
  spans = [e for e in events if e.get("ph") == "X"]
  ops = _leaves([e for e in spans if on_device(e)])
  totals, counts = collections.Counter(), collections.Counter()
  for e in ops:
    totals[_op_name(e)] += e.get("dur", 0) / 1e3
    counts[_op_name(e)] += 1
  busy_us, last = 0.0, None  # `last`: the op that ends the busy span so far
  gap_ms, gap_counts = collections.Counter(), collections.Counter()
  for e in sorted(ops, key=lambda e: e["ts"]):
    end = e["ts"] + e.get("dur", 0)
    last_end = float("-inf") if last is None else last["ts"] + last.get("dur", 0)
    busy_us += max(0.0, end - max(e["ts"], last_end))
    if last is not None and e["ts"] > last_end:
      pair = f"{_op_name(last)} -> {_op_name(e)}"
      gap_ms[pair] += (e["ts"] - last_end) / 1e3
      gap_counts[pair] += 1
    if end >= last_end:
      last = e
  host_ms, host_counts = collections.Counter(), collections.Counter()
  for e, self_us in _self_times([e for e in spans if not on_device(e)]):
    host_ms[e["name"]] += self_us / 1e3
    host_counts[e["name"]] += 1
  return Profile(wall_ms=wall_ms, busy_ms=busy_us / 1e3, num_ops=len(ops),
                 top=_ranked(totals, counts), gaps=_ranked(gap_ms, gap_counts),
                 host=_ranked(host_ms, host_counts))


def profile_call(fn, trace_dir: str) -> Profile:
  """Runs `fn()` (which must wait for its results) under the profiler."""
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  t0 = time.perf_counter()
  try:
    fn()
  finally:
    wall_ms = 1e3 * (time.perf_counter() - t0)
    jax.profiler.stop_trace()
  path = max(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                       recursive=True), key=os.path.getmtime)
  with gzip.open(path) as f:
    trace = json.load(f)
  return summarize(trace["traceEvents"] if isinstance(trace, dict) else trace, wall_ms)
