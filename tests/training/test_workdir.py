"""One run per workdir: refused reuse, config changes on resume, damaged and mismatched checkpoints,
evaluation records written once per step. Fixed seeds throughout (the tiny FrozenLake run of
``test_trainer.small_config``), so every run of this file sees the same numbers."""
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import frozen_lake
from ragen_jax.training.checkpoint import CheckpointMismatch, Checkpointer, NoIntactCheckpoint
from ragen_jax.config import ConfigError, resolve
from ragen_jax.training.workdir import (WorkdirLock, check_eval_workdir, config_as_json, explain_mismatch,
                                        prepare_training_workdir, trim_records)
from tests.training.test_trainer import small_config


def _config(workdir, **over):
    c = frozen_lake.get_config()
    c.workdir = str(workdir)
    for k, v in over.items():
        node = c
        *path, last = k.split(".")
        for p in path:
            node = node[p]
        node[last] = v
    return c


def _spec(workdir, **over):
    return resolve(_config(workdir, **over))


def _fake_run(workdir, config, steps=(0, 25)):
    """A workdir as a run leaves it: config.json and step folders."""
    for s in steps:
        (Path(workdir) / "checkpoints" / str(s)).mkdir(parents=True)
    (Path(workdir) / "config.json").write_text(json.dumps(config_as_json(resolve(config).config)))


def test_fresh_workdir_starts_a_run_and_writes_config(tmp_path):
    resume, notes = prepare_training_workdir(_spec(tmp_path / "run"))
    assert not resume and notes == []
    assert json.loads((tmp_path / "run" / "config.json").read_text())["env"]["size"] == 4


def test_resume_false_on_an_existing_run_is_refused(tmp_path):
    _fake_run(tmp_path, _config(tmp_path))
    with pytest.raises(ConfigError) as e:
        prepare_training_workdir(_spec(tmp_path, **{"trainer.resume": False}))
    msg = str(e.value)
    assert "already holds a run" in msg and "[0, 25]" in msg and "--config.trainer.overwrite=True" in msg
    assert "--config.workdir" in msg


def test_overwrite_moves_the_old_run_aside(tmp_path):
    workdir = tmp_path / "run"
    _fake_run(workdir, _config(workdir))
    (workdir / "summary.json").write_text("{}")
    resume, notes = prepare_training_workdir(_spec(workdir, **{"trainer.overwrite": True, "env.size": 3}))
    assert not resume and "moved to" in notes[0]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and (aside[0] / "checkpoints" / "25").is_dir() and (aside[0] / "summary.json").exists()
    assert not (workdir / "checkpoints").exists()
    assert json.loads((workdir / "config.json").read_text())["env"]["size"] == 3


def test_changed_run_config_is_refused_naming_every_key(tmp_path):
    _fake_run(tmp_path, _config(tmp_path))
    with pytest.raises(ConfigError) as e:
        prepare_training_workdir(_spec(tmp_path, **{"env.size": 3, "seed": 7, "starpo.actor_lr": 1e-4}))
    msg = str(e.value)
    for fragment in ("env.size: 4 -> 3", "seed: 0 -> 7", "starpo.actor_lr: 0.00025 -> 0.0001",
                     "trainer.total_steps"):
        assert fragment in msg, (fragment, msg)
    # The saved config is left as it was: it still describes the checkpoints on disk.
    assert json.loads((tmp_path / "config.json").read_text())["env"]["size"] == 4


def test_safe_changes_resume_and_are_reported(tmp_path):
    _fake_run(tmp_path, _config(tmp_path))
    resume, notes = prepare_training_workdir(_spec(tmp_path, **{"trainer.total_steps": 300,
                                                                 "trainer.eval_every": 50,
                                                                 "trainer.time_limit_minutes": 30.0}))
    assert resume
    assert notes == ["resuming with changed settings: trainer.eval_every: 25 -> 50, "
                     "trainer.time_limit_minutes: 14.0 -> 30.0, trainer.total_steps: 200 -> 300"]
    assert json.loads((tmp_path / "config.json").read_text())["trainer"]["total_steps"] == 300


def test_a_key_added_after_the_run_resumes_at_its_default_only(tmp_path):
    """A run saved before ``rollout.prefill_pieces`` existed (its config.json lacks the key)."""
    saved = config_as_json(_spec(tmp_path).config)
    del saved["rollout"]["prefill_pieces"]
    (tmp_path / "checkpoints" / "25").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    # At the default (4, RolloutConfig's), the resumed run computes what the saved one did.
    assert prepare_training_workdir(_spec(tmp_path)) == (True, [])
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=r"rollout\.prefill_pieces: '<unset>' -> 2"):
        prepare_training_workdir(_spec(tmp_path, **{"rollout.prefill_pieces": 2}))


def test_eval_with_another_envs_config_is_refused(tmp_path):
    _fake_run(tmp_path, _config(tmp_path))
    with pytest.raises(ConfigError, match=r"env\.size: 4 -> 3"):
        check_eval_workdir(_spec(tmp_path, **{"mode": "eval", "env.size": 3}))
    with pytest.raises(ConfigError, match=r"model\.tiny\.hidden_size: 64 -> 32"):
        check_eval_workdir(_spec(tmp_path, **{"mode": "eval", "model.tiny.hidden_size": 32}))
    # eval.* may change; other rollout settings are reported.
    assert check_eval_workdir(_spec(tmp_path, **{"mode": "eval", "eval.num_episodes": 16})) == []
    notes = check_eval_workdir(_spec(tmp_path, **{"mode": "eval", "rollout.max_turns": 4}))
    assert notes and "rollout.max_turns: 3 -> 4" in notes[0]


def _state(seed, width=3):
    rng = np.random.default_rng(seed)
    return {"params": {"w": jnp.asarray(rng.normal(size=(4, width)), jnp.float32)}, "step": jnp.int32(seed),
            "key": jax.random.key(seed)}


def _damage_data_file(step_dir: Path):
    files = sorted((step_dir / "state" / "d").iterdir(), key=lambda p: p.stat().st_size)
    with open(files[-1], "r+b") as f:
        f.truncate(16)


@pytest.mark.parametrize("damage, reason", [
    ("truncated data file", "OUT_OF_RANGE"),
    ("truncated array chunk", "Requested byte range"),  # orbax's wrapper hides it; the reason digs it out
    ("missing meta/metadata", "meta/metadata not found"),
    ("missing state/_METADATA", "lists no arrays"),  # damage, not a config mismatch
])
def test_damaged_latest_checkpoint_falls_back_to_the_newest_intact(tmp_path, capfd, damage, reason):
    width = 3 if damage != "truncated array chunk" else 16384  # a 256 KB array: its own chunk file
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=5)
    for step in (1, 2, 3):
        ckpt.save(step, _state(step, width), {"step": step})
    ckpt.close()
    step_dir = tmp_path / "checkpoints" / "3"
    if damage == "truncated data file":
        _damage_data_file(step_dir)
    elif damage == "truncated array chunk":
        largest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        assert largest.stat().st_size > 64 * 1024  # the array's data, not metadata
        with open(largest, "r+b") as f:
            f.truncate(largest.stat().st_size // 2)
    elif damage == "missing meta/metadata":
        (step_dir / "meta" / "metadata").unlink()
    else:
        (step_dir / "state" / "_METADATA").unlink()
    capfd.readouterr()
    again = Checkpointer(tmp_path / "checkpoints", keep=5)
    state, meta, step, skipped = again.restore_latest_intact(_state(0, width))
    err = capfd.readouterr().err
    assert step == 2 and meta == {"step": 2} and [s for s, _ in skipped] == [3]
    np.testing.assert_array_equal(state["params"]["w"], _state(2, width)["params"]["w"])
    # One readable line: what failed, no pybind / tensorstore spec dump.
    why = skipped[0][1]
    assert reason in why and len(why) <= 400 and "\n" not in why, why
    assert "bound method" not in why and "TensorStore({" not in why, why
    assert err.count("Traceback") == 0, err[:2000]  # no wall of reader-thread tracebacks
    # The damaged step is kept aside, not deleted, and step 3 can be written again.
    assert (tmp_path / "checkpoints.damaged" / "3").is_dir()
    again.save(3, _state(33, width), {"step": 3})
    restored, _, step = again.restore(_state(0, width))
    assert step == 3
    np.testing.assert_array_equal(restored["params"]["w"], _state(33, width)["params"]["w"])
    again.close()


def test_no_intact_checkpoint_lists_each_reason(tmp_path):
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=5)
    ckpt.save(1, _state(1), {"step": 1})
    ckpt.wait()  # saves are asynchronous: the files exist once it is on disk
    _damage_data_file(tmp_path / "checkpoints" / "1")
    with pytest.raises(NoIntactCheckpoint, match=r"step 1: .*overwrite=True"):
        ckpt.restore_latest_intact(_state(0))
    ckpt.close()


def test_shape_mismatch_names_the_array_and_the_config_keys(tmp_path):
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=5)
    ckpt.save(1, _state(1, width=3), {"step": 1})
    for restore in (lambda: ckpt.restore(_state(0, width=5)), lambda: ckpt.restore_latest_intact(_state(0, width=5))):
        with pytest.raises(CheckpointMismatch) as e:
            restore()
        msg = str(e.value)
        assert "params/w has shape (4, 3) in the checkpoint and (4, 5) here" in msg
        assert "partial_restore" not in msg and "strict" not in msg
    ckpt.close()
    assert (tmp_path / "checkpoints" / "1").is_dir()  # a mismatch is not damage: nothing moved
    saved = _config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config_as_json(saved)))
    assert "model.tiny.hidden_size: 64 -> 32" in explain_mismatch(_config(tmp_path, **{"model.tiny.hidden_size": 32}))
    (tmp_path / "config.json").unlink()
    assert "config.json is missing" in explain_mismatch(saved)


def test_trim_records_keeps_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"step": s, "puzzle": p}) + "\n" for s in (0, 2, 4) for p in (0, 1))
                    + '{"step": 6, "puz')  # a line cut by a crash
    trim_records(path, 2)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 0, 2, 2]


def test_rerun_after_a_crash_between_evaluation_and_checkpoint_writes_each_evaluation_once(tmp_path):
    """Step 2 was evaluated (records written) but its checkpoint never landed: the rerun resumes at
    step 1, evaluates step 2 again, and the JSONL holds each evaluation's records once."""
    from ragen_jax.training.trainer import train

    workdir = tmp_path / "run"
    train(small_config(workdir, total_steps=2))
    shutil.rmtree(workdir / "checkpoints" / "2")
    before = [json.loads(x) for x in (workdir / "eval" / "transcripts.jsonl").read_text().splitlines()]
    out = train(small_config(workdir, total_steps=2))
    assert out["summary"]["steps"] == 2.0
    after = [json.loads(x) for x in (workdir / "eval" / "transcripts.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in after]
    assert steps.count(0) == 2 and steps.count(2) == 2, steps  # eval.num_episodes = 2 per evaluation
    assert [r["transcript"] for r in after] == [r["transcript"] for r in before]  # exact resume


def test_end_to_end_resume_false_refused_then_overwrite_trains_fresh(tmp_path):
    from ragen_jax.training.trainer import train

    workdir = tmp_path / "run"
    fast = {"trainer.eval_every": 0, "trainer.eval_before_train": False, "warmup.steps": 0,
            "warmup.single_turn_steps": 0}
    train(small_config(workdir, total_steps=1, **fast))
    with pytest.raises(ConfigError, match="already holds a run"):
        train(small_config(workdir, total_steps=1, **{**fast, "trainer.resume": False}))
    out = train(small_config(workdir, total_steps=1, **{**fast, "trainer.overwrite": True, "rollout.temperature": 0.9}))
    assert out["summary"]["steps"] == 1.0
    ckpt = Checkpointer(workdir / "checkpoints")
    assert ckpt.all_steps() == [0, 1]
    ckpt.close()
    assert json.loads((workdir / "config.json").read_text())["rollout"]["temperature"] == 0.9
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]) == 1


# --- one writer per workdir -----------------------------------------------------------------------

HOLD_LOCK = """
import sys, time
from ragen_jax.training.workdir import WorkdirLock
lock = WorkdirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def _holder(workdir):
    """A separate process that takes the workdir's lock and holds it (bounded: 120 s)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(workdir)], stdout=subprocess.PIPE, text=True,
                            cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_on_a_workdir_in_use_is_refused_naming_the_holder(tmp_path):
    from ragen_jax.training.trainer import train

    workdir = tmp_path / "run"
    proc = _holder(workdir)
    try:
        with pytest.raises(ConfigError, match=rf"in use by another run \(PID {proc.pid} on .*choose another"):
            train(small_config(workdir, total_steps=1))
        assert not (workdir / "config.json").exists()  # refused before touching the workdir
        with pytest.raises(ConfigError, match=f"PID {proc.pid}"):
            WorkdirLock(workdir).acquire()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_the_lock_of_a_killed_run_is_taken_over_with_a_note(tmp_path, capsys):
    import signal

    workdir = tmp_path / "run"
    proc = _holder(workdir)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    with WorkdirLock(workdir) as lock:
        assert f"PID {proc.pid}" in lock.note
    assert "took over the lock" in capsys.readouterr().out
    with WorkdirLock(workdir) as lock:  # released cleanly: no note the next time
        assert lock.note is None


def test_eval_on_a_held_out_split_of_the_runs_task_is_allowed_and_said(tmp_path):
    """``env.split`` chooses which questions of the same task are scored: a run trained on the train
    split may be evaluated on the test split (with a note); any other env key is still refused."""
    pytest.importorskip("bm25s")
    from configs import search_tools

    config = search_tools.get_config()
    config.workdir = str(tmp_path)
    _fake_run(tmp_path, config)
    held_out = search_tools.get_config()
    held_out.workdir, held_out.mode, held_out.env.split = str(tmp_path), "eval", "test"
    notes = check_eval_workdir(resolve(held_out))
    assert len(notes) == 1 and "env.split: 'train' -> 'test'" in notes[0]
    held_out.env.top_k = 3
    with pytest.raises(ConfigError, match=r"env\.top_k: 2 -> 3"):
        check_eval_workdir(resolve(held_out))
