"""Llama / Qwen2 / Qwen3 decoders in Flax NNX, with HF checkpoint I/O.

    from isojax.models import ModelConfig, Decoder, KVCache, load_pretrained, save_pretrained
    model, cfg = load_pretrained("path/to/hf_dir", dtype=jnp.bfloat16, mesh=mesh)
    logits_BxTxV = model(input_ids_BxT, attention_mask=mask_BxT)
"""

from isojax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from isojax.models.decoder import Decoder
from isojax.models.hf_io import load_pretrained, save_pretrained
from isojax.models.kv_cache import KVCache
from isojax.models.tokenizer import Tokenizer

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "Decoder", "KVCache", "load_pretrained",
           "save_pretrained", "Tokenizer"]
