"""Bi-arm Bandit (spec §3.1): one turn, one action, arm names as actions.

    python -m ragen_jax.launch --config configs/bandit.py
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/bandit"
    c.env = base.ConfigDict({"name": "bandit"})
    c.rollout.max_turns = 1
    c.rollout.max_actions_per_turn = 1
    c.rollout.max_actions_per_traj = 1
    return c
