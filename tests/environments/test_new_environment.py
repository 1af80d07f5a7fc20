"""Adding an environment is one class and one registry line: a corridor defined in this file alone
is registered, warmed up on its expert and trained for a StarPO step through the normal trainer.

References are hand-worked: the corridor's expert walks right to the goal, so every demonstration
succeeds; the system prompt the model reads is this file's instruction, legend and action list.
Fixed seeds (the small FrozenLake test config's), so every run of this file sees the same numbers.
"""
from __future__ import annotations

import json
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import environments
from environments import render
from environments.core import Environment, EnvParams, EnvState, Plan


@chex.dataclass(frozen=True)
class CorridorState(EnvState):
    pos: chex.Array  # int32 [] the player's cell


class Corridor(Environment):
    """A one-row corridor: the player starts in a random cell left of the goal, at the right end."""

    name = "corridor"
    action_names = ("Left", "Right")
    observation_formats = ("grid",)
    instruction = "You walk along a corridor. Reach the goal G. Answer with moves, like <answer>Right</answer>.\n"

    def __init__(self, length: int = 4, observation_format: str = "grid"):
        self.length = int(length)
        self.observation_format = self.check_format(observation_format)
        # Piece ids: 0 "_", 1 "P", 2 "G" (one piece per cell).
        self._table = render.PieceTable(["_", "P", "G"])

    def default_params(self, max_steps_in_episode: int = 8) -> EnvParams:
        return EnvParams(max_steps_in_episode=jnp.int32(max_steps_in_episode))

    def reset_env(self, key, params):
        state = CorridorState(time=jnp.int32(0), pos=jax.random.randint(key, (), 0, self.length - 1, dtype=jnp.int32))
        return self.observation(state, params), state

    def step_env(self, key, state, action, params):
        pos = jnp.clip(state.pos + jnp.where(action == 1, 1, -1), 0, self.length - 1).astype(jnp.int32)
        time = state.time + 1
        at_goal = pos == self.length - 1
        next_state = state.replace(pos=pos, time=time)
        info = {"action_is_valid": jnp.bool_(True), "action_is_effective": pos != state.pos, "success": at_goal}
        reward = jnp.where(at_goal, 1.0, -0.1).astype(jnp.float32)
        return (self.observation(next_state, params), next_state, reward, at_goal,
                (time >= params.max_steps_in_episode) & ~at_goal, info)

    def observation(self, state, params=None):
        cells = jnp.zeros((self.length,), jnp.int32).at[self.length - 1].set(2).at[state.pos].set(1)
        return cells[None, :]

    @property
    def piece_table(self):
        return self._table.pieces

    def render_pieces(self, state, params=None, fmt=None):
        return self.observation(state)[0], jnp.int32(self.length)

    def render_text(self, state, fmt=None):
        return "".join("_PG"[int(c)] for c in np.asarray(self.observation(state))[0])

    def legend(self):
        return "P: player, _: floor, G: goal"

    def expert(self, state, params):
        steps = self.length - 1 - int(state.pos)
        return Plan(["Right"] * steps, lambda given: f"The player is at {int(state.pos)} and the goal at "
                                                     f"{self.length - 1}.")


@pytest.fixture
def corridor():
    environments.register("corridor", Corridor)
    yield
    environments.REGISTRY.pop("corridor", None)


def test_a_new_environment_is_one_class_and_one_registry_line(corridor, tmp_path):
    from ml_collections import ConfigDict

    from ragen_jax.config import resolve
    from ragen_jax.training.trainer import train
    from tests.training.test_trainer import small_config_dict

    c = small_config_dict(tmp_path, total_steps=1)
    c.env = ConfigDict(dict(name="corridor", length=5))
    c.rollout.max_turns = 3
    c.warmup.reading_target = 0.0  # the corridor has no board-reading phase to end
    out = train(resolve(c))

    # The warm-up imitated the file's expert: it walks right, so every demonstration succeeds.
    summary = json.loads((tmp_path / "summary.json").read_text())["summary"]
    assert summary["warmup/expert_success"] == 1.0
    # One StarPO step ran on the new env, and its replies were read with its own action names.
    assert out["summary"]["steps"] == 1.0
    record = json.loads((tmp_path / "eval" / "transcripts.jsonl").read_text().splitlines()[0])
    transcript = record["transcript"]
    assert ("You're a helpful assistant. " + Corridor.instruction) in transcript
    assert "P: player, _: floor, G: goal" in transcript and "Left, Right" in transcript
