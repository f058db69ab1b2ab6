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
is launch, host or synchronisation time), and the ops with the most total time.
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

  def table(self, n: int = 20) -> str:
    total = sum(ms for _, ms, _ in self.top) or 1.0
    lines = [f"device busy {self.busy_ms:.1f} ms of {self.wall_ms:.1f} ms wall "
             f"({self.busy_ms / max(self.wall_ms, 1e-9):.0%}), {self.num_ops} device ops",
             f"{'total ms':>10}{'share':>7}{'count':>8}{'us each':>9}  op"]
    for name, ms, count in self.top[:n]:
      lines.append(f"{ms:>10.2f}{ms / total:>7.1%}{count:>8}{1e3 * ms / count:>9.1f}  {name}")
    return "\n".join(lines)


def _leaves(ops: list[dict]) -> list[dict]:
  """The ops that enclose no other op of their thread: XLA:CPU traces a while or
  cond op around the ops of its body, which would count them twice."""
  by_thread = collections.defaultdict(list)
  for e in ops:
    by_thread[e["pid"], e.get("tid")].append(e)
  leaves = []
  for thread in by_thread.values():
    thread.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    for e, after in zip(thread, thread[1:] + [None]):
      if after is None or after["ts"] >= e["ts"] + e.get("dur", 0):
        leaves.append(e)
  return leaves


def summarize(events: list[dict], wall_ms: float) -> Profile:
  """A Profile of trace events (Chrome trace format, times in microseconds)."""
  procs = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  device_pids = {pid for pid, name in procs.items() if name.startswith("/device:")}
  ops = [e for e in events if e.get("ph") == "X" and (
      e["pid"] in device_pids if device_pids else "hlo_op" in e.get("args", {}))]
  ops = _leaves(ops)
  totals, counts = collections.Counter(), collections.Counter()
  for e in ops:
    name = e.get("args", {}).get("hlo_op", e["name"])
    totals[name] += e.get("dur", 0) / 1e3
    counts[name] += 1
  busy_us, end = 0.0, float("-inf")
  for start, stop in sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in ops):
    busy_us += max(0.0, stop - max(start, end))
    end = max(end, stop)
  top = [(name, ms, counts[name]) for name, ms in totals.most_common()]
  return Profile(wall_ms=wall_ms, busy_ms=busy_us / 1e3, num_ops=len(ops), top=top)


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
