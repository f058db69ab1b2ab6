"""Hugging Face checkpoints in and out: config.json + *.safetensors <-> Decoder.

Loading never builds the model on one device first: the model is created
abstractly (`nnx.eval_shape`), each parameter's sharding is derived from its logical
axis names, and each tensor is placed shard by shard straight from a memory-mapped
safetensors file (`jax.make_array_from_callback`, which also works multi-host).

The safetensors format (8-byte header length, JSON header, raw little-endian
bytes) is read and written here directly rather than through the `safetensors`
package because its numpy backend has no bfloat16; `ml_dtypes` (a JAX dependency)
does.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import struct
import tempfile
import uuid
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from isojax.models.config import ModelConfig, as_dtype
from isojax.models.decoder import Decoder
from isojax import sharding as sharding_lib

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": jnp.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
              "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
# Tensors some exporters add that carry no parameters of this model.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)
_INDEX_FILE = "model.safetensors.index.json"


def hf_param_table(cfg: ModelConfig) -> list[tuple[str, tuple, bool]]:
  """(HF tensor name, attribute path in Decoder, transposed [out,in] <-> [in,...])."""
  table = [("model.embed_tokens.weight", ("embed",), False),
           ("model.norm.weight", ("norm", "scale"), False)]
  if not cfg.tie_word_embeddings:
    table.append(("lm_head.weight", ("unembed",), True))
  for i in range(cfg.num_layers):
    pre, at = f"model.layers.{i}.", ("layers", i)
    table += [(pre + "input_layernorm.weight", at + ("input_norm", "scale"), False),
              (pre + "post_attention_layernorm.weight", at + ("post_attn_norm", "scale"),
               False)]
    for p in "qkvo":
      table.append((pre + f"self_attn.{p}_proj.weight", at + ("attn", f"{p}_kernel"), True))
    if cfg.attention_bias:
      for p in "qkv":
        table.append((pre + f"self_attn.{p}_proj.bias", at + ("attn", f"{p}_bias"), False))
    if cfg.qk_norm:
      for p in "qk":
        table.append((pre + f"self_attn.{p}_norm.weight",
                      at + ("attn", f"{p}_norm", "scale"), False))
    for p in ("gate", "up", "down"):
      table.append((pre + f"mlp.{p}_proj.weight", at + ("mlp", f"{p}_kernel"), True))
  return table


def _variable(model: nnx.Module, path: tuple) -> nnx.Variable:
  return functools.reduce(lambda o, k: o[k] if isinstance(k, int) else getattr(o, k), path, model)


def _hf_shape(param_shape: tuple, path: tuple, transposed: bool) -> tuple:
  """The HF tensor shape of a parameter: kernels are 2-D [out, in], biases flat."""
  if transposed:
    k = 2 if path[-1] == "o_kernel" else 1  # o_kernel [N, H, D] has two input axes
    return (int(np.prod(param_shape[k:])), int(np.prod(param_shape[:k])))
  if path[-1].endswith("_bias"):
    return (int(np.prod(param_shape)),)
  return tuple(param_shape)


# ----------------------------------------------------------------------------- reading


# The safetensors format caps the JSON header at 100 MB; a larger length field is
# a corrupt or foreign file, and must not be allocated.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def _read_header(file: Path) -> tuple[dict, int]:
  """(tensor entries, data start) of a safetensors file, checked against its size.

  Raises:
    ValueError: naming the file and what is wrong with it (too short, a header
      length past the end of the file, a header that is not a JSON object, or a
      tensor whose shape, dtype or byte range does not fit the file).
  """
  size = file.stat().st_size
  with open(file, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise ValueError(f"{file}: not a safetensors file ({size} bytes, shorter than "
                       f"the 8-byte header length)")
    (n,) = struct.unpack("<Q", raw)
    if n > min(size - 8, _MAX_HEADER_BYTES):
      raise ValueError(f"{file}: not a safetensors file or truncated: its header "
                       f"length field says {n} bytes but the file has {size - 8} after "
                       f"it (the format allows at most {_MAX_HEADER_BYTES})")
    try:
      header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{file}: unreadable safetensors header ({e})") from None
  if not isinstance(header, dict):
    raise ValueError(f"{file}: safetensors header is a JSON {type(header).__name__}, "
                     f"not an object")
  header.pop("__metadata__", None)
  data_bytes = size - 8 - n
  for name, info in header.items():
    _check_entry(file, name, info, data_bytes)
  return header, 8 + n


def _check_entry(file: Path, name: str, info, data_bytes: int) -> None:
  def bad(what):
    return ValueError(f"{file}: tensor {name!r} {what}")

  if not isinstance(info, dict):
    raise bad(f"has a header entry {info!r:.80} instead of an object")
  shape, offsets = info.get("shape"), info.get("data_offsets")
  if not isinstance(shape, list) or not all(
      isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
    raise bad(f"has shape {shape!r:.80}, not a list of non-negative integers")
  if not (isinstance(offsets, list) and len(offsets) == 2 and all(
      isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
    raise bad(f"has data_offsets {offsets!r:.80}, not [start, end]")
  start, end = offsets
  if not 0 <= start <= end <= data_bytes:
    raise bad(f"has bytes [{start}, {end}) but the file holds {data_bytes} bytes of "
              f"data (truncated?)")
  dtype = _ST_DTYPES.get(info.get("dtype"))
  if dtype is not None:
    need = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if end - start != need:
      raise bad(f"of shape {shape} and dtype {info['dtype']} needs {need} bytes but "
                f"has {end - start}")


def _tensor_index(path: Path) -> dict[str, tuple[Path, dict, int]]:
  """tensor name -> (file, header entry, data offset) over all checkpoint files."""
  index_file = path / _INDEX_FILE
  if index_file.exists():
    weight_map = json.loads(index_file.read_text())["weight_map"]
    files = sorted({path / f for f in weight_map.values()})
    missing = [str(f) for f in files if not f.exists()]
    if missing:
      raise ValueError(f"{index_file} lists files that do not exist: {missing}")
  else:
    files = sorted(path.glob("*.safetensors"))
  if not files:
    raise ValueError(f"{path}: no *.safetensors files")
  out = {}
  for f in files:
    header, base = _read_header(f)
    for name, info in header.items():
      out[name] = (f, info, base)
  return out


def _memmap(file: Path, info: dict, base: int) -> np.ndarray:
  dtype = np.dtype(_ST_DTYPES[info["dtype"]])
  start, end = info["data_offsets"]
  shape = tuple(info["shape"])
  if end == start:
    return np.zeros(shape, dtype)
  return np.memmap(file, dtype=dtype, mode="r", offset=base + start, shape=shape)


def load_pretrained(path, *, dtype=jnp.float32, mesh=None, rules=None, compute_dtype=None,
                    lm_head_fp32: bool = True, remat: str | bool = "none",
                    attention: str = "auto"):
  """Load a Llama/Qwen2/Qwen3 HF directory into a Decoder.

  Args:
    path: local directory with config.json and *.safetensors (single file or
      sharded with model.safetensors.index.json).
    dtype: parameter dtype (checkpoint tensors are cast to it).
    mesh: if given, every parameter is created already sharded on it.
    rules: logical -> mesh axis rules (default `isojax.sharding.DEFAULT_RULES`).
    compute_dtype: activation dtype (default: `dtype`).
    lm_head_fp32, remat, attention: see ModelConfig.

  Returns:
    (model, cfg). Raises ValueError for a missing directory/config.json, an
    unsupported architecture, and a missing, misshapen or unexpected tensor.
    Unexpected tensors are an error (not a warning) because they usually mean the
    config does not describe the weights (e.g. biases the config says are absent),
    which would otherwise load "fine" and give wrong logits.
  """
  path = Path(path)
  if not path.is_dir():
    raise ValueError(f"checkpoint directory {path} does not exist")
  config_file = path / "config.json"
  if not config_file.exists():
    raise ValueError(f"{config_file} not found: not a Hugging Face model directory")
  try:
    hf = json.loads(config_file.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{config_file}: invalid JSON ({e})") from None
  cfg = ModelConfig.from_hf_dict(hf, dtype=dtype if compute_dtype is None else compute_dtype,
                                 param_dtype=dtype, lm_head_fp32=lm_head_fp32, remat=remat,
                                 attention=attention)
  tensors = _tensor_index(path)
  table = hf_param_table(cfg)
  missing = [n for n, _, _ in table if n not in tensors]
  if missing:
    raise ValueError(f"{path}: tensor {missing[0]!r} is missing from the checkpoint "
                     f"({len(missing)} missing in all: {missing[:8]})")
  expected = {n for n, _, _ in table}
  extra = sorted(n for n in tensors if n not in expected)
  ignorable = [n for n in extra if n.endswith(_IGNORABLE_SUFFIXES)
               or (n == "lm_head.weight" and cfg.tie_word_embeddings)]
  extra = [n for n in extra if n not in ignorable]
  if extra:
    raise ValueError(f"{path}: {len(extra)} unexpected tensors for {cfg.architecture} "
                     f"(config and weights disagree?): {extra[:8]}")
  if ignorable:
    warnings.warn(f"{path}: ignoring tensors {ignorable} (tied embeddings / RoPE buffers)")
  model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  rules = sharding_lib.DEFAULT_RULES if rules is None else rules
  param_dtype = np.dtype(cfg.param_dtype)
  for name, attr_path, transposed in table:
    var = _variable(model, attr_path)
    shape = tuple(var.get_value().shape)
    hf_shape = _hf_shape(shape, attr_path, transposed)
    file, info, base = tensors[name]
    found = tuple(info["shape"])
    if found != hf_shape:
      raise ValueError(f"{file.name}: tensor {name!r} has shape {list(found)}, expected "
                       f"{list(hf_shape)} for config {config_file}")
    if info["dtype"] not in _ST_DTYPES:
      raise ValueError(f"{file.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
    hf_arr = _memmap(file, info, base)
    arr = hf_arr.T.reshape(shape) if transposed else hf_arr.reshape(shape)
    var.set_value(_place(arr, param_dtype, var, mesh, rules))
  return model, cfg


def _place(arr: np.ndarray, dtype: np.dtype, var: nnx.Variable, mesh, rules) -> jax.Array:
  # Always copy out of the memory map: an array aliasing the file would break (SIGBUS)
  # if the checkpoint were rewritten in place while the model is alive.
  if mesh is None:
    return jnp.asarray(np.array(arr, dtype=dtype, copy=True))
  names = var.get_metadata().get("out_sharding")
  spec = sharding_lib.spec_for(names, arr.shape, mesh, rules)
  sharding = jax.sharding.NamedSharding(mesh, spec)
  # Each device reads only its own slice of the memory-mapped file.
  return jax.make_array_from_callback(
      arr.shape, sharding, lambda idx: np.array(arr[idx], dtype=dtype, copy=True))


# ----------------------------------------------------------------------------- writing


def _host(x: jax.Array) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x)


def _write_safetensors(file: Path, entries: list[tuple[str, tuple, np.dtype, callable]]):
  """Write tensors one at a time (each `make()` is called once, then freed)."""
  header, offset = {}, 0
  for name, shape, dtype, _ in entries:
    nbytes = int(np.prod(shape)) * dtype.itemsize
    header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  header["__metadata__"] = {"format": "pt"}  # transformers refuses files without it
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
  with open(file, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, shape, dtype, make in entries:
      arr = np.ascontiguousarray(make(), dtype=dtype)
      assert arr.shape == tuple(shape), (name, arr.shape, shape)
      f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
    f.flush()
    os.fsync(f.fileno())


def save_pretrained(model: Decoder, cfg: ModelConfig, path, *, dtype=None, tokenizer=None,
                    max_shard_bytes: int = 4 << 30) -> Path:
  """Write an HF directory that transformers and vLLM load unchanged.

  HF tensor names, [out, in] layout, config.json with `architectures`; tied
  embeddings write no lm_head.weight. Files over `max_shard_bytes` are split with a
  model.safetensors.index.json. Everything is written into a temp dir next to `path`
  and renamed in, so readers never see half a checkpoint; an existing `path` is
  renamed aside first and deleted after. `tokenizer` (an isojax Tokenizer) is saved
  alongside if given. Multi-host: all processes must call; process 0 writes.
  """
  path = Path(path).absolute()
  dtype = np.dtype(as_dtype(cfg.param_dtype if dtype is None else dtype))
  entries = []
  for name, attr_path, transposed in hf_param_table(cfg):
    var = _variable(model, attr_path)
    shape = tuple(var.get_value().shape)
    hf_shape = _hf_shape(shape, attr_path, transposed)

    def make(var=var, hf_shape=hf_shape, transposed=transposed):
      a = _host(var.get_value())
      a = a.reshape(hf_shape[::-1]).T if transposed else a.reshape(hf_shape)
      return a.astype(dtype)

    entries.append((name, hf_shape, dtype, make))
  shards, size = [[]], 0
  for e in entries:
    nbytes = int(np.prod(e[1])) * dtype.itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(e)
    size += nbytes
  if jax.process_index() != 0:
    for e in entries:  # take part in the all-gathers, write nothing
      e[3]()
    return path
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
  try:
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a vLLM server may run as another user
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(dtype), indent=2,
                                                sort_keys=True) + "\n")
    if len(shards) == 1:
      _write_safetensors(tmp / "model.safetensors", shards[0])
    else:
      weight_map = {}
      for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(tmp / fname, shard)
        weight_map.update({e[0]: fname for e in shard})
      total = sum(int(np.prod(e[1])) * dtype.itemsize for e in entries)
      (tmp / _INDEX_FILE).write_text(json.dumps(
          {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if tokenizer is not None:
      tokenizer.save_pretrained(tmp)
    if path.exists():
      old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
      os.rename(path, old)
      os.rename(tmp, path)
      shutil.rmtree(old)
    else:
      os.rename(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return path
