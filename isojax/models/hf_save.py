"""Decoder -> a Hugging Face directory (config.json + *.safetensors) that transformers
and vLLM load unchanged; the inverse of `isojax.models.hf_io.load_pretrained`.

Writing goes through `safetensors.numpy.save_file` one file at a time: the host
holds one file's tensors (at most `max_shard_bytes`) while it is written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from isojax.models.config import ModelConfig, as_dtype
from isojax.models.decoder import Decoder
from isojax.models.hf_io import INDEX_FILE, hf_param_table, hf_tensor_shape, variable


def _host(x: jax.Array) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x)


def _hf_entries(model: Decoder, cfg: ModelConfig, dtype: np.dtype) -> list[tuple]:
  """(HF name, HF shape, make) per tensor; `make()` gathers it to the host in HF layout."""
  entries = []
  for name, attr_path, transposed in hf_param_table(cfg):
    var = variable(model, attr_path)
    hf_shape = hf_tensor_shape(tuple(var.get_value().shape), attr_path, transposed)

    def make(var=var, hf_shape=hf_shape, transposed=transposed):
      a = _host(var.get_value())
      a = a.reshape(hf_shape[::-1]).T if transposed else a.reshape(hf_shape)
      return np.ascontiguousarray(a, dtype=dtype)

    entries.append((name, hf_shape, make))
  return entries


def _split_into_files(entries: list[tuple], itemsize: int, max_bytes: int) -> list[list]:
  """Consecutive runs of entries of at most `max_bytes` each (a larger tensor alone)."""
  files, size = [[]], 0
  for e in entries:
    nbytes = int(np.prod(e[1])) * itemsize
    if files[-1] and size + nbytes > max_bytes:
      files.append([])
      size = 0
    files[-1].append(e)
    size += nbytes
  return files


def _write_safetensors(file: Path, entries: list[tuple]) -> None:
  """One safetensors file of `entries`, made one by one, written and synced."""
  # transformers refuses files without the "format" metadata.
  save_file({name: make() for name, _, make in entries}, file, metadata={"format": "pt"})
  os.chmod(file, 0o644)  # it is created 0600: readable by a vLLM server as another user
  fd = os.open(file, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _write_weights(directory: Path, files: list[list], itemsize: int) -> None:
  """model.safetensors, or numbered files and model.safetensors.index.json."""
  if len(files) == 1:
    _write_safetensors(directory / "model.safetensors", files[0])
    return
  weight_map = {}
  for i, entries in enumerate(files):
    fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
    _write_safetensors(directory / fname, entries)
    weight_map.update({e[0]: fname for e in entries})
  total = sum(int(np.prod(e[1])) * itemsize for entries in files for e in entries)
  (directory / INDEX_FILE).write_text(json.dumps(
      {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _replace_directory(tmp: Path, path: Path) -> None:
  """Rename `tmp` to `path`; an existing `path` is renamed aside first, then deleted
  (a failure to delete it is a warning: the checkpoint is in place by then)."""
  if not path.exists():
    os.rename(tmp, path)
    return
  old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
  os.rename(path, old)
  os.rename(tmp, path)
  try:
    shutil.rmtree(old)
  except OSError as e:
    warnings.warn(f"saved {path}, but the checkpoint it replaced is left at {old}: {e}")


def _check_replaceable(path: Path) -> None:
  """A ValueError where replacing `path` whole would delete more than a checkpoint:
  a link or file, the working directory or one above it, or a directory holding
  subdirectories (neither isojax nor transformers writes any into a checkpoint,
  so they are the user's: a run directory, a repository, a home)."""
  if path.is_symlink() or (path.exists() and not path.is_dir()):
    what = f"a link to {os.readlink(path)}" if path.is_symlink() else "a file"
    raise ValueError(f"save_pretrained: {path} is {what}; it replaces a directory only "
                     f"(pass the directory itself)")
  if not path.exists():
    return
  cwd = Path.cwd()
  if path.resolve() in (cwd, *cwd.parents):
    raise ValueError(f"save_pretrained: {path} is the working directory or holds it; it "
                     f"replaces the directory whole: pass a new directory for the checkpoint")
  subdirectories = sorted(p.name for p in path.iterdir() if p.is_dir())
  if subdirectories:
    raise ValueError(f"save_pretrained: {path} holds subdirectories {subdirectories[:8]}, "
                     f"which replacing it whole would delete: pass a new directory for the "
                     f"checkpoint (or remove {path} first)")


def save_pretrained(model: Decoder, cfg: ModelConfig, path, *, dtype=None, tokenizer=None,
                    max_shard_bytes: int = 4 << 30) -> Path:
  """Write an HF directory that transformers and vLLM load unchanged.

  HF tensor names, [out, in] layout, config.json with `architectures`; tied
  embeddings write no lm_head.weight. Files over `max_shard_bytes` are split with a
  model.safetensors.index.json. Everything is written into a temp dir next to `path`
  and renamed in, so readers never see half a checkpoint; an existing `path` is
  renamed aside first and deleted after (refused, with a ValueError, if it holds
  subdirectories or the working directory: not a checkpoint). `tokenizer` (an
  isojax Tokenizer) is saved alongside if given. Multi-host: all processes must
  call; process 0 writes.
  """
  path = Path(os.path.abspath(path))  # "out/.." names its parent, not a child ".."
  _check_replaceable(path)
  dtype = np.dtype(as_dtype(cfg.param_dtype if dtype is None else dtype))
  written = cfg.to_hf_dict(dtype)
  own = model.cfg.to_hf_dict(dtype) if hasattr(model, "cfg") else written
  differ = sorted(k for k in written.keys() | own.keys() if written.get(k) != own.get(k))
  if differ:  # config.json must describe the weights written beside it
    raise ValueError(f"save_pretrained: cfg differs from the model's own config in "
                     f"{differ}; pass model.cfg")
  entries = _hf_entries(model, cfg, dtype)
  if jax.process_index() != 0:
    for _, _, make in entries:  # take part in the all-gathers, write nothing
      make()
    return path
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
  try:
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a vLLM server may run as another user
    (tmp / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    _write_weights(tmp, _split_into_files(entries, dtype.itemsize, max_shard_bytes),
                   dtype.itemsize)
    if tokenizer is not None:
      tokenizer.save_pretrained(tmp)
    _replace_directory(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return path
