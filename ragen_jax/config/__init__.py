"""A run's configuration, typed: every section's frozen dataclass, and ``resolve``.

    spec = resolve(config)          # ml-collections ConfigDict -> RunSpec (or ConfigError)
    spec.trainer.total_steps, spec.rollout.group_size, spec.starpo.adv_estimator, ...

``sections`` holds model / rollout / trainer / warmup / eval / mesh / logging, ``starpo`` holds starpo / filter
/ collapse, ``checks`` the one family of validators they share, ``resolve`` the cross-section rules
and the preset placeholders. ``configs/base.py`` builds the ConfigDict from these dataclasses.
"""
from ragen_jax.config.resolve import ConfigError, RunSpec, resolve
from ragen_jax.config.sections import (EvalConfig, LoggingConfig, MeshConfig, ModelSection, RolloutConfig,
                                       TinyModelConfig, TrainerConfig, WarmupConfig)
from ragen_jax.config.starpo import CollapseConfig, FilterConfig, StarPOConfig

__all__ = ["CollapseConfig", "ConfigError", "EvalConfig", "FilterConfig", "LoggingConfig", "MeshConfig", "ModelSection",
           "RolloutConfig", "RunSpec", "StarPOConfig", "TinyModelConfig", "TrainerConfig", "WarmupConfig",
           "resolve"]
