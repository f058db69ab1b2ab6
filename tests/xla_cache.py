"""A persistent XLA compilation cache for a test module whose runs share shapes."""

import contextlib

import jax
from jax.experimental.compilation_cache import compilation_cache as cc

_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")


@contextlib.contextmanager
def persistent_compilation_cache(path: str):
  """Every executable compiled inside is stored under `path` (and loaded from it
  when the shapes repeat); a cached executable is the compiled one, so results
  are bitwise unchanged. The previous settings are restored on exit."""
  old = {k: getattr(jax.config, k) for k in _OPTIONS}
  for k, v in zip(_OPTIONS, (path, 0, 0)):
    jax.config.update(k, v)
  cc.reset_cache()
  try:
    yield path
  finally:
    for k, v in old.items():
      jax.config.update(k, v)
    cc.reset_cache()
