"""build_parts names the config field of a model directory or mesh it cannot use."""

import types

import pytest

from experiments import easy_ppo, tiny
from isojax import run_plan as run_plan_lib, run_setup


@pytest.mark.parametrize("make_config, field", [
    (lambda: tiny.get_config("bp=4,n=2,budget=32"), "model.path"),
    (lambda: easy_ppo.get_config("smoke"), "critic.path"),  # a PPO run loads a critic
], ids=["model", "critic"])
def test_a_missing_model_directory_is_named_by_its_field(tmp_path, make_config, field):
  config = make_config()
  missing = tmp_path / "no-such-model"
  section, key = field.split(".")
  config[section][key] = str(missing)
  plan = run_plan_lib.plan_run(config)
  with pytest.raises(ValueError, match=rf"^config\.{field}='{missing}' is not a directory"):
    run_setup.build_parts(config, plan)


def test_a_mesh_leaving_out_a_process_is_refused():
  # Two processes of 2 devices each, as jax.devices() lists them in a 2-host run.
  devices = [types.SimpleNamespace(id=i, process_index=i // 2) for i in range(4)]
  config = tiny.get_config("bp=4,n=2,budget=32")
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 2, 1
  with pytest.raises(ValueError, match=r"config.mesh data=1 x fsdp=2 x tensor=1 takes 2 of "
                     r"the 4 devices of this 2-process run and none of process 1"):
    run_setup._mesh(config, devices)  # pylint: disable=protected-access
  run_setup.check_every_process_in(devices[1:3], devices, config)  # one of each: fine
