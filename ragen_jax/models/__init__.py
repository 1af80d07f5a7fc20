"""Policy model: config, Flax NNX decoder (Qwen2 / Llama families), KV cache, value head, loading."""
from ragen_jax.models.config import ModelConfig
from ragen_jax.models.decoder import MLP, Attention, Critic, Decoder, DecoderLayer, ValueHead
from ragen_jax.models.kv_cache import KVCache, init_cache
from ragen_jax.models.loading import from_hf_state_dict, load_gguf, load_hf, load_model, smollm2_gguf_path
from ragen_jax.models.tokenizer import load_tokenizer

__all__ = ["ModelConfig", "Decoder", "DecoderLayer", "Attention", "MLP", "ValueHead", "Critic",
           "KVCache", "init_cache", "load_model", "load_hf", "load_gguf", "from_hf_state_dict",
           "load_tokenizer", "smollm2_gguf_path"]
