"""ModelConfig: the architecture numbers of a Llama / Qwen2 / Qwen3 decoder.

Built from (and written back to) a Hugging Face `config.json` dict. The original
dict is kept verbatim so `save_pretrained` writes a faithful config (fields isojax
does not model, like `bos_token_id`, survive the round trip).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp
import numpy as np

# architectures entry -> (model_type, q/k/v bias, per-head q/k RMSNorm). Each family
# has exactly one: transformers builds the model from the architecture alone (it
# initialises a q_norm the weights lack), so a config that differs is not that model.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}
_ARCH_BY_MODEL_TYPE = {v[0]: k for k, v in SUPPORTED_ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "llama3")

_DTYPE_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Per-layer rematerialisation: "none" keeps every activation for the backward
# pass; "full" keeps only each layer's input and recomputes the rest; "dots" also
# keeps the outputs of the dense (weight) matmuls, recomputing only cheap ops;
# "attention" keeps what the attention kernel's backward needs (its inputs,
# output and softmax statistics) and recomputes the rest, never attention.
REMAT_POLICIES = ("none", "full", "dots", "attention")
# "xla": portable (blocked above a length, see isojax.models.attention);
# "cudnn": cuDNN's fused flash attention (GPU); "auto": cudnn on GPU, else xla.
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")


def as_remat(remat: Any) -> str:
  """A `REMAT_POLICIES` name; True/False (and "true"/"false" from flags) = full/none."""
  if isinstance(remat, (bool, np.bool_)):
    return "full" if remat else "none"
  if isinstance(remat, str):
    name = {"true": "full", "false": "none"}.get(remat.lower(), remat.lower())
    if name in REMAT_POLICIES:
      return name
  raise ValueError(f"ModelConfig.remat={remat!r}: expected one of {REMAT_POLICIES} "
                   "(or True/False for full/none)")


def as_dtype(dtype: Any) -> Any:
  """'bfloat16' | jnp.bfloat16 | np.dtype | torch.bfloat16 -> the jnp scalar type
  (hashable); a ValueError for any other."""
  name = dtype
  if not isinstance(dtype, str):
    try:
      name = np.dtype(dtype).name
    except TypeError:  # not a numpy dtype: a torch one reads "torch.bfloat16"
      name = str(dtype)
  name = name.removeprefix("torch.")
  if name not in _DTYPE_NAMES:
    raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPE_NAMES)}")
  return _DTYPE_NAMES[name]


def dtype_name(dtype: Any) -> str:
  return np.dtype(as_dtype(dtype)).name


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture + numerics of a decoder-only LM (frozen, hashable).

  `dtype` is the compute dtype of activations, `param_dtype` the storage dtype of
  parameters; `lm_head_fp32` computes the final projection and logits in float32
  (the ScaleRL precision fix for bf16 training); `remat` is the per-layer
  rematerialisation policy (`REMAT_POLICIES`; True/False mean "full"/"none");
  `attention` picks the attention implementation (`ATTENTION_IMPLEMENTATIONS`).
  """

  architecture: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_type: str = "default"
  # Llama-3 `rope_scaling` ("llama3"); ignored for rope_type "default".
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_position: int = 8192
  max_position_embeddings: int = 4096
  # None: the architecture's (SUPPORTED_ARCHITECTURES); another value is refused.
  attention_bias: bool | None = None
  qk_norm: bool | None = None
  tie_word_embeddings: bool = False
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  lm_head_fp32: bool = True
  remat: str = "none"
  attention: str = "auto"
  # config.json's eos_token_id as a tuple: where a sampler stops a row. A field of
  # its own (not only in the JSON below) so that models that differ in it are
  # unequal configs: nnx.jit's graph cache hands one model an equal one's config.
  eos_token_ids: tuple[int, ...] = ()
  # The config.json this came from, as JSON text (immutable, kept out of eq/hash).
  hf_config_json: str = dataclasses.field(default="", compare=False, repr=False)

  def __post_init__(self):
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise ValueError(
          f"unsupported architecture {self.architecture!r}; "
          f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    _, bias, qk_norm = SUPPORTED_ARCHITECTURES[self.architecture]
    for name, value in (("attention_bias", bias), ("qk_norm", qk_norm)):
      if getattr(self, name) is None:
        object.__setattr__(self, name, value)
      elif bool(getattr(self, name)) != value:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} contradicts "
                         f"{self.architecture}, which has {name}={value}; leave it unset")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"ModelConfig.{name}={value!r} must be a positive integer")
    if self.head_dim % 2:  # else a split deep inside the forward pass fails
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even: RoPE rotates "
                       f"the first half of each head against the second")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                       f"num_key_value_heads={self.num_kv_heads}")
    if self.rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"unsupported rope_type {self.rope_type!r}; "
                       f"supported: {SUPPORTED_ROPE_TYPES}")
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"ModelConfig.attention={self.attention!r}: expected one of "
                       f"{ATTENTION_IMPLEMENTATIONS}")
    object.__setattr__(self, "remat", as_remat(self.remat))
    for name in ("dtype", "param_dtype"):
      try:
        object.__setattr__(self, name, as_dtype(getattr(self, name)))
      except ValueError as e:
        raise ValueError(f"ModelConfig.{name}: {e}") from None
    for name in ("tie_word_embeddings", "lm_head_fp32"):  # "false" would be true
      if not isinstance(getattr(self, name), (bool, np.bool_)):
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} must be True or False")
    try:  # a list would make the config unhashable (jit's static arguments)
      object.__setattr__(self, "eos_token_ids", _token_ids(self.eos_token_ids))
    except ValueError:
      raise ValueError(f"ModelConfig.eos_token_ids={self.eos_token_ids!r} must be token ids "
                       f"(a tuple of ints)") from None
    self._check_numbers()

  def _check_numbers(self):
    """Values that would make every logit NaN (a negative eps under the rsqrt, a
    theta or llama3 factor <= 0 in RoPE's frequencies) or fail deep in the trace."""
    positive = ["rope_theta"] + (["rope_factor", "rope_original_max_position"]
                                 if self.rope_type == "llama3" else [])
    for name in ["rms_norm_eps", *positive]:
      value = getattr(self, name)
      ok = (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, bool) and np.isfinite(value)
            and (value > 0 if name in positive else value >= 0))
      if not ok:
        raise ValueError(f"ModelConfig.{name}={value!r} must be a finite number "
                         f"{'> 0' if name in positive else '>= 0'}")

  @property
  def model_type(self) -> str:
    return SUPPORTED_ARCHITECTURES[self.architecture][0]

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_hf_dict(cls, hf: dict, *, dtype=jnp.float32, param_dtype=jnp.float32,
                   lm_head_fp32: bool = True, remat: str | bool = "none",
                   attention: str = "auto") -> ModelConfig:
    """Parse a transformers `config.json` dict (old and new rope formats).

    Raises ValueError on an unsupported `architectures` entry or on features
    this decoder does not implement (sliding window, MLP bias, non-SiLU act).
    """
    archs = hf.get("architectures") or []
    if not archs:
      if hf.get("model_type") not in _ARCH_BY_MODEL_TYPE:
        raise ValueError(
            f"config has no 'architectures' and model_type {hf.get('model_type')!r} is "
            f"not supported; supported architectures: {sorted(SUPPORTED_ARCHITECTURES)}")
      archs = [_ARCH_BY_MODEL_TYPE[hf["model_type"]]]
    bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if bad or len(archs) != 1:
      raise ValueError(f"unsupported architectures {archs!r}; supported: "
                       f"{sorted(SUPPORTED_ARCHITECTURES)}")
    arch = archs[0]
    _, bias, _ = SUPPORTED_ARCHITECTURES[arch]
    if hf.get("hidden_act", "silu") != "silu":
      raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (only 'silu')")
    if hf.get("mlp_bias"):
      raise ValueError("unsupported mlp_bias=true")
    if hf.get("use_sliding_window"):
      raise ValueError("unsupported use_sliding_window=true (only full attention)")
    if hf.get("attention_bias") and not bias:  # Qwen2's is q/k/v only
      raise ValueError(f"unsupported attention_bias=true for {arch} (its o_proj bias "
                       f"is not modelled)")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    rope = _parse_rope(hf)
    return cls(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype, param_dtype=param_dtype, lm_head_fp32=lm_head_fp32, remat=remat,
        attention=attention, eos_token_ids=_token_ids(hf.get("eos_token_id")),
        hf_config_json=json.dumps(hf, sort_keys=True),
        **rope)

  def to_hf_dict(self, dtype=None) -> dict:
    """The config.json dict: the original one (if any) with isojax's numbers on top.

    `dtype` (default: param_dtype) is written as both `dtype` (transformers 5) and
    `torch_dtype` (older transformers / vLLM) since readers differ in which they use.
    """
    hf = json.loads(self.hf_config_json) if self.hf_config_json else {}
    hf.update(
        architectures=[self.architecture], model_type=self.model_type,
        vocab_size=self.vocab_size, hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
        num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
        head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, hidden_act="silu",
        max_position_embeddings=self.max_position_embeddings,
        tie_word_embeddings=self.tie_word_embeddings)
    if "layer_types" in hf:  # transformers refuses one whose length is not num_layers
      hf["layer_types"] = ["full_attention"] * self.num_layers
    # max_window_layers is kept: it only counts with use_sliding_window, which
    # from_hf_dict refuses, and Qwen configs carry values past their layer count.
    if self.eos_token_ids:
      ids = list(self.eos_token_ids)
      hf["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    if self.architecture != "Qwen2ForCausalLM":  # Qwen2 has no such field: bias is implied
      hf["attention_bias"] = self.attention_bias
    name = dtype_name(self.param_dtype if dtype is None else dtype)
    hf["dtype"] = hf["torch_dtype"] = name
    rope = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
    if self.rope_type == "llama3":
      rope.update(factor=self.rope_factor, low_freq_factor=self.rope_low_freq_factor,
                  high_freq_factor=self.rope_high_freq_factor,
                  original_max_position_embeddings=self.rope_original_max_position)
    if "rope_parameters" in hf or "rope_theta" not in hf:
      hf["rope_parameters"] = rope
      # transformers reads a rope_scaling dict in preference to rope_parameters.
      hf.pop("rope_scaling", None)
      if "rope_theta" in hf:
        hf["rope_theta"] = self.rope_theta
    else:  # legacy layout: keep it legacy so old readers still understand it
      hf["rope_theta"] = self.rope_theta
      hf["rope_scaling"] = None if self.rope_type == "default" else dict(rope)
    if self.rope_type == "llama3" and "original_max_position_embeddings" in hf:
      hf["original_max_position_embeddings"] = self.rope_original_max_position
    return hf


def _token_ids(value) -> tuple[int, ...]:
  """config.json's eos_token_id (an id, a list or tuple of ids, or null) as a tuple."""
  values = [] if value is None else value if isinstance(value, (list, tuple)) else [value]
  if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
    raise ValueError(f"config.json's eos_token_id={value!r} is not a token id or a list "
                     f"of them")
  return tuple(int(v) for v in values)


def _parse_rope(hf: dict) -> dict:
  """The RoPE fields of config.json, chosen as transformers 5 chooses them.

  transformers' `convert_rope_params_to_dict` takes `rope_scaling or rope_parameters`:
  a `rope_scaling` dict replaces `rope_parameters` whole (transformers 5 writes a
  default `rope_parameters` into every config, and long-context recipes add a
  `rope_scaling` beside it). The theta is the chosen dict's, else the top-level
  `rope_theta`, else 10000. Raises ValueError naming the field of a RoPE type
  this decoder does not implement.
  """
  field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  params = dict(hf.get(field) or {})
  if "full_attention" in params:  # per-layer-type layout; these models use full attention
    field, params = f"{field}.full_attention", dict(params["full_attention"] or {})
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(f"unsupported {field} rope_type {rope_type!r}; "
                     f"supported: {SUPPORTED_ROPE_TYPES}")
  out = dict(rope_theta=float(theta), rope_type=rope_type)
  if rope_type == "llama3":
    # transformers falls back to max_position_embeddings for a missing pretraining
    # length. Its standardisation means a top-level original_max_position_embeddings
    # to take priority, yet for Llama/Qwen it is set after standardising and so
    # ignored: which one a checkpoint means is ambiguous where the two differ.
    original = int(params.get("original_max_position_embeddings",
                              hf.get("max_position_embeddings", 4096)))
    top = hf.get("original_max_position_embeddings")
    if top is not None and int(top) != original:
      raise ValueError(f"original_max_position_embeddings={top} disagrees with {field}'s "
                       f"pretraining length {original}: which one RoPE scales from is "
                       f"ambiguous; make them equal")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
      raise ValueError(f"{field} rope_type 'llama3' lacks {missing}")
    out.update(rope_factor=float(params["factor"]),
               rope_low_freq_factor=float(params["low_freq_factor"]),
               rope_high_freq_factor=float(params["high_freq_factor"]),
               rope_original_max_position=original)
  return out


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies [head_dim/2] as float32, following transformers' formulas."""
  # As transformers 5's LlamaRotaryEmbedding.compute_default_rope_parameters.
  dim = cfg.head_dim
  exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
  inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** exponent)).astype(np.float32)
  if cfg.rope_type == "llama3":  # transformers' modeling_rope_utils._compute_llama3_parameters
    factor, lo, hi = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_position
    low_freq_wavelen, high_freq_wavelen = old_len / lo, old_len / hi
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
  return inv_freq
