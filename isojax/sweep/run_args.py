"""The arguments after `--` that a sweep appends to every run: which are refused
(what the launcher sets per point) and the launcher's view of the rest."""

from __future__ import annotations

import ast
from collections.abc import Sequence

from ml_collections.config_flags import tuple_parser

from isojax import run_config


# Run flags the launcher sets for every point -> (what they set, the launcher flag that
# sets it instead). The run's flag parser lets the last copy of a flag win, and a
# pass-through argument comes after the launcher's own, so a copy here would make the
# run train something other than the point its directory is named after, or make
# every point train in one directory.
RESERVED_RUN_FLAGS = {
    "workdir": ("the run directory", "--root (each point runs in <root>/<point name>)"),
    "config": ("the experiment file and its bp, n and budget",
               "the launcher's --config, --bp, --n and --budget"),
    "config.seed": ("the seed", "--seeds"),
    "config.bp": ("Bp", "--bp"),
    "config.n": ("n", "--n"),
    "config.budget": ("the budget", "--budget"),
}


def check_run_args(args: Sequence[str]) -> None:
  """Refuses run arguments that set what the launcher sets for each point.

  Every spelling the run's flag parser (absl) accepts is caught: one or two leading
  dashes, `--flag=value` and `--flag value`. A flag file is refused too, since what
  it sets cannot be checked here.

  Raises:
    ValueError: naming the first such argument and the launcher flag to use instead.
  """
  for arg in args:
    if not arg.startswith("-"):
      continue
    name = _flag_name(arg)
    if name == "flagfile":
      raise ValueError(f"run argument {arg!r}: the launcher cannot check what a flag "
                       "file sets for each point; pass its arguments after -- instead")
    if name in RESERVED_RUN_FLAGS:
      what, instead = RESERVED_RUN_FLAGS[name]
      raise ValueError(f"run argument {arg!r} sets {what}, which the launcher sets for "
                       f"each point: use {instead}")


def _flag_name(arg: str) -> str:
  """The flag an argument sets, in any spelling absl accepts: `-x`, `--x`, `--x=v`."""
  return (arg[2:] if arg.startswith("--") else arg[1:]).partition("=")[0]


def b_max_args(b_max, args: Sequence[str]) -> tuple[str, ...]:
  """`args` with the launcher's --b_max passed on as `--config.b_max`: each run checks
  Bp * n against its own config.b_max, so it must hold the bound the grid was planned
  with. None: `args` unchanged (the config's b_max, or one they set, plans the grid).

  Raises:
    ValueError: when `args` set config.b_max too (two bounds, one of them ignored).
  """
  if b_max is None:
    return tuple(args)
  for arg in args:
    if arg.startswith("-") and _flag_name(arg) == "config.b_max":
      raise ValueError(f"run argument {arg!r} sets b_max, which the launcher's --b_max="
                       f"{b_max} sets for every run: give one of them")
  if isinstance(b_max, float) and b_max.is_integer():
    b_max = int(b_max)
  return (f"--config.b_max={b_max}", *args)


def apply_overrides(config, args: Sequence[str]):
  """The launcher's view of `--config.a.b=value` run arguments (the run parses them
  itself): sets each on `config` as the run's flag parser would, so that the dry-run
  table and the vLLM decision see them, and a typo fails before N runs start.

  Both spellings absl accepts are read: `--config.x=VALUE` and `--config.x VALUE` (a
  bool field alone means true). Tuple fields take a literal (`(1, 2, 4)`, or one
  element), repeated copies adding up as in the run; other structured fields take a
  Python literal.

  Raises:
    ValueError: naming the argument, for an unknown field, a missing value or a value
      of the wrong type.
  """
  args, tuples = list(args), {}
  for i, arg in enumerate(args):
    if not arg.startswith("--config."):
      continue
    path, sep, raw = arg[len("--config."):].partition("=")
    *parents, leaf = path.split(".")
    node = config
    for part in parents:
      node = node.get(part) if hasattr(node, "get") else None
    if node is None or not hasattr(node, "get") or leaf not in node:
      raise ValueError(f"run argument {arg!r}: no config field {path!r} in the "
                       "experiment file (expected --config.FIELD=VALUE)")
    # The field's declared type, which a None placeholder (rl.clip_dual) has too.
    kind = node.get_type(leaf) if hasattr(node, "get_type") else type(node[leaf])
    if not sep:  # absl's `--flag VALUE`: the next argument is the value
      if issubclass(kind, bool):
        raw = "true"
      elif i + 1 < len(args):
        raw, arg = args[i + 1], f"{arg} {args[i + 1]}"
        args[i + 1] = ""  # consumed: not read as an argument of its own
      else:
        raise ValueError(f"run argument {arg!r} has no value (expected "
                         f"--config.{path}=VALUE)")
    value = _parse_as(kind, raw, arg)
    if issubclass(kind, tuple):
      value = tuples[path] = tuples.get(path, ()) + value
    try:
      node[leaf] = value
    except TypeError as e:  # ConfigDict's type check: a list field given a string
      raise ValueError(f"run argument {arg!r}: {e}") from e
    if value is None:
      run_config.check_none_override(config, path)
  return config


def _parse_as(kind: type, raw: str, arg: str):
  """`raw` as the run's flag parser reads a value of a `kind` field."""
  try:
    if issubclass(kind, bool):
      if raw.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"not a bool: {raw!r}")
      return raw.lower() in ("true", "1")
    if issubclass(kind, (int, float)) and raw.strip().lower() == "none":
      return None  # an optional field turned off (checked by the caller)
    if issubclass(kind, int):
      return int(raw)
    if issubclass(kind, float):
      return float(raw)
    if issubclass(kind, str):
      return raw
    if issubclass(kind, tuple):
      return tuple_parser.TupleParser().parse(raw)
  except ValueError as e:
    raise ValueError(f"run argument {arg!r}: {e}") from e
  try:  # lists, dicts, untyped fields: a literal, else the text (as in the run)
    return ast.literal_eval(raw)
  except (SyntaxError, ValueError):
    return raw
