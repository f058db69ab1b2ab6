"""The dry run's mesh: the run's devices need not be those of the machine that
compiles it (8 fake CPU devices here)."""

import os

import jax
import pytest

from experiments import tiny
from isojax import memory


def _config(**mesh):
  config = tiny.get_config("bp=8,n=4,budget=2048")
  config.mesh.update(mesh)
  return config


def test_dry_run_mesh_fills_the_devices_it_is_given():
  assert dict(memory.dry_run_mesh(_config(fsdp=-1)).shape) == {"data": 1, "fsdp": 8,
                                                                "tensor": 1}
  mesh = memory.dry_run_mesh(_config(data=2, fsdp=-1), num_devices=4)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 1}
  assert dict(memory.dry_run_mesh(_config(fsdp=2, tensor=2)).shape)["tensor"] == 2


def test_a_mesh_of_more_devices_than_here_names_the_flag_that_compiles_it():
  with pytest.raises(ValueError, match=r"fsdp=16 .* != 8 devices \(cpu\); .*"
                     r"--dry_run_devices=N compiles on N CPU devices"):
    memory.dry_run_mesh(_config(fsdp=16))
  with pytest.raises(ValueError, match=r"asked for 16 devices, but JAX has 8 cpu devices"):
    memory.dry_run_mesh(_config(fsdp=-1), num_devices=16)
  with pytest.raises(ValueError, match=r"ints >= 1 or -1 \(the rest\), got data=1 fsdp=0 "
                     r"tensor=1$"):
    memory.dry_run_mesh(_config(fsdp=0))  # not a count of devices: no hint


def test_use_cpu_devices_refuses_once_jax_started_with_fewer(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  assert len(jax.devices()) == 8  # started by the tests before: too late to add
  memory.use_cpu_devices(8)
  with pytest.raises(ValueError, match=r"JAX started with 8 cpu devices before 16"):
    memory.use_cpu_devices(16)
  with pytest.raises(ValueError, match=r"int >= 1, got 0"):
    memory.use_cpu_devices(0)
