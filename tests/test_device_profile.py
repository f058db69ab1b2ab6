"""bench/device_profile.py: the op breakdown the GPU benches print with --profile."""

import jax
import jax.numpy as jnp
import pytest

from bench import device_profile


def meta(pid, name):
  return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}


def op(pid, name, ts, dur, hlo_op=None, tid=1):
  args = {"hlo_op": hlo_op} if hlo_op else {}
  return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def test_device_ops_busy_union_and_totals():
  events = [
      meta(1, "/host:CPU"), meta(7, "/device:GPU:0"),
      op(1, "python call", 0, 1000),  # host: not a device op
      # A host loop around a synchronisation and two launches: self time only.
      op(1, "WhileThunk", 100, 500, tid=3), op(1, "cuStreamSynchronize", 150, 300, tid=3),
      op(1, "cuLaunchKernel", 500, 20, tid=3), op(1, "cuLaunchKernel", 550, 20, tid=3),
      op(7, "gemm_fusion_dot_1", 0, 100), op(7, "gemm_fusion_dot_1", 300, 100),
      op(7, "loop_add_fusion", 350, 100, tid=2),  # overlaps the second dot: another stream
      op(7, "nvjet_sm90_kernel", 600, 50, hlo_op="custom-call.3"),  # named by its HLO op
      op(7, "while.1", 700, 300), op(7, "loop_body_fusion", 750, 80),  # nested: inner only
  ]
  p = device_profile.summarize(events, wall_ms=1.0)
  assert p.num_ops == 5
  # [0,100] + [300,450] + [600,650] + [750,830]
  assert p.busy_ms == pytest.approx(0.1 + 0.15 + 0.05 + 0.08)
  assert p.top == [("gemm_fusion_dot_1", pytest.approx(0.2), 2),
                   ("loop_add_fusion", pytest.approx(0.1), 1),
                   ("loop_body_fusion", pytest.approx(0.08), 1),
                   ("custom-call.3", pytest.approx(0.05), 1)]
  # Idle spans named by the op that ended last before them and the op after.
  assert p.gaps == [("gemm_fusion_dot_1 -> gemm_fusion_dot_1", pytest.approx(0.2), 1),
                    ("loop_add_fusion -> custom-call.3", pytest.approx(0.15), 1),
                    ("custom-call.3 -> loop_body_fusion", pytest.approx(0.1), 1)]
  assert p.host == [("python call", pytest.approx(1.0), 1),
                    ("cuStreamSynchronize", pytest.approx(0.3), 1),
                    ("WhileThunk", pytest.approx(0.16), 1),
                    ("cuLaunchKernel", pytest.approx(0.04), 2)]
  table = p.table(2)
  assert "device busy 0.4 ms of 1.0 ms wall (38%), 5 device ops" in table
  ops, gaps, host = table.split("total ms")[1:]
  assert "gemm_fusion_dot_1" in ops and "custom-call.3" not in ops
  assert "loop_add_fusion -> custom-call.3" in gaps and "custom-call.3 ->" not in gaps
  assert "cuStreamSynchronize" in host and "WhileThunk" not in host


def test_a_cpu_call_is_traced_and_its_matmuls_outweigh_its_tanh(tmp_path):
  a = jnp.ones((128, 4096), jnp.float32)
  b = jnp.ones((4096, 128), jnp.float32) / 4096
  f = jax.jit(lambda a, b: jnp.tanh(a @ b) @ a)
  f(a, b).block_until_ready()
  p = device_profile.profile_call(lambda: f(a, b).block_until_ready(), str(tmp_path))
  assert p.num_ops >= 3 and 0 < p.busy_ms <= p.wall_ms
  assert p.busy_ms <= sum(ms for _, ms, _ in p.top) + 1e-6
  # Two matmuls of 134 MFLOP each (XLA:CPU names them by their fusion) against a
  # tanh of 16k elements: 8,192 FLOPs per tanh, so a busy machine's noise cannot
  # reverse the order (at 512^3 against 262k tanh it once did).
  assert "tanh" in p.top[-1][0] and p.top[0][1] > 3 * p.top[-1][1], p.table()
