"""Llama / Qwen2 / Qwen3 decoders in Flax NNX, with HF checkpoint I/O.

    from isojax.models import ModelConfig, Decoder, KVCache, load_pretrained, save_pretrained
    model, cfg = load_pretrained("path/to/hf_dir", dtype=jnp.bfloat16, mesh=mesh)
    logits_BxTxV = model(input_ids_BxT, attention_mask=mask_BxT)
    critic = init_critic_from(model, rngs=nnx.Rngs(0))  # same trunk, a value per position
"""

from isojax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from isojax.models.critic import Critic, init_critic_from, load_critic, token_values
from isojax.models.decoder import Decoder
from isojax.models.hf_io import load_pretrained
from isojax.models.hf_save import save_pretrained
from isojax.models.kv_cache import KVCache
from isojax.models.tokenizer import Tokenizer

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "Decoder", "KVCache", "load_pretrained",
           "save_pretrained", "Tokenizer", "Critic", "init_critic_from", "load_critic",
           "token_values"]
