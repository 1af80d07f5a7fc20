"""The bandit's expert: the warm-up's plan (the high-risk arm; which arm pays is left to RL).
"""
from __future__ import annotations

import numpy as np

from environments.core import Plan



def plan(env, s, params) -> Plan:
    """The high-risk arm (its mean payout, 0.25 by default, beats the low-risk arm's 0.1). The
    reasoning names both arms and the choice but not why: with ``warmup.action_noise=1.0`` the
    warm-up teaches the reply format on random choices between the two shown arms, and which arm
    pays is left to RL."""
    shown = [env.action_names[int(i)] for i in np.asarray(env.shown_arms(s))]
    high = env.action_names[2 * int(s.pair) + 1]
    return Plan([high], lambda given: f"The arms are {shown[0]} and {shown[1]}; I pull "
                                      f"{given[0] if given else high}.")
