"""Sokoban 6×6 with one box (RAGEN's SimpleSokoban) on a 2-core CPU: the tiny preset, a
behaviour-cloning warm-up on BFS solutions, then StarPO. No downloads.

    python -m ragen_jax.launch --config configs/sokoban.py
    python -m ragen_jax.compare --config configs/sokoban.py \
        --variants filter.value=1.0,filter.value=0.9,filter.strategy=top_k --seeds 2

The recipe is the main job's (``configs/frozen_lake.py``, whose docstring and ``docs/experiments.md``
explain each choice): a 64-wide model with ``rope_theta=100`` and 8 heads of width 8 reads the cells
off the board; Sokoban is Markov, so the rollout shows each turn the system prompt and the current
board only (``context_mode="limited"``, one-turn window); the warm-up's first-turn phase ends once
the model names the player's, the box's and the target's cells on 95% of held-out boards, then
imitates whole expert episodes. Generated 6×6 one-box levels need 1-10 pushes and moves (median 4),
so 5 turns of up to 2 actions fit every BFS solution. GRPO advantages (no critic: half the CPU
cost of an update), SNR filter top-p 0.9.

Real models on accelerators: ``configs/sokoban_ragen.py`` (RAGEN's rollout shape and PPO defaults).
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/sokoban"
    c.env = base.ConfigDict(dict(name="sokoban", dim_room=(6, 6), num_boxes=1, observation_format="grid"))

    c.model.preset = "tiny"
    c.model.tiny.hidden_size = 64
    c.model.tiny.intermediate_size = 192
    c.model.tiny.num_layers = 2
    c.model.tiny.num_heads = 8
    c.model.tiny.num_kv_heads = 4
    c.model.tiny.head_dim = 8
    c.model.tiny.rope_theta = 100.0

    c.rollout.num_groups = 8
    c.rollout.group_size = 4
    c.rollout.max_turns = 5
    c.rollout.max_actions_per_traj = 10
    c.rollout.max_new_tokens = 48
    c.rollout.context_mode = "limited"
    c.rollout.context_window = 1
    c.rollout.max_seq_len = 1024
    c.rollout.max_words = 30

    c.starpo.adv_estimator = "grpo"
    c.starpo.mini_batch_size = 16
    c.starpo.actor_lr = 5e-4
    c.starpo.lr_schedule = "cosine"
    c.starpo.lr_decay_steps = 400
    c.starpo.min_lr_ratio = 0.1
    c.starpo.entropy_coeff = 0.001
    c.filter.strategy = "top_p"
    c.filter.value = 0.9
    c.filter.include_zero = False
    c.collapse.num_samples = 8
    c.collapse.compute_freq = 5
    c.collapse.micro_batch_size = 32
    c.collapse.max_reasoning_tokens = 48

    c.trainer.total_steps = 200
    c.trainer.eval_every = 25
    c.trainer.save_every = 25
    c.trainer.time_limit_minutes = 28.0
    c.trainer.transcript_every = 10
    c.trainer.stop_on_empty_filter = False

    c.warmup.single_turn_steps = 3000
    c.warmup.reading_target = 0.95
    c.warmup.steps = 600
    c.warmup.batch_size = 8
    c.warmup.lr = 3e-3
    c.warmup.num_states = 2048

    c.eval.num_episodes = 256
    c.eval.temperature = 0.5
    return c
