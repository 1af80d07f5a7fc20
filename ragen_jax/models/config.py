"""`ModelConfig`: the shape of a Qwen2 / Qwen2.5 / Llama-family decoder, read from an HF `config.json`.

The config is a frozen dataclass, so it is hashable and can be a static argument of `jax.jit`. It
holds the architecture numbers (taken from the checkpoint's `config.json`) and a few knobs of ours
(`dtype`, `param_dtype`, `scan_layers`, `remat`) that decide how the same weights are computed.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import jax.numpy as jnp

# Model families whose decoder block is exactly ours: pre-norm RMSNorm, GQA attention with RoPE
# (rotate_half convention), SwiGLU MLP. SmolLM2 is a Llama.
SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
# RoPE variants implemented in `decoder.rope_frequencies`.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def _dtype_name(value: Any, field: str) -> str:
    """Normalise 'fp32' / jnp.float32 / 'bfloat16' ... to 'float32' or 'bfloat16'."""
    name = value if isinstance(value, str) else jnp.dtype(value).name
    if name not in _DTYPES:
        raise ValueError(f"ModelConfig.{field}={value!r} is not supported; use 'float32' or 'bfloat16'.")
    return jnp.dtype(_DTYPES[name]).name


# The projections a LoRA adapter may sit on (attention and MLP; every one by default, as Tunix does).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ModelFileError(ValueError):
    """A model file that cannot be read (truncated, not the format it claims); names the file."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture + compute knobs of a decoder-only transformer (Qwen2 / Llama family).

    Architecture (from `config.json`):
      vocab_size, hidden_size (D), intermediate_size (F), num_layers (L), num_heads (H),
      num_kv_heads (K, GQA: H % K == 0), head_dim (Hd), rope_theta, rope_scaling (None or a dict with
      `rope_type` in SUPPORTED_ROPE_TYPES), rms_norm_eps, qkv_bias (Qwen2: True; Llama:
      `attention_bias`), o_bias (Llama `attention_bias` also biases o_proj; Qwen2 never), mlp_bias,
      tie_word_embeddings, max_position_embeddings, initializer_range (std of the random init).
    Ours:
      dtype: compute dtype of activations and matmuls ('float32' | 'bfloat16'); logits are float32 always.
      param_dtype: storage dtype of the weights ('float32' | 'bfloat16').
      matmul_dtype: operand dtype of the weight matmuls (the projections, the MLP and the logits);
        None = the compute dtype. 'bfloat16' with float32 compute is mixed precision: weights and
        activations enter each of those matmuls rounded to bfloat16, the products are accumulated and
        returned in float32, and everything between them (norms, residual stream, RoPE, attention,
        softmax) stays float32. Pair it with param_dtype='bfloat16' so the weights are stored as
        they are used. A bfloat16 matmul emitting float32 is the fast form on CPUs with AMX or
        AVX512-BF16 (~3x a float32 one) and on GPU tensor cores; a bfloat16 result is not (on CPU
        it is slower than float32).
      kv_cache_dtype: storage dtype of the KV cache (None = the compute dtype). 'bfloat16' with float32
        compute halves the bytes a decode step reads (decode is bound by reading the cache); keys and
        values are rounded to bfloat16 when written and read back as the compute dtype. Inside
        `prefill`'s and `generate`'s loops it is held as uint16 bits (`kv_cache.as_bits`: XLA's CPU
        backend copies a bfloat16 buffer at every scatter), which makes it as fast as float32 on a CPU.
      scan_layers: stack the layers' weights on a leading [L] axis and run them with `lax.scan`
        (faster compile for deep models on accelerators); False = a Python loop over layers (faster
        decode on CPU). Both give the same numbers.
      remat: recompute each layer's activations in the backward pass (`jax.checkpoint`).
      attention_block_size: queries per block of the causal attention of a whole sequence (no KV
        cache): blocks above the diagonal are skipped, ~half the attention work on long rows;
        0 = one [T, T] masked softmax. Same numbers either way.
      cache_block_size: cache slots per block when new tokens attend to a KV cache; only the blocks up
        to the batch's furthest position are read (a rollout's cache is sized for the whole
        conversation). 0 = 64 on CPU, where each block is cheap and empty slots are not, and 1024 on
        accelerators, where a block costs kernel launches. Same numbers up to float rounding.
      cpu_kernels: the decode loop's two CPU kernels (`models/cpu_kernels.py`, C++ built on first use,
        float32 computation): attention over the KV cache read in place, and the weight matmuls of
        decoding on weights repacked once (per `generate` call, per rollout, at a server's load;
        `decoder.pack_for_decode`). 'auto' (default): on a single-device CPU where
        they build; 'on': always (an error where they cannot run); 'off': XLA's forms. Same numbers
        up to float rounding.
      lora_rank: > 0 gives every projection named in `lora_targets` a low-rank adapter
        (`decoder.LoRALinear`: y = x W + (alpha / rank) x A B, A [in, r], B [r, out] starting at 0);
        the adapters are `nnx.LoRAParam`s, the only weights StarPO and the warm-up train.
      lora_top_layers: > 0 trains the adapters of the top `lora_top_layers` layers only (deviation
        from RAGEN, whose LoRA trains every layer's): the layers below run with their weights under
        `stop_gradient`, so the backward pass stops at the first trained layer and the frozen ones
        are never rematerialised. Their adapters stay as they are (zero B: the base). 0 = every layer.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    model_type: str = "llama"
    dtype: str = "float32"
    param_dtype: str = "float32"
    kv_cache_dtype: str | None = None
    matmul_dtype: str | None = None
    scan_layers: bool = False
    remat: bool = False
    attention_block_size: int = 64
    cache_block_size: int = 0
    cpu_kernels: str = "auto"
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    lora_top_layers: int = 0

    def __post_init__(self):
        # Frozen dataclass: normalise fields through object.__setattr__.
        object.__setattr__(self, "dtype", _dtype_name(self.dtype, "dtype"))
        object.__setattr__(self, "param_dtype", _dtype_name(self.param_dtype, "param_dtype"))
        if self.kv_cache_dtype is not None:
            object.__setattr__(self, "kv_cache_dtype", _dtype_name(self.kv_cache_dtype, "kv_cache_dtype"))
        if self.matmul_dtype is not None:
            object.__setattr__(self, "matmul_dtype", _dtype_name(self.matmul_dtype, "matmul_dtype"))
            if jnp.dtype(self.matmul_dtype).itemsize > jnp.dtype(self.dtype).itemsize:
                raise ValueError(f"ModelConfig.matmul_dtype={self.matmul_dtype!r} is wider than dtype={self.dtype!r}: "
                                 "matmul operands are rounded to matmul_dtype and the results kept in dtype, so "
                                 "use matmul_dtype='bfloat16' with dtype='float32' (or leave it unset).")
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (grouped-query attention).")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE.")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"ModelConfig.model_type={self.model_type!r} is not supported; "
                             f"supported: {SUPPORTED_MODEL_TYPES}.")
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"ModelConfig.lora_rank must be an int >= 0 (0 = no adapters), got {self.lora_rank!r}.")
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown or (self.lora_rank and not self.lora_targets):
            raise ValueError(f"ModelConfig.lora_targets={self.lora_targets!r}: choose a non-empty subset of "
                             f"{LORA_TARGETS}.")
        if not isinstance(self.lora_top_layers, int) or not 0 <= self.lora_top_layers <= self.num_layers:
            raise ValueError(f"ModelConfig.lora_top_layers={self.lora_top_layers!r} must be an int in "
                             f"[0, num_layers={self.num_layers}] (0 = adapters trained on every layer).")
        if self.cpu_kernels not in ("auto", "on", "off"):
            raise ValueError(f"ModelConfig.cpu_kernels must be 'auto', 'on' or 'off', got {self.cpu_kernels!r}.")
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not implemented; "
                             f"supported: {SUPPORTED_ROPE_TYPES}.")

    # --- derived ---------------------------------------------------------------------------------
    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @property
    def frozen_layers(self) -> int:
        """How many bottom layers run under stop_gradient (``lora_top_layers``; 0 without LoRA)."""
        return self.num_layers - self.lora_top_layers if self.lora_rank and self.lora_top_layers else 0

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def matmul_operand_dtype(self):
        """The dtype weights and activations enter the weight matmuls in (``matmul_dtype`` or the
        compute dtype); their results are always in the compute dtype."""
        return jnp.dtype(self.matmul_dtype or self.dtype)

    @property
    def weight_dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed, e.g. `cfg.replace(dtype='bfloat16', scan_layers=True)`."""
        allowed = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - allowed)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; allowed: {sorted(allowed)}.")
        return dataclasses.replace(self, **changes)

    # --- construction from HF ----------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike, **overrides) -> "ModelConfig":
        """Build from an HF `config.json` (a dict, a path to the file, or the model directory).

        `overrides` set our knobs (dtype, param_dtype, scan_layers, remat) or any other field.
        Unsupported architectures and features raise a ValueError naming the config key.
        """
        c = dict(config) if isinstance(config, Mapping) else _read_hf_config(config)

        model_type = c.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config key 'model_type'={model_type!r} is not supported; "
                             f"supported: {SUPPORTED_MODEL_TYPES} (Qwen2/Qwen2.5, Llama/SmolLM2).")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if c.get(k) is None]
        if missing:
            raise ValueError(f"HF config is missing required key(s) {missing}.")
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config key 'hidden_act'={act!r} is not supported; only 'silu' (SwiGLU).")
        if c.get("use_sliding_window"):
            raise ValueError("config key 'use_sliding_window'=True is not supported (sliding-window "
                             "attention is not implemented); Qwen2.5 checkpoints set it to false.")
        if c.get("pretraining_tp", 1) not in (1, None):
            raise ValueError(f"config key 'pretraining_tp'={c['pretraining_tp']} is not supported; only 1.")

        rope_theta, rope_scaling = _rope(c)

        num_heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        else:
            qkv_bias = o_bias = bool(c.get("attention_bias", False))
            mlp_bias = bool(c.get("mlp_bias", False))
        fields = dict(
            vocab_size=int(c["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(c["intermediate_size"]),
            num_layers=int(c["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(c.get("num_key_value_heads") or num_heads),
            head_dim=int(c.get("head_dim") or hidden // num_heads),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
            initializer_range=float(c.get("initializer_range", 0.02)),
            model_type=model_type,
        )
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; allowed: {sorted(allowed)}.")
        fields.update(overrides)
        return cls(**fields)


def _read_hf_config(config: str | os.PathLike) -> dict:
    """An HF ``config.json`` from its path or its model directory."""
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no HF config at {path!r}; pass a config.json path, its "
                                "directory, or a dict.")
    try:
        with open(path, encoding="utf-8") as f:
            return dict(json.load(f))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path} is not valid JSON ({e}); copy the model's config.json again") from None


def _rope(c: Mapping[str, Any]) -> tuple[float, tuple | None]:
    """``(rope_theta, rope_scaling)`` of an HF config: transformers 5 writes `rope_parameters`
    {rope_type, rope_theta, ...}; older files have a top-level `rope_theta` and an optional
    `rope_scaling` dict (with `type` or `rope_type`)."""
    rope = dict(c.get("rope_parameters") or {})
    rope_theta = float(rope.pop("rope_theta", c.get("rope_theta", 10000.0)))
    legacy = dict(c.get("rope_scaling") or {})
    if legacy:
        rope.update(legacy)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.pop("type", None)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config key 'rope_scaling' (rope_type={rope_type!r}) is not implemented; "
                         f"supported: {SUPPORTED_ROPE_TYPES}.")
    return rope_theta, None if rope_type == "default" else tuple(sorted(rope.items()))
