"""2048 (RAGEN's game_2048): ``env`` the dynamics and the agent-facing contract, ``expert`` the
expectimax move and the warm-up's expert.
"""
from environments.game_2048.env import Game2048, Game2048Params, Game2048State

__all__ = ["Game2048", "Game2048Params", "Game2048State"]
