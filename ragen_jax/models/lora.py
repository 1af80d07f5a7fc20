"""LoRA adapters on a Decoder: add them to a loaded model, fold them back in, export the result.

    model = add_lora(model, rank=8, alpha=16)          # base weights shared, adapters A random, B = 0
    gd, adapters, base = nnx.split(model, nnx.LoRAParam, ...)   # what StarPO trains / keeps frozen
    merged = merge_lora(model)                         # a plain Decoder with W + (alpha / r) A B
    export_hf(merged, "out/")                          # model.safetensors + config.json (HF names)

The adapted projections are ``decoder.LoRALinear`` (``models/config.LORA_TARGETS``: q/k/v/o and the
MLP's gate/up/down by default). Only the adapters are ``nnx.LoRAParam``: splitting on that type
gives the trainable state, everything else (the pretrained base) is carried unchanged — and, with
the adapters zeroed, the base is the KL reference for free (``starpo.update.init_train_state``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from ragen_jax.models.config import LORA_TARGETS
from ragen_jax.models.decoder import Decoder, folded_kernel
from ragen_jax.models.loading import _table_entry


def has_lora(model_or_state) -> bool:
    """Whether a Decoder (or its state) holds LoRA adapters."""
    state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
    return any(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(state))


def _is_adapter(path) -> bool:
    return "lora" in tuple(str(p) for p in path)


def add_lora(model: Decoder, rank: int, alpha: float = 16.0, targets: tuple[str, ...] = LORA_TARGETS,
             seed: int = 0, top_layers: int = 0) -> Decoder:
    """``model`` with rank-``rank`` adapters on ``targets``: its own weights (shared arrays, not copied)
    and new adapters (A: the LoRA default init from ``seed``, B: zeros, so the output is unchanged).
    ``top_layers`` > 0: only the top ``top_layers`` layers' adapters train (``ModelConfig.lora_top_layers``).

    The adapted Decoder is built abstractly (``nnx.eval_shape``), so no second copy of the base is
    ever initialised: a 7B model grows only by its adapters.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank!r}")
    cfg = model.cfg.replace(lora_rank=int(rank), lora_alpha=float(alpha), lora_targets=tuple(targets),
                            lora_top_layers=int(top_layers))
    fresh = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(seed)))
    graphdef, state = nnx.split(fresh)
    base = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model))}
    init = nnx.initializers.variance_scaling(1.0 / 3, "fan_in", "uniform")  # nnx.LoRA's default for A
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        path = tuple(path)
        if not _is_adapter(path):
            var.value = base[path].value
        elif path[-1] == "lora_a":
            # A sits on the input side: [.., in, r]; with scan_layers a leading [L] axis.
            var.value = init(jax.random.fold_in(key, i), var.value.shape, jnp.float32)
        else:
            var.value = jnp.zeros(var.value.shape, jnp.float32)
    return nnx.merge(graphdef, state)


def merge_lora(model: Decoder) -> Decoder:
    """A plain Decoder (no adapters) whose adapted kernels are ``W + (alpha / r) A B``."""
    cfg = model.cfg
    if not cfg.lora_rank:
        return model
    scale = cfg.lora_alpha / cfg.lora_rank
    plain_cfg = cfg.replace(lora_rank=0)
    fresh = nnx.eval_shape(lambda: Decoder(plain_cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(fresh)
    flat = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model))}
    for path, var in nnx.to_flat_state(state):
        path = tuple(path)
        value = flat[path].value
        if path[-1] == "kernel" and path[:-1] + ("lora", "lora_a") in flat:
            a = flat[path[:-1] + ("lora", "lora_a")].value
            b = flat[path[:-1] + ("lora", "lora_b")].value
            value = folded_kernel(value, a, b, scale)
        var.value = value
    return nnx.merge(graphdef, state)


def hf_config(cfg) -> dict:
    """The HF ``config.json`` of a (plain) ModelConfig: Qwen2 or Llama keys."""
    out = {
        "architectures": ["Qwen2ForCausalLM" if cfg.model_type == "qwen2" else "LlamaForCausalLM"],
        "model_type": cfg.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range, "torch_dtype": cfg.param_dtype,
    }
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.model_type != "qwen2":
        out["attention_bias"], out["mlp_bias"] = cfg.qkv_bias, cfg.mlp_bias
    return out


def export_hf(model: Decoder, directory: str | os.PathLike) -> Path:
    """Write ``model`` (adapters merged first) as an HF checkpoint: ``model.safetensors`` under the
    HF tensor names of ``loading.WEIGHT_TABLE`` and a ``config.json``; ``loading.load_hf`` and
    transformers both read it back."""
    model = merge_lora(model)
    cfg = model.cfg
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        parts = tuple(str(p) for p in path)
        value = np.asarray(jax.device_get(var.value))
        if value.dtype == jnp.bfloat16:
            value = value.astype(np.float32)  # safetensors.numpy has no bfloat16; config.json keeps the dtype
        layers = [(i, value[i]) for i in range(cfg.num_layers)] if cfg.scan_layers and parts[0] == "layers" else [(None, value)]
        for layer, x in layers:
            key = ".".join(parts if layer is None or not cfg.scan_layers else ("layers", str(layer)) + parts[1:])
            row, idx = _table_entry(key)
            tensors[row.hf.format(i=idx)] = np.ascontiguousarray(x.T if row.transpose else x)
    safetensors.numpy.save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    return out
