"""Environment names: ours, the original's tag names, and the host (Python) environments."""
from __future__ import annotations

import pytest

import environments
from configs import base


def test_tags_resolve_to_the_originals_settings():
    env, params = environments.make_with_params("MediumSudoku")
    assert (env.name, env.difficulty, env.num_blanks, int(params.max_steps_in_episode)) == ("sudoku", "medium", 40, 81)
    env, params = environments.make_with_params("rubikscube")
    assert (int(params.scramble_depth), int(params.max_steps_in_episode)) == (1, 20)
    env, params = environments.make_with_params("rubikscube", scramble_depth=3)  # configured values win
    assert int(params.scramble_depth) == 3
    assert environments.make("LargerSokoban").num_boxes == 2
    assert environments.resolve("SearchQAMock") == ("search", {"max_steps": 10, "max_search_results": 5, "mock": True})
    assert environments.is_host("MetamathQA") and not environments.is_host("Countdown")
    with pytest.raises(ValueError, match="Python text environment"):
        environments.make("SearchQA")
    with pytest.raises(ValueError, match="unknown environment 'Chess'"):
        environments.resolve("Chess")


def test_config_accepts_tags_and_names_unknown_keys():
    from ragen_jax.config import ConfigError, resolve

    c = base.get_config()
    c.env = base.ConfigDict({"name": "SimpleSudoku"})
    c.rollout.max_actions_per_turn = 1
    spec = resolve(c)
    assert spec.env_name == "sudoku" and spec.env_kwargs["difficulty"] == "easy"
    assert spec.env_param_kwargs == {"max_steps_in_episode": 81}
    c.env = base.ConfigDict({"name": "Countdown", "colour": "red"})
    with pytest.raises(ConfigError, match=r"env.colour is not a parameter of countdown"):
        resolve(c)
    c.env = base.ConfigDict({"name": "Chess"})
    with pytest.raises(ConfigError, match=r"env.name='Chess' is not a registered environment.*SimpleSudoku"):
        resolve(c)
    c.env = base.ConfigDict({"name": "MetamathQA", "max_obs_tokens": 300})
    spec = resolve(c)
    assert spec.env_name == "metamathqa" and spec.env_param_kwargs == {"max_obs_tokens": 300}
