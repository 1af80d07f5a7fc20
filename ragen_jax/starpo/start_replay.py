"""Unsolved-start replay: play again the start states the policy has not yet solved in every episode.

Once a policy solves most starts (the main job's FrozenLake warm-up validates at ~0.86), most groups
succeed in every episode, their rewards do not differ, and every group-relative estimator gives them
a zero advantage: the update rests on the few starts it still gets wrong, met once and never again.
Prioritized Level Replay (Jiang et al., 2021) trains on the levels with the most to learn more often;
this is its simplest form, with the group's own pass rate as the score:

- a host-side queue holds the reset keys of groups that did **not** succeed in every episode;
- each step, ``floor(fraction x num_groups)`` groups take their start from the front of the queue
  (oldest first; fewer when the queue is shorter), the rest are fresh starts drawn exactly as
  without replay (so an empty queue gives the very rollout ``rollout(params, key)`` would);
- after the rollout, every group that did not succeed in every episode joins the back of the queue
  again, unless it has been replayed ``max_uses`` times already (a start the policy cannot solve does
  not crowd out the rest); a solved one leaves. The queue keeps its newest ``capacity`` starts.

Only the step's first rollout feeds the queue (dynamic sampling's extra rounds are fresh starts).
The queue is part of the run's host state, saved with every checkpoint, so a resumed run replays
exactly what it would have.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass
class StartReplay:
    """The queue of unsolved starts. ``keys`` uint32 ``[N, key words]``: reset-key data, oldest first;
    ``uses`` int ``[N]``: how many times each has been replayed."""

    fraction: float
    max_uses: int
    capacity: int
    keys: np.ndarray
    uses: np.ndarray

    @classmethod
    def empty(cls, fraction: float, max_uses: int, capacity: int, key_words: int = 2) -> "StartReplay":
        return cls(fraction, max_uses, capacity, np.zeros((0, key_words), np.uint32), np.zeros((0,), np.int64))

    def starts(self, key: jax.Array, num_groups: int) -> tuple[np.ndarray, np.ndarray, int]:
        """The step's group starts from its rollout ``key``.

        -> ``(group_keys uint32 [G, words], uses [G], replayed)``: the first ``replayed`` rows come from
        the queue (and leave it), the others are the fresh keys ``rollout(params, key)`` would draw for
        those groups; ``uses`` counts the replays so far of each row's start (0 for fresh ones).
        """
        env_key, _ = jax.random.split(key)
        fresh = np.asarray(jax.random.key_data(jax.random.split(env_key, num_groups)), np.uint32)
        n = min(int(self.fraction * num_groups), len(self.keys))
        group_keys = np.concatenate([self.keys[:n], fresh[n:]]).astype(np.uint32)
        uses = np.concatenate([self.uses[:n] + 1, np.zeros(num_groups - n, np.int64)])
        self.keys, self.uses = self.keys[n:], self.uses[n:]
        return group_keys, uses, n

    def record(self, group_keys: np.ndarray, uses: np.ndarray, solved: np.ndarray) -> None:
        """Queue the groups of this step that did not succeed in every episode (``solved`` bool [G])
        and have been replayed fewer than ``max_uses`` times; keep the newest ``capacity``."""
        back = ~np.asarray(solved, bool) & (uses < self.max_uses)
        self.keys = np.concatenate([self.keys, group_keys[back]])[-self.capacity:]
        self.uses = np.concatenate([self.uses, uses[back]])[-self.capacity:]

    def state_dict(self) -> dict:
        return {"keys": self.keys.tolist(), "uses": self.uses.tolist()}

    def load_state_dict(self, state: dict) -> None:
        words = self.keys.shape[1]
        self.keys = np.asarray(state["keys"], np.uint32).reshape(-1, words)
        self.uses = np.asarray(state["uses"], np.int64).reshape(-1)

