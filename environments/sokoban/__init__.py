"""Sokoban 6×6 and larger (RAGEN's SimpleSokoban / LargerSokoban): ``env`` the dynamics and the
agent-facing contract, ``levels`` the room generator, ``render`` the text renders, ``expert`` the
BFS solver and the warm-up's expert.
"""
from environments.sokoban.env import Sokoban, SokobanParams, SokobanState

__all__ = ["Sokoban", "SokobanParams", "SokobanState"]
