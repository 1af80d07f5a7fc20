"""FrozenLake with random maps (RAGEN's FrozenLake): ``env`` the dynamics, renders and the
agent-facing contract, ``expert`` the shortest path around the holes and the warm-up's expert.
"""
from environments.frozen_lake.env import FrozenLake, FrozenLakeParams, FrozenLakeState

__all__ = ["FrozenLake", "FrozenLakeParams", "FrozenLakeState"]
