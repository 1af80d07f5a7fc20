"""A training distribution apart from validation's (``config.train_env``): the config routes and refuses
keys, old runs still resume, and the trainer plays its StarPO episodes on the training params while the
warm-up and validation keep ``config.env``'s. Fixed seeds throughout.
"""
import pytest

from configs import frozen_lake, metamathqa
from ragen_jax.config import ConfigError, resolve
from ragen_jax.training.event_log import read_events
from ragen_jax.training.workdir import config_as_json, config_changes
from tests.starpo.test_start_replay import _first_user_block
from tests.training.test_trainer import _logged, small_config_dict


def test_train_env_sets_the_training_params_over_the_env_ones():
    c = frozen_lake.get_config()
    assert resolve(c).train_env_param_kwargs == {}  # unset: training plays config.env's episodes
    c.train_env.p = 0.8
    spec = resolve(c)
    assert spec.train_env_param_kwargs == {"p": 0.8, "success_rate": 1.0}
    assert spec.env_param_kwargs == {"p": 0.9, "success_rate": 1.0}  # validation's and the warm-up's


@pytest.mark.parametrize("key, value, match", [
    ("scramble_depth", 3, r"train_env\.scramble_depth is not a param of frozen_lake.*allowed: \['description_reward', 'distance_shaping', 'max_steps_in_episode', 'p', 'success_rate'\]"),
    ("p", 1.5, r"train_env\.p=1\.5.*outside \[0\.0, 1\.0\]"),
])
def test_train_env_refuses_what_the_env_does_not_take(key, value, match):
    c = frozen_lake.get_config()
    c.train_env[key] = value
    with pytest.raises(ConfigError, match=match):
        resolve(c)


def test_train_env_on_a_python_text_environment_is_refused():
    c = metamathqa.get_config()
    c.train_env.max_steps_in_episode = 3
    with pytest.raises(ConfigError, match=r"Python text environment.*leave config.train_env unset"):
        resolve(c)


def test_a_run_saved_before_train_env_existed_resumes():
    """A saved config without the section counts as unchanged while every key is unset; a set key is a
    change to the run (refused on resume like any other)."""
    c = frozen_lake.get_config()
    saved = config_as_json(c)
    del saved["train_env"]
    assert config_changes(saved, config_as_json(c)) == []
    c.train_env.p = 0.8
    assert config_changes(saved, config_as_json(c)) == [("train_env.p", "<unset>", 0.8)]


def _boards(workdir):
    """The first board of each logged training transcript, by step."""
    texts = read_events(workdir / "tensorboard", text_content=True)["transcripts/train"]
    return {step: _first_user_block(text) for step, text in texts}


def test_trainer_trains_on_the_training_params_and_warms_up_on_the_env_ones(tmp_path):
    """``env.p=0.5`` (holes on about half the cells) with ``train_env.p=1.0`` (no holes): every StarPO
    board the run logs is hole-free, while the run without ``train_env`` logs boards with holes, and
    the warm-up and the validation before RL are the plain run's, value for value (both on ``env.p``)."""
    from ragen_jax.training.trainer import train

    runs = {}
    for name, over in (("plain", {}), ("train_env", {"train_env.p": 1.0})):
        c = small_config_dict(tmp_path / name, total_steps=2, **{"env.p": 0.5, **over})
        train(resolve(c))
        runs[name] = tmp_path / name
    boards = {name: _boards(w) for name, w in runs.items()}
    assert set(boards["train_env"]) == {1, 2}
    hole = "O"  # FrozenLake's default grid symbol for a hole
    assert all(hole not in board for board in boards["train_env"].values()), boards["train_env"]
    assert any(hole in board for board in boards["plain"].values()), boards["plain"]
    logged = {name: _logged(w) for name, w in runs.items()}
    warmup = [k for k in logged["plain"] if k.startswith("warmup/")]
    assert warmup and "val/success" in logged["plain"]
    for key in warmup:  # the warm-up's whole series
        assert logged["train_env"][key] == logged["plain"][key], key
    for key in (k for k in logged["plain"] if k.startswith("val/")):  # validation at step 0, before RL
        assert dict(logged["train_env"][key])[0] == dict(logged["plain"][key])[0], key
