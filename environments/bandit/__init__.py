"""RAGEN's two-armed bandit with named arms: ``env`` the dynamics and the agent-facing contract,
``expert`` the warm-up's expert.
"""
from environments.bandit.env import Bandit, BanditParams, BanditState

__all__ = ["Bandit", "BanditParams", "BanditState"]
