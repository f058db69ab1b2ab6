"""Dotted-field overrides of an experiment config, as `--config.a.b=v` flags set them."""


def set_fields(config, overrides: dict):
  """Sets each "a.b.c" key of `overrides` in `config`; returns `config`."""
  for key, value in overrides.items():
    node = config
    *path, last = key.split(".")
    for part in path:
      node = node[part]
    node[last] = value
  return config
