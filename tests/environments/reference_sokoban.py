"""A slow, plain-Python Sokoban written from gym-sokoban's rules (its step and reward, RAGEN's info).

It keeps gym-sokoban's representation: ``room_fixed`` (0 wall, 1 floor, 2 target) and
``room_state`` (0 wall, 1 floor, 2 empty target, 3 box on target, 4 box, 5 player), and counts
boxes on targets the way ``_calc_reward`` does (targets that are neither empty nor under the
player). Actions are 0 Up, 1 Down, 2 Left, 3 Right (gym-sokoban push actions 1..4).
"""
from __future__ import annotations

import numpy as np

CHANGE = [(-1, 0), (1, 0), (0, -1), (0, 1)]


class ReferenceSokoban:
    def __init__(self, room_fixed, room_state, max_steps: int = 100):
        self.room_fixed = np.array(room_fixed, dtype=np.int64)
        self.room_state = np.array(room_state, dtype=np.int64)
        # The JAX env stores a player on a target as 6; gym-sokoban's room_state has 5 there.
        self.room_state[self.room_state == 6] = 5
        self.num_boxes = int(np.sum(self.room_fixed == 2))
        self.max_steps = max_steps
        self.num_env_steps = 0
        self.player = np.argwhere(self.room_state == 5)[0]
        self.boxes_on_target = self._count_boxes_on_target()

    def _count_boxes_on_target(self) -> int:
        empty_targets = self.room_state == 2
        player_on_target = (self.room_fixed == 2) & (self.room_state == 5)
        return self.num_boxes - int(np.sum(empty_targets | player_on_target))

    def _all_on_target(self) -> bool:
        empty_targets = self.room_state == 2
        player_hiding_target = (self.room_fixed == 2) & (self.room_state == 5)
        return int(np.sum(empty_targets | player_hiding_target)) == 0

    def _move(self, dr, dc) -> bool:
        r, c = self.player
        nr, nc = r + dr, c + dc
        if self.room_state[nr, nc] in (1, 2):
            self.room_state[nr, nc] = 5
            self.room_state[r, c] = self.room_fixed[r, c]
            self.player = np.array([nr, nc])
            return True
        return False

    def _push(self, dr, dc) -> bool:
        r, c = self.player
        nr, nc = r + dr, c + dc
        br, bc = nr + dr, nc + dc
        rows, cols = self.room_state.shape
        if br >= rows or bc >= cols or br < 0 or bc < 0:
            return False
        if self.room_state[nr, nc] in (3, 4) and self.room_state[br, bc] in (1, 2):
            self.room_state[nr, nc] = 5
            self.room_state[r, c] = self.room_fixed[r, c]
            self.room_state[br, bc] = 3 if self.room_fixed[br, bc] == 2 else 4
            self.player = np.array([nr, nc])
            return True
        return self._move(dr, dc)

    def step(self, action: int):
        """-> ``(reward, terminated, truncated, info)``."""
        old = self.player.copy()
        self.num_env_steps += 1
        self._push(*CHANGE[action])
        reward = -0.1
        current = self._count_boxes_on_target()
        if current > self.boxes_on_target:
            reward += 1.0
        elif current < self.boxes_on_target:
            reward += -1.0
        won = self._all_on_target()
        if won:
            reward += 10.0
        self.boxes_on_target = current
        # gym-sokoban: done = solved or steps == max_steps; split into gymnax's two flags.
        terminated = won
        truncated = (self.num_env_steps >= self.max_steps) and not won
        info = {
            "action_is_valid": True,
            "action_is_effective": bool(np.any(old != self.player)),
            "success": self.boxes_on_target == self.num_boxes,
        }
        return reward, terminated, truncated, info

    def render_codes(self) -> np.ndarray:
        """RAGEN's render room: 6 where the player stands on a target."""
        return np.where((self.room_state == 5) & (self.room_fixed == 2), 6, self.room_state)
