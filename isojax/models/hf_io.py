"""Hugging Face checkpoints in and out: config.json + *.safetensors <-> Decoder.

Loading never builds the model on one device first: the model is created
abstractly (`nnx.eval_shape`), each parameter's sharding is derived from its logical
axis names, and each tensor is placed shard by shard (`jax.make_array_from_callback`,
which also works multi-host). The files are read with `safetensors.safe_open`,
lazily: a device's callback reads only the rows of its own block, so the host holds
at most one tensor (in a few transient copies) besides the model, never the
checkpoint. A sharded checkpoint (model.safetensors.index.json) is read file by
file. The library checks each header (its length, its JSON, every tensor's byte
range) before any tensor is read; its errors are re-raised naming the file.

Files are read with the library's "pread" backend, not its default "mmap": a
memory map keeps every page read resident until the file is closed, so loading a
642 MiB float32 checkpoint peaked at 1.6 GiB resident with "mmap" and at 0.98 GiB
with "pread" (0.19 GiB of it the runtime), at the same speed. Both the backend and
numpy bfloat16 need safetensors >= 0.8.

Writing is `isojax.models.hf_save`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from isojax.models.config import ModelConfig, as_dtype
from isojax.models.decoder import Decoder
from isojax import sharding as sharding_lib

# Tensor dtypes a checkpoint may store (safetensors' names): every parameter is a
# float; an integer or bool tensor (a quantised export) would be cast, not dequantised.
_LOADABLE_DTYPES = ("F64", "F32", "F16", "BF16")
# Tensors some exporters add that carry no parameters of this model.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def hf_param_table(cfg: ModelConfig) -> list[tuple[str, tuple, bool]]:
  """(HF tensor name, attribute path in Decoder, transposed [out,in] <-> [in,...])."""
  # Names as in the state dicts of transformers' LlamaForCausalLM, Qwen2ForCausalLM and
  # Qwen3ForCausalLM (transformers/models/{llama,qwen2,qwen3}/modeling_*.py).
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


def variable(model: nnx.Module, path: tuple) -> nnx.Variable:
  return functools.reduce(lambda o, k: o[k] if isinstance(k, int) else getattr(o, k), path, model)


def _axis_groups(param_shape: tuple, path: tuple, transposed: bool) -> tuple[int, ...]:
  """How many parameter axes each axis of the HF tensor, transposed back, holds.

  Kernels are 2-D [out, in] in HF: transposed back, [in, out] where o_kernel
  [N, H, D] has two input axes and the others one. Biases [N, H] are flat.
  """
  if transposed:
    k = 2 if path[-1] == "o_kernel" else 1
    return (k, len(param_shape) - k)
  if path[-1].endswith("_bias"):
    return (len(param_shape),)
  return (1,) * len(param_shape)


def hf_tensor_shape(param_shape: tuple, path: tuple, transposed: bool) -> tuple:
  """The HF tensor shape of a parameter: kernels are 2-D [out, in], biases flat."""
  dims, start = [], 0
  for n in _axis_groups(param_shape, path, transposed):
    dims.append(int(np.prod(param_shape[start:start + n])))
    start += n
  return tuple(dims[::-1]) if transposed else tuple(dims)


# ----------------------------------------------------------------------------- reading


def _open_safetensors(file: Path, stack: contextlib.ExitStack):
  """`safe_open(file)` kept open by `stack`; a file the library refuses is named."""
  try:
    return stack.enter_context(safe_open(str(file), framework="numpy", backend="pread"))
  except SafetensorError as e:
    raise ValueError(f"{file}: not a valid safetensors file ({file.stat().st_size} bytes; "
                     f"truncated, or another format?): {e}") from None


def _checkpoint_files(path: Path) -> tuple[list[Path], dict[str, str]]:
  """(the *.safetensors files of a checkpoint: those its index names, else all, but
  model.safetensors alone beside an index; the index's tensor -> file map, or {}).

  model.safetensors wins over an index as in transformers: a single-file save into
  a directory that held a sharded checkpoint leaves the old index (and shards) behind.
  Without an index every file is read, so that a stray copy of a tensor is refused.
  """
  index_file = path / INDEX_FILE
  if index_file.exists() and (path / SINGLE_FILE).exists():
    warnings.warn(f"{path}: both {SINGLE_FILE} and {INDEX_FILE}; reading {SINGLE_FILE}, "
                  f"as transformers does (the index is likely left from an earlier save)")
    return [path / SINGLE_FILE], {}
  if not index_file.exists():
    files = sorted(path.glob("*.safetensors"))
    if not files:
      raise ValueError(f"{path}: no *.safetensors files")
    return files, {}
  try:
    weight_map = json.loads(index_file.read_text())["weight_map"]
    files = sorted({path / f for f in weight_map.values()})
  except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
    raise ValueError(f"{index_file}: not a safetensors index with a 'weight_map' object "
                     f"({type(e).__name__}: {e})") from None
  missing = [str(f) for f in files if not f.exists()]
  if missing:
    raise ValueError(f"{index_file} lists files that do not exist: {missing}")
  if not files:
    raise ValueError(f"{index_file}: its weight_map names no files")
  return files, weight_map


def _open_checkpoint(path: Path, stack: contextlib.ExitStack
                     ) -> tuple[dict[str, tuple[Path, object]], dict[str, str]]:
  """(tensor name -> (file, open safetensors handle) over all checkpoint files,
  the index's tensor name -> file name map or {})."""
  tensors = {}
  files, weight_map = _checkpoint_files(path)
  for file in files:
    handle = _open_safetensors(file, stack)
    for name in handle.keys():
      if name in tensors:
        raise ValueError(f"{path}: tensor {name!r} is in both {tensors[name][0].name} and "
                         f"{file.name}; which one the weights are is ambiguous")
      tensors[name] = (file, handle)
  return tensors, weight_map


def _check_names(path: Path, cfg: ModelConfig, table: list, names: dict,
                 weight_map: dict[str, str]) -> None:
  """Every table tensor present; nothing else but ignorable extras (warned about).

  `names` maps each tensor to (its file, ...); `weight_map` is the index's, which
  says where a missing tensor should have been.

  Unexpected tensors are an error (not a warning) because they usually mean the
  config does not describe the weights (e.g. biases the config says are absent),
  which would otherwise load "fine" and give wrong logits.
  """
  missing = [n for n, _, _ in table if n not in names]
  if missing:
    where = (f"from {weight_map[missing[0]]}, where {INDEX_FILE} puts it"
             if missing[0] in weight_map else "from the checkpoint")
    raise ValueError(f"{path}: tensor {missing[0]!r} is missing {where} "
                     f"({len(missing)} missing in all: {missing[:8]})")
  expected = {n for n, _, _ in table}
  extra = sorted(n for n in names if n not in expected)
  if cfg.tie_word_embeddings and "lm_head.weight" in extra:
    _check_tied_head(path, names)
  ignorable = [n for n in extra if n.endswith(_IGNORABLE_SUFFIXES)
               or (n == "lm_head.weight" and cfg.tie_word_embeddings)]
  extra = [n for n in extra if n not in ignorable]
  if extra:
    raise ValueError(f"{path}: {len(extra)} unexpected tensors for {cfg.architecture} "
                     f"(config and weights disagree?): "
                     f"{[f'{n} ({names[n][0].name})' for n in extra[:8]]}")
  if ignorable:
    warnings.warn(f"{path}: ignoring tensors {ignorable} (tied embeddings / RoPE buffers)")


def _check_tied_head(path: Path, tensors: dict, rows: int = 4096) -> None:
  """A tied config's checkpoint may carry lm_head.weight only as a copy of the
  embedding: stacks disagree on which one a different head means (transformers 5
  unties and uses it, vLLM and transformers 4 use the embedding). Compared in
  blocks of `rows`, so the host never holds either tensor whole."""
  (head_file, head), (embed_file, embed) = (tensors["lm_head.weight"],
                                            tensors["model.embed_tokens.weight"])
  head, embed = head.get_slice("lm_head.weight"), embed.get_slice("model.embed_tokens.weight")
  same, n = head.get_shape() == embed.get_shape(), head.get_shape()[0]
  for start in range(0, n if same else 0, rows):
    block = slice(start, min(start + rows, n))  # safetensors refuses a slice past the end
    if not np.array_equal(head[block], embed[block]):
      same = False
      break
  if not same:
    raise ValueError(f"{path}: config.json ties word embeddings, but lm_head.weight "
                     f"({head_file.name}) differs from model.embed_tokens.weight "
                     f"({embed_file.name}); set tie_word_embeddings in config.json to what "
                     f"the weights mean (false: use lm_head)")


def _read_block(tensor_slice, param_shape: tuple, groups: tuple[int, ...], transposed: bool,
                index: tuple) -> np.ndarray:
  """Block `index` (slices over the parameter's axes) of a parameter, read from its HF
  tensor (a `safe_open` slice) without reading the rest of it.

  Each HF axis holds a group of parameter axes (`_axis_groups`). Along it, the
  range that covers the group's first-axis slice with its inner axes whole is
  read; the inner axes are cut after reshaping to the parameter's layout.
  """
  ranges, block_shape, inner_index, start = [], [], [], 0
  for n in groups:
    lo, hi, _ = index[start].indices(param_shape[start])
    inner = param_shape[start + 1:start + n]
    inner_size = int(np.prod(inner))
    ranges.append(slice(lo * inner_size, hi * inner_size))
    block_shape += [hi - lo, *inner]
    inner_index += [slice(None), *index[start + 1:start + n]]
    start += n
  if 0 in block_shape:  # safetensors refuses to slice an empty range; the caller casts
    return np.zeros(block_shape, np.float32)[tuple(inner_index)]
  hf_block = tensor_slice[tuple(ranges[::-1]) if transposed else tuple(ranges)]
  block = hf_block.T if transposed else hf_block
  return block.reshape(block_shape)[tuple(inner_index)]


def _read_config(path: Path) -> tuple[Path, dict]:
  """(config.json path, its dict) of an HF directory; ValueError naming what is amiss."""
  if path.is_file():  # e.g. its config.json or model.safetensors
    raise ValueError(f"{path} is a file; pass the checkpoint directory that holds it")
  if not path.is_dir():
    raise ValueError(f"checkpoint directory {path} does not exist")
  config_file = path / "config.json"
  if not config_file.exists():
    raise ValueError(f"{config_file} not found: not a Hugging Face model directory")
  try:
    hf = json.loads(config_file.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{config_file}: invalid JSON ({e})") from None
  if not isinstance(hf, dict):  # a list's fields are read with .get: AttributeError
    raise ValueError(f"{config_file}: expected a JSON object, got a {type(hf).__name__}")
  return config_file, hf


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
    unsupported architecture, a file that is not valid safetensors, and a missing,
    misshapen or unexpected tensor.
  """
  # Checked here, or a bad one would be reported as an error of config.json's.
  for name, value in (("dtype", dtype), ("compute_dtype", compute_dtype)):
    try:
      if value is not None:
        as_dtype(value)
    except ValueError as e:
      raise ValueError(f"load_pretrained({name}=...): {e}") from None
  path = Path(path)
  config_file, hf = _read_config(path)
  try:
    cfg = ModelConfig.from_hf_dict(
        hf, dtype=dtype if compute_dtype is None else compute_dtype, param_dtype=dtype,
        lm_head_fp32=lm_head_fp32, remat=remat, attention=attention)
  except KeyError as e:
    raise ValueError(f"{config_file}: no {e.args[0]!r}, which the architecture "
                     f"needs") from None
  except ValueError as e:
    raise ValueError(f"{config_file}: {e}") from None
  table = hf_param_table(cfg)
  model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  rules = sharding_lib.DEFAULT_RULES if rules is None else rules
  param_dtype = np.dtype(cfg.param_dtype)
  with contextlib.ExitStack() as stack:
    tensors, weight_map = _open_checkpoint(path, stack)
    _check_names(path, cfg, table, tensors, weight_map)
    for name, attr_path, transposed in table:
      var = variable(model, attr_path)
      shape = tuple(var.get_value().shape)
      hf_shape = hf_tensor_shape(shape, attr_path, transposed)
      file, handle = tensors[name]
      tensor_slice = handle.get_slice(name)
      found = tuple(tensor_slice.get_shape())
      if found != hf_shape:
        raise ValueError(f"{file.name}: tensor {name!r} has shape {list(found)}, expected "
                         f"{list(hf_shape)} for config {config_file}")
      if tensor_slice.get_dtype() not in _LOADABLE_DTYPES:
        raise ValueError(f"{file}: tensor {name!r} {list(found)} has dtype "
                         f"{tensor_slice.get_dtype()}; expected one of {_LOADABLE_DTYPES}")
      read = functools.partial(_read_block, tensor_slice, shape,
                               _axis_groups(shape, attr_path, transposed), transposed)
      var.set_value(_place(read, shape, param_dtype, var, mesh, rules))
  return model, cfg


def _place(read, shape: tuple, dtype: np.dtype, var: nnx.Variable, mesh, rules) -> jax.Array:
  """The parameter as a jax.Array; `read(index)` gives a block of it (a host copy)."""
  if mesh is None:
    return jnp.asarray(read(tuple(slice(None) for _ in shape)).astype(dtype, copy=False))
  names = var.get_metadata().get("out_sharding")
  spec = sharding_lib.spec_for(names, shape, mesh, rules)
  sharding = jax.sharding.NamedSharding(mesh, spec)
  # Each device reads only its own block of the file.
  return jax.make_array_from_callback(
      shape, sharding, lambda index: read(index).astype(dtype, copy=False))
