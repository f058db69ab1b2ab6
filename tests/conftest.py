"""Test environment: CPU only, 8 fake devices for sharding tests, no hub access.

These must be set before anything imports jax or transformers.
"""

import os
import re
import shlex
import sys

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")


class Readme:
  """README.md's code blocks, so that tests run its commands as written."""

  def __init__(self, path: str = README):
    with open(path) as f:
      text = f.read()
    self.blocks = [(m.group(1), m.group(2))
                   for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]
    self.bash_blocks = [self._split(body) for lang, body in self.blocks if lang == "bash"]
    self.commands = [cmd for block in self.bash_blocks for cmd in block]

  @staticmethod
  def _split(body: str) -> list[str]:
    """One string per command: continuation lines joined, comments dropped."""
    body = body.replace("\\\n", " ")
    lines = (re.sub(r"\s+#.*$", "", line).strip() for line in body.splitlines())
    return [" ".join(line.split()) for line in lines if line and not line.startswith("#")]

  def command(self, prefix: str) -> str:
    """The one README command that starts with `prefix`."""
    found = [c for c in self.commands if c.startswith(prefix)]
    assert len(found) == 1, f"README.md has {len(found)} commands starting {prefix!r}"
    return found[0]

  def block_of(self, prefix: str) -> list[str]:
    """Every command of the bash block that holds the command starting `prefix`."""
    found = [b for b in self.bash_blocks if any(c.startswith(prefix) for c in b)]
    assert len(found) == 1, f"README.md has {len(found)} blocks with {prefix!r}"
    return found[0]

  @staticmethod
  def argv(command: str, replace: dict[str, str]) -> list[str]:
    """`command` as an argv with its placeholders (runs/..., ports) replaced.

    Every placeholder must occur, so a README edit that drops one fails here.
    """
    for old, new in replace.items():
      assert old in command, f"{old!r} is not in the README command {command!r}"
      command = command.replace(old, new)
    argv = shlex.split(command)
    return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]

  def python(self, containing: str) -> str:
    """The one ```python block that contains `containing`."""
    found = [body for lang, body in self.blocks if lang == "python" and containing in body]
    assert len(found) == 1, f"README.md has {len(found)} python blocks with {containing!r}"
    return found[0]


@pytest.fixture(scope="session")
def readme() -> Readme:
  return Readme()

