"""Policy model: config, Flax NNX decoder (Qwen2 / Llama families), KV cache, value head."""
from ragen_jax.models.config import ModelConfig
from ragen_jax.models.decoder import MLP, Attention, Critic, Decoder, DecoderLayer, ValueHead
from ragen_jax.models.kv_cache import KVCache, init_cache

__all__ = ["ModelConfig", "Decoder", "DecoderLayer", "Attention", "MLP", "ValueHead", "Critic",
           "KVCache", "init_cache"]
