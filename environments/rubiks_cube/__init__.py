"""The 2×2 Rubik's cube (RAGEN's rubikscube): ``env`` the dynamics and the agent-facing contract,
``expert`` the meet-in-the-middle solver and the warm-up's expert.
"""
from environments.rubiks_cube.env import CubeParams, CubeState, RubiksCube

__all__ = ["CubeParams", "CubeState", "RubiksCube"]
