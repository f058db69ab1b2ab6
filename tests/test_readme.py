"""Every command in README.md is run by a test (from the README's own text) or by make.

The tests named here take their command from README.md through the `readme`
fixture, so an edited command is what gets tested; a new command needs a test
and an entry here.
"""

VLLM_BLOCK = "tests/rollout/test_vllm_server.py::test_readme_commands_serve_a_tiny_run_and_stop"
RUN_BY = {  # the start of a README command -> what runs it
  "make demo": "make demo itself; tests/test_demo.py runs launch/demo.py --smoke",
  "make test": ".ci/run (CI)",
  "pip install -e": "tests/test_packaging.py (each extra imports what its modules need)",
  "python -m isojax.main --config=experiments/tiny.py:":
    "tests/test_main.py::test_readme_one_point_command_trains_and_a_rerun_does_nothing",
  "python -m isojax.main --dry_run": "tests/test_main.py::test_readme_dry_run_prints_memory_and_writes_nothing",
  "python launch/sweep.py": "tests/test_sweep.py::test_readme_sweep_command_prints_its_table",
  "python -m isojax.analysis runs/tiny":
    "tests/analysis/test_cli.py::test_readme_analysis_command_and_snippet",
  "python -m isojax.analysis runs/scalerl":
    "tests/analysis/test_cli.py::test_readme_recipe_command_and_snippet",
  "bash launch/setup_vllm_venv.sh": VLLM_BLOCK,
  "python launch/vllm_server.py --model": VLLM_BLOCK,
  "python -m isojax.main --config=experiments/tiny.py --workdir=runs/tiny_vllm": VLLM_BLOCK,
  "python launch/vllm_server.py --stop": VLLM_BLOCK,
}


def test_every_readme_command_is_run_by_a_test(readme):
  for command in readme.commands:
    owners = [prefix for prefix in RUN_BY if command.startswith(prefix)]
    assert len(owners) == 1, f"README command {command!r} is run by {owners or 'no test'}"
  for prefix in RUN_BY:  # no stale entry for a command the README dropped
    assert any(c.startswith(prefix) for c in readme.commands), prefix


def test_readme_parsing_joins_continuations_and_drops_comments(readme):
  assert readme.command("make demo") == "make demo"
  assert readme.command("bash launch/setup_vllm_venv.sh") == "bash launch/setup_vllm_venv.sh"
  train = readme.command("python -m isojax.main --config=experiments/tiny.py --workdir")
  assert train.endswith("--config.sampler.vllm_url=http://127.0.0.1:8000"), train
