"""StarPO smoke runs on every environment of the suite: a short expert warm-up (the experts'
answers go through the env's own parser) and two StarPO steps, tiny model, fixed seeds.

Each run must finish with finite losses and report the valid-action rate; the warm-up's expert
must succeed where an expert can (its demonstrations are what behaviour cloning imitates).
"""
from __future__ import annotations

import importlib
import math

import pytest

from ragen_jax.config import resolve
from ragen_jax.training.event_log import read_scalars

TINY = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)


def small(name, workdir, **over):
    c = importlib.import_module(f"configs.{name}").get_config()
    c.workdir = str(workdir)
    c.model.tiny.update(TINY)
    c.rollout.update(dict(num_groups=2, group_size=2))
    c.rollout.max_turns = min(c.rollout.max_turns, 2)
    # Two turns fit in 2,048 tokens everywhere (Sudoku's 8,192 sizes five ~600-token boards); the
    # transcript buffers, and so the update's programs, scale with it.
    c.rollout.max_seq_len = min(c.rollout.max_seq_len, 2048)
    c.starpo.mini_batch_size = 4
    c.collapse.update(dict(compute_freq=1, num_samples=4, micro_batch_size=8))
    c.warmup.update(dict(single_turn_steps=2, steps=2 if c.rollout.max_turns > 1 else 0, batch_size=4,
                         num_states=4, heldout_states=4))
    c.eval.num_episodes = 4
    c.trainer.update(dict(total_steps=2, eval_every=2, save_every=2, transcript_every=1, progress_bar=False))
    for k, v in over.items():
        section, key = k.split(".")
        with c.unlocked():
            c[section][key] = v
    return resolve(c)


# Every run compiles the whole trainer for its env (1.5-3 min on 2 cores), and the trainer's code is
# the same for every env: the default suite runs one multi-turn and one single-turn device env and
# two host envs (each env's dynamics, parser and expert are tested in tests/environments); the
# others are marked slow (``pytest -m slow``).
SLOW = pytest.mark.slow


@pytest.mark.parametrize("name", ["game_2048", pytest.param("rubikscube", marks=SLOW),
                                  pytest.param("sudoku", marks=SLOW), "countdown"])
def test_starpo_runs_on_every_device_env(name, tmp_path):
    from ragen_jax.training.trainer import train

    train(small(name, tmp_path))
    logged = read_scalars(tmp_path / "tensorboard")
    losses = {k: v for k, v in logged.items() if k.startswith("actor/") and "loss" in k}
    assert losses and all(math.isfinite(x) for series in losses.values() for _, x in series), losses
    rates = logged["train/valid_action_rate"]
    assert len(rates) == 2 and all(0.0 <= x <= 1.0 for _, x in rates), rates
    assert all(x == 0.0 for _, x in logged["train/truncated"]), "an episode was cut by max_seq_len"
    # The expert wins its short demonstrations (2048's success is the 2048 tile and a Sudoku needs
    # 32 placements: neither fits in 2 turns; their experts are checked in tests/environments).
    if name in ("rubikscube", "countdown"):
        assert logged["warmup/expert_success"][-1][1] > 0.5, logged["warmup/expert_success"]


@pytest.mark.parametrize("name, over", [
    pytest.param("metamathqa", {}, marks=SLOW),
    pytest.param("search_qa", {}, marks=SLOW),
    ("search_qa", {"env.name": "SearchQAMock"}),
    ("textworld", {"env.num_games": 2}),
])
def test_starpo_runs_on_python_text_envs(name, over, tmp_path):
    """Host envs in the jitted loop (io_callback): two StarPO steps, no warm-up (no expert)."""
    from ragen_jax.training.trainer import train

    over = {"warmup.single_turn_steps": 0, "warmup.steps": 0, **over}
    if name == "textworld":
        over["env.games_dir"] = str(tmp_path / "games")
    train(small(name, tmp_path, **over))
    logged = read_scalars(tmp_path / "tensorboard")
    assert all(math.isfinite(x) for k, s in logged.items() if k.startswith("actor/") and "loss" in k for _, x in s)
    assert len(logged["train/valid_action_rate"]) == 2
