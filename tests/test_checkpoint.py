"""Run checkpoints: exact round trip (onto other meshes too), refusal of non-finite state
and of arrays that differ from their checksums, retention."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from isojax import checkpoint as ckpt_lib
from isojax import sharding
from isojax.budget import Ledger
from isojax.errors import UnsafePathError


def _state(scale=1.0):
  return {"params": {"w": jnp.arange(6.0).reshape(2, 3) * scale,
                     "b": jnp.full((3,), 0.1, jnp.bfloat16)},
          "opt": {"count": jnp.array(7, jnp.int32), "mu": jnp.ones((2, 3)) / 3}}


def _host(step=4):
  return ckpt_lib.HostState(step=step, loader={"epoch": 1, "index": 5},
                            ledger=Ledger(rollouts=64, tokens=300, updates=step),
                            consecutive_skips=1,
                            rng=tuple(ckpt_lib.key_to_host(jax.random.key(3))))


def test_round_trip_is_bitwise(tmp_path):
  ck = ckpt_lib.RunCheckpointer(tmp_path / "ckpt", max_to_keep=2)
  state = _state(1.0 / 7.0)  # non-representable decimals: would show any text round-off
  host = _host()
  ck.save(4, state, host)
  assert ck.latest_step() == 4
  template = jax.tree.map(jnp.zeros_like, state)
  restored, host2 = ck.restore(4, template)
  ck.close()
  assert host2 == host
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  key = ckpt_lib.key_from_host(host2.rng)
  np.testing.assert_array_equal(jax.random.key_data(key),
                                jax.random.key_data(jax.random.key(3)))


def test_refuses_non_finite_state(tmp_path):
  ck = ckpt_lib.RunCheckpointer(tmp_path / "ckpt", max_to_keep=2)
  state = _state()
  state["params"]["w"] = state["params"]["w"].at[1, 2].set(jnp.nan)
  with pytest.raises(ckpt_lib.NonFiniteStateError, match=r"step 3.*\['params'\]\['w'\]"):
    ck.save(3, state, _host(3))
  assert ck.latest_step() is None
  state["params"]["w"] = jnp.ones((2, 3))
  state["opt"]["mu"] = state["opt"]["mu"].at[0, 0].set(jnp.inf)
  with pytest.raises(ckpt_lib.NonFiniteStateError, match="mu"):
    ck.save(3, state, _host(3))
  assert ck.latest_step() is None and not list((tmp_path / "ckpt").glob("3*"))


def test_keeps_only_the_newest(tmp_path):
  ck = ckpt_lib.RunCheckpointer(tmp_path / "ckpt", max_to_keep=2)
  for step in (2, 4, 6):
    ck.save(step, _state(step), _host(step))
  assert ck.all_steps() == [4, 6]
  restored, host = ck.restore(4, _state())
  assert host == _host(4)
  np.testing.assert_array_equal(restored["params"]["w"], _state(4)["params"]["w"])


def test_host_state_of_another_layout_is_named():
  assert ckpt_lib.HostState.from_json(_host().to_json()) == _host()
  with pytest.raises(ValueError, match=r"host state has keys \['loader', 'step'\]"):
    ckpt_lib.HostState.from_json({"step": 4, "loader": {}})


def test_restores_onto_another_mesh(tmp_path):
  mesh8 = sharding.make_mesh(data=1, fsdp=8, tensor=1)
  mesh222 = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  w = np.arange(64.0, dtype=np.float32).reshape(8, 8) / 7.0
  ck = ckpt_lib.RunCheckpointer(tmp_path / "ckpt", max_to_keep=2)
  ck.save(4, {"w": jax.device_put(w, NamedSharding(mesh8, P("fsdp", None)))}, _host())
  template = {"w": jax.device_put(np.zeros_like(w), NamedSharding(mesh222, P("fsdp", "tensor")))}
  restored, _ = ck.restore(4, template)
  assert restored["w"].sharding.spec == P("fsdp", "tensor")
  np.testing.assert_array_equal(np.asarray(restored["w"]), w)


def test_a_byte_changed_on_disk_is_refused_not_restored(tmp_path):
  state = {"w": jax.random.normal(jax.random.key(1), (256, 256)), "step": jnp.array(2)}
  ck = ckpt_lib.RunCheckpointer(tmp_path / "ckpt", max_to_keep=2)
  ck.save(2, state, _host(2))
  data = max((p for p in (tmp_path / "ckpt" / "2" / "state").rglob("*") if p.is_file()),
             key=lambda p: p.stat().st_size)
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0xFF  # a compressed chunk that still decodes, to other numbers
  data.write_bytes(bytes(raw))
  with pytest.raises(ValueError, match=r"checkpoint 2 .* cannot be restored .*\['w'\]"):
    ck.restore(2, jax.tree.map(jnp.zeros_like, state))


def test_template_of_another_dtype_is_refused(tmp_path):
  ck = ckpt_lib.RunCheckpointer(tmp_path / "ckpt", max_to_keep=2)
  ck.save(4, _state(), _host())
  template = _state()
  template["opt"]["mu"] = template["opt"]["mu"].astype(jnp.bfloat16)
  with pytest.raises(ValueError, match=r"\['opt'\]\['mu'\] \(saved as float32\(2, 3\), "
                     r"restored as bfloat16\(2, 3\)\)"):
    ck.restore(4, template)


def test_a_step_directory_under_another_steps_name_is_refused(tmp_path):
  ck = ckpt_lib.RunCheckpointer(tmp_path / "ckpt", max_to_keep=2)
  with pytest.raises(ValueError, match="checkpoint 5 given the host state of step 4"):
    ck.save(5, _state(), _host(4))
  ck.save(4, _state(), _host(4))
  ck.close()
  shutil.copytree(tmp_path / "ckpt" / "4", tmp_path / "ckpt" / "8")
  ck = ckpt_lib.RunCheckpointer(tmp_path / "ckpt", max_to_keep=2)
  assert ck.latest_step() == 8
  with pytest.raises(ValueError, match=r"checkpoint 8 .* cannot be restored \(ValueError: its "
                     r"host state is that of step 4\); if it is damaged, remove .*8 to resume "
                     r"from step 4"):
    ck.restore(8, _state())


def test_a_step_linked_from_elsewhere_is_refused_before_any_work(tmp_path):
  ck = ckpt_lib.RunCheckpointer(tmp_path / "ckpt", max_to_keep=2)
  for step in (2, 4):
    ck.save(step, _state(step), _host(step))
  ck.close()
  # Step 2 moved to other storage and linked back: deleting it as an old step would
  # fail after the next save, at every checkpoint of the run.
  shutil.move(tmp_path / "ckpt" / "2", tmp_path / "archive")
  (tmp_path / "ckpt" / "2").symlink_to(tmp_path / "archive")
  with pytest.raises(UnsafePathError, match=r"ckpt holds checkpoint steps that are symbolic "
                     r"links \(2\).*replace each with the directory it points to"):
    ckpt_lib.RunCheckpointer(tmp_path / "ckpt", max_to_keep=2)
  assert (tmp_path / "archive" / "state").is_dir()
