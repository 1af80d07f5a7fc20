"""FrozenLake's slippery-ice sentence follows the configured dynamics."""
import pytest

import environments
from ragen_jax.config import RolloutConfig
from ragen_jax.rollout.prompts import build_system_text

SENTENCE = "The ice is slippery: a move may take you in a direction you did not intend."


@pytest.mark.parametrize("fmt", ["grid", "coord", "grid_coord"])
@pytest.mark.parametrize("is_slippery, success_rate, expected", [
    (True, 0.8, True),    # RAGEN's default: moves slip
    (True, 1.0, False),   # deterministic ice (RAGEN-2's main table)
    (False, 0.8, False),  # Gymnasium's flag: success_rate is ignored
])
def test_slippery_sentence_follows_the_dynamics(fmt, is_slippery, success_rate, expected):
    env = environments.make("frozen_lake", size=4, is_slippery=is_slippery, observation_format=fmt)
    text = build_system_text(env, fmt, RolloutConfig(), (4, 4), env.default_params(success_rate=success_rate))
    assert (SENTENCE in text) == expected
    # Nothing else changes: dropping the sentence leaves the original's text, spaces included.
    assert text.replace(" " + SENTENCE, "") == build_system_text(
        env, fmt, RolloutConfig(), (4, 4), env.default_params(success_rate=1.0)).replace(" " + SENTENCE, "")
    assert "  " not in text.replace("\n", "|").split("|")[0]


def test_instruction_text_is_the_originals_when_slippery():
    slippery = environments.make("frozen_lake", size=4)
    assert slippery.instruction_text("grid", (4, 4), slippery.default_params()) == (
        "You are solving the FrozenLake puzzle. Avoid the holes and reach the goal. " + SENTENCE + " "
        "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n")
    assert slippery.instruction_text("grid", (4, 4), slippery.default_params(success_rate=1.0)) == (
        "You are solving the FrozenLake puzzle. Avoid the holes and reach the goal. "
        "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n")
