"""FrozenLake 4×4 — the main job: the tiny preset on a laptop CPU in minutes, no downloads.

    python -m ragen_jax.launch --config configs/frozen_lake.py

A short behaviour-cloning warm-up on a small subset of start states (so it is deliberately weak),
then StarPO (GRPO advantages: no critic to train, which halves the CPU cost of an update) with the
SNR filter keeping the high reward-variance groups. Deterministic ice (``success_rate=1.0``) as in
RAGEN-2's main table. Validation on 64 fixed puzzles at temperature 0.5 before RL (= after the
warm-up alone) and every 10 steps.

Known limit: in the few hundred BC steps a 2-core CPU affords, the 64-wide model learns the reply
format but not to read the player's position off the grid (its greedy reasoning names the same
coordinates for every board), so validation success stays around 0.2 and 40 StarPO steps do not
lift it measurably; reaching high success needs far more warm-up/RL compute or a larger model.

The sizes here are chosen for a 2-core CPU; for real models use the RAGEN defaults of base.py:
    --config.model.preset=qwen2.5-0.5b --config.model.path=/path --config.rollout.num_groups=8 ...
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/frozen_lake"
    c.env = base.ConfigDict(dict(name="frozen_lake", size=4, p=0.9, success_rate=1.0,
                                 observation_format="grid"))

    c.model.preset = "tiny"
    c.model.tiny.hidden_size = 64
    c.model.tiny.intermediate_size = 192
    c.model.tiny.num_layers = 2
    c.model.tiny.num_heads = 4
    c.model.tiny.num_kv_heads = 2
    c.model.tiny.head_dim = 16

    c.rollout.num_groups = 4
    c.rollout.group_size = 8
    c.rollout.max_turns = 3  # 3 turns × 2 actions: every 4×4 map's shortest path fits
    c.rollout.max_actions_per_traj = 6
    c.rollout.max_new_tokens = 40
    # System prompt (~141 tokens) + 3 turns of (user block <= ~85 + reply 40 + close) needs ~520:
    # at 512 the third turn never fits, so every puzzle needing 5-6 moves was unsolvable
    # (expert demonstrations succeeded on only ~90% of start states).
    c.rollout.max_seq_len = 640
    c.rollout.max_words = 30

    c.starpo.adv_estimator = "grpo"
    c.starpo.mini_batch_size = 32
    c.starpo.actor_lr = 1e-3  # the tiny preset's recommended value (configuration.PRESETS)
    c.starpo.entropy_coeff = 0.001
    c.filter.strategy = "top_p"
    c.filter.value = 0.9
    c.filter.include_zero = False
    # MI proxy every 5 steps on 8 reasoning samples; pairs are scored 32 at a time, reasoning
    # spans capped at the reply budget (bounds the [x | z] buffers).
    c.collapse.num_samples = 8
    c.collapse.compute_freq = 5
    c.collapse.micro_batch_size = 32
    c.collapse.max_reasoning_tokens = 40

    c.trainer.total_steps = 40
    c.trainer.eval_every = 10
    c.trainer.save_every = 10
    c.trainer.transcript_every = 10
    c.trainer.stop_on_empty_filter = False

    c.warmup.steps = 60
    c.warmup.batch_size = 16
    c.warmup.lr = 3e-3
    c.warmup.num_states = 64

    c.eval.num_episodes = 64
    c.eval.temperature = 0.5
    return c
