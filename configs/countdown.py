"""Countdown (RAGEN's ``Countdown`` tag): one answer, an equation over 3-4 numbers, scored on device.

    python -m ragen_jax.launch --config configs/countdown.py
    python -m ragen_jax.launch --config configs/countdown.py --config.env.operators=+-

Puzzles are generated inside jit and always solvable (``operators="+-"`` gives the original's
sign-only distribution). The warm-up imitates the exhaustive solver's equations.
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/countdown"
    c.env = base.ConfigDict(dict(name="Countdown"))
    c.rollout.update(dict(num_groups=8, group_size=8, max_turns=1, max_actions_per_turn=1, max_actions_per_traj=1,
                          max_new_tokens=112, max_seq_len=512, max_words=50))
    c.starpo.adv_estimator = "grpo"
    c.starpo.mini_batch_size = 32
    c.warmup.update(dict(single_turn_steps=300, steps=0, batch_size=16, num_states=1024))
    c.eval.num_episodes = 128
    return c
