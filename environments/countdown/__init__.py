"""Countdown (RAGEN's countdown): ``env`` the puzzles, the equation parser and the agent-facing
contract, ``expert`` the exhaustive solver and the warm-up's expert.
"""
from environments.countdown.env import Countdown, CountdownParams, CountdownState

__all__ = ["Countdown", "CountdownParams", "CountdownState"]
