"""The 2×2 Rubik's cube (RAGEN's ``rubikscube`` tag: one-move scrambles, at most 20 moves).

    python -m ragen_jax.launch --config configs/rubikscube.py
    python -m ragen_jax.launch --config configs/rubikscube.py --config.env.scramble_depth=3

Physical moves by default (``env.moves="ragen"`` reproduces the original's back turn, see
``environments/rubiks_cube/env.py``). The warm-up imitates the optimal solver (``environments.rubiks_cube.expert.solve_cube``).
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/rubikscube"
    c.env = base.ConfigDict(dict(name="rubikscube", scramble_depth=1, max_steps_in_episode=20, moves="physical"))
    c.rollout.update(dict(num_groups=8, group_size=4, max_turns=4, max_actions_per_turn=2, max_actions_per_traj=20,
                          max_new_tokens=96, max_seq_len=2048, max_words=30))
    c.starpo.adv_estimator = "grpo"
    c.starpo.mini_batch_size = 16
    c.warmup.update(dict(single_turn_steps=200, steps=100, batch_size=8, num_states=256))
    c.eval.num_episodes = 64
    return c
