"""Bi-arm Bandit: one turn, one action, arm names as actions.

    python -m ragen_jax.launch --config configs/bandit.py
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/bandit"
    # The payouts: the low-risk arm pays 0.1; the high-risk one 1.0 with probability 0.25,
    # else 0. Listed here so that ``--config.env.hi_arm_hiscore_prob=...`` can change them.
    c.env = base.ConfigDict(dict(name="bandit", lo_arm_score=0.1, hi_arm_loscore=0.0, hi_arm_hiscore=1.0,
                                 hi_arm_hiscore_prob=0.25))
    c.rollout.max_turns = 1
    c.rollout.max_actions_per_turn = 1
    c.rollout.max_actions_per_traj = 1
    return c
