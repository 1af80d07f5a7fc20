"""Sudoku (RAGEN's SimpleSudoku / MediumSudoku): ``env`` the generator, dynamics, device renders
and the agent-facing contract, ``text`` the host reference renders, ``expert`` the backtracking
solver and the warm-up's expert.
"""
from environments.sudoku.env import Sudoku, SudokuParams, SudokuState

__all__ = ["Sudoku", "SudokuParams", "SudokuState"]
