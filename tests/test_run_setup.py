"""build_parts names the config field of a model directory that is not there."""

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
