"""Base configuration: every section, with RAGEN's defaults (spec §0, §5.6) where they apply.

    python -m ragen_jax.launch --config configs/sokoban.py --config.model.preset=qwen2.5-0.5b \
        --config.model.path=/models/Qwen2.5-0.5B-Instruct --config.starpo.adv_estimator=grpo

Sections (each is the keys of one part's frozen config dataclass, so every field is overridable and
an unknown key fails with the allowed names):

  env       environment name + its constructor / EnvParams keyword arguments (flat)
  model     preset (tiny | smollm2_135m | qwen2.5-{0.5b,1.5b,3b,7b}), local path, dtypes, tiny dims
  rollout   ragen_jax.rollout.RolloutConfig  (groups × group size, turns, actions, sampling)
  starpo    ragen_jax.starpo.config.StarPOConfig  (advantages, PPO clip, KL, entropy, optimiser)
  filter    ragen_jax.starpo.config.FilterConfig  (SNR filter over groups)
  collapse  ragen_jax.starpo.config.CollapseConfig (MI proxy / reasoning-collapse diagnostics)
  trainer   steps, logging, checkpoints, evaluation cadence, early-stop switches
  warmup    behaviour-cloning warm-up from the env solvers (optional phase before RL)
  eval      fixed validation seeds, temperature, pass@k, JSONL transcripts

``None`` values (placeholders) mean "the preset's recommended value", resolved in one place
(``ragen_jax.training.configuration.resolve``) and printed at start-up: e.g. the learning rates
are 1e-6 / 1e-5 (spec §5.6) for pretrained presets and larger for the from-scratch ``tiny`` model.
"""
from __future__ import annotations

import dataclasses
import typing

from ml_collections import ConfigDict, config_dict


def dataclass_section(cls, **overrides) -> ConfigDict:
    """A config section holding every field of ``cls`` at its default, then ``overrides``.

    Building sections from the part's own dataclass keeps the keys in one place: a field added
    there is immediately overridable from the command line.
    """
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
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
    from ragen_jax.rollout.agent import RolloutConfig
    from ragen_jax.starpo.config import CollapseConfig, FilterConfig, StarPOConfig

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

    # --- model ------------------------------------------------------------------------------
    c.model = ConfigDict()
    c.model.preset = "tiny"  # tiny | smollm2_135m | qwen2.5-0.5b | qwen2.5-1.5b | qwen2.5-3b | qwen2.5-7b
    c.model.path = config_dict.placeholder(str)  # local HF directory (Qwen presets); GGUF file optional
    c.model.dtype = "float32"  # compute dtype: float32 | bfloat16
    c.model.param_dtype = "float32"
    c.model.scan_layers = False  # stacked layers + lax.scan (large models on accelerators)
    c.model.remat = False
    # The tiny preset (from scratch, the shipped tokenizer).
    c.model.tiny = ConfigDict(dict(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                                   num_kv_heads=2, head_dim=32, rope_theta=10000.0, init_seed=0))

    # --- rollout (spec §0 step 2) --------------------------------------------------------------
    c.rollout = dataclass_section(RolloutConfig, num_groups=8, group_size=16, max_turns=5,
                                  max_actions_per_turn=2, max_actions_per_traj=10, temperature=1.0,
                                  format_penalty=-0.1, max_new_tokens=400, max_seq_len=4096)

    # --- StarPO (spec §5.6) ------------------------------------------------------------------------
    c.starpo = dataclass_section(StarPOConfig, adv_estimator="gae", gamma=1.0, lam=1.0, clip_ratio_low=0.2,
                                 clip_ratio_high=0.28, clip_ratio_c=3.0, entropy_coeff=0.001,
                                 use_kl_loss=False, kl_coef=0.0, loss_agg_mode="token-mean", ppo_epochs=1,
                                 mini_batch_size=32, grad_clip=1.0, weight_decay=0.01)
    # Placeholders: resolved from the preset (1e-6 / 1e-5 for pretrained models, spec §5.6).
    c.starpo.actor_lr = config_dict.placeholder(float)
    c.starpo.critic_lr = config_dict.placeholder(float)
    c.filter = dataclass_section(FilterConfig)
    c.collapse = dataclass_section(CollapseConfig)

    # --- trainer -----------------------------------------------------------------------------
    c.trainer = ConfigDict()
    c.trainer.total_steps = 200
    c.trainer.log_every = 1
    c.trainer.transcript_every = 10  # sample transcripts (text) to TensorBoard
    c.trainer.save_every = 100
    c.trainer.keep_checkpoints = 3
    c.trainer.resume = True  # continue from the latest checkpoint in workdir/checkpoints
    c.trainer.eval_every = 10  # 0 = never during training
    c.trainer.eval_before_train = True
    c.trainer.progress_bar = True
    # Early-stop signals are always logged; these switches make them stop the run.
    c.trainer.stop_on_empty_filter = True  # filter.empty_stop_steps consecutive empty batches
    c.trainer.stop_on_reward_collapse = False  # spec §5.1.6
    c.trainer.reward_collapse_baseline_steps = 10
    c.trainer.reward_collapse_window = 10
    c.trainer.reward_collapse_ratio = 0.1
    c.trainer.stop_on_mi_collapse = False
    c.trainer.mi_collapse_ratio = 0.5  # MI below this fraction of its baseline ...
    c.trainer.mi_collapse_window = 3  # ... for this many consecutive MI computations while reward plateaus
    c.trainer.stop_on_success = 0.0  # stop once validation success >= this (0 = never)
    # Wall-clock budget from the start of the run, warm-up included (0 = none): the step that
    # crosses it is the last, and it is checkpointed (compare presets in the same budget).
    c.trainer.time_limit_minutes = 0.0

    # --- behaviour-cloning warm-up -------------------------------------------------------------
    c.warmup = ConfigDict()
    c.warmup.steps = 0  # BC steps on whole expert conversations (0 and single_turn_steps 0 = no warm-up)
    # BC steps on first-turn conversations, run first: ~3x shorter sequences, so the cheap place to
    # learn to read the board (the envs are Markov: a start state is also a mid-episode state).
    c.warmup.single_turn_steps = 0
    # With reading_target > 0, single_turn_steps is a cap: the first-turn phase ends once the model
    # reads the board (teacher-forced exact state description) on this fraction of heldout_states
    # unseen start states, checked every check_every steps.
    c.warmup.reading_target = 0.0
    c.warmup.check_every = 200
    c.warmup.heldout_states = 256
    c.warmup.batch_size = 32
    c.warmup.lr = 1e-3
    c.warmup.num_states = 0  # distinct start states to imitate (0 = a fresh one per episode)
    c.warmup.action_noise = 0.0  # fraction of expert turns replaced by a random (suboptimal) action
    c.warmup.seed = 1
    c.warmup.log_every = 10

    # --- evaluation (spec §4.9) ------------------------------------------------------------------
    c.eval = ConfigDict()
    c.eval.num_episodes = 512  # seeds validation_seed ... + num_episodes - 1, the same every time
    c.eval.validation_seed = 123
    c.eval.temperature = 0.5
    c.eval.pass_k = 1  # samples per validation state; pass@k = any success among them
    c.eval.write_transcripts = True
    c.eval.checkpoint_step = config_dict.placeholder(int)  # eval mode: which checkpoint (None = latest)
    return c

