"""Checkpoints (orbax: round trip, keep-last-k, atomic under a crash mid-save) and TensorBoard logging."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.training.checkpoint import Checkpointer
from ragen_jax.training.event_log import Logger, quadrant_figure, read_events, to_host_scalars


def _state(seed):
    rng = np.random.default_rng(seed)
    return {"params": {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
                       "b": jnp.asarray(rng.normal(size=(3,)), jnp.bfloat16)},
            "step": jnp.int32(seed), "key": jax.random.key(seed), "raw_key": jax.random.PRNGKey(seed)}


def test_round_trip_and_keep_last(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, _state(step), {"step": step, "history": [[step, 0.5, np.float32(1.5)]]})
    assert ckpt.all_steps() == [2, 3]
    restored, meta, step = ckpt.restore(_state(0))
    assert step == 3 and meta == {"step": 3, "history": [[3, 0.5, 1.5]]}
    ref = _state(3)
    np.testing.assert_array_equal(restored["params"]["w"], ref["params"]["w"])
    assert restored["params"]["b"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(restored["params"]["b"], np.float32),
                                  np.asarray(ref["params"]["b"], np.float32))
    # Typed keys come back as typed keys producing the same random numbers.
    assert jax.dtypes.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.uniform(restored["key"], (3,)), jax.random.uniform(ref["key"], (3,)))
    np.testing.assert_array_equal(restored["raw_key"], ref["raw_key"])
    ckpt.close()


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    """A process killed while writing step 2 leaves step 1 as the latest, fully readable checkpoint."""
    directory = tmp_path / "ckpt"
    ckpt = Checkpointer(directory, keep=3)
    ckpt.save(1, _state(1), {"step": 1})
    ckpt.close()
    # The child starts saving a large step-2 state and dies (os._exit, no cleanup) while orbax writes
    # it: a watcher thread exits the process as soon as the step-2 temporary directory appears. If the
    # save finished first the child exits 0 and the test fails rather than passing vacuously.
    script = textwrap.dedent(f"""
        import os, threading, time, jax.numpy as jnp, numpy as np
        from ragen_jax.training.checkpoint import Checkpointer
        c = Checkpointer({str(directory)!r}, keep=3)
        big = {{"params": {{"w": jnp.ones((4, 3)), "b": jnp.ones((3,), jnp.bfloat16)}},
               "extra": [jnp.asarray(np.random.default_rng(i).normal(size=(512, 512)), jnp.float32) for i in range(40)]}}
        def watch():
            while True:
                if any(n.startswith("2") and n != "2" for n in os.listdir({str(directory)!r})):
                    os._exit(9)
                time.sleep(0.0005)
        threading.Thread(target=watch, daemon=True).start()
        c._manager.save(2, args=__import__("orbax.checkpoint").checkpoint.args.Composite(
            state=__import__("orbax.checkpoint").checkpoint.args.StandardSave(big),
            meta=__import__("orbax.checkpoint").checkpoint.args.JsonSave({{"step": 2}})))
        c._manager.wait_until_finished()
        time.sleep(2)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd(), capture_output=True, timeout=120)
    assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    again = Checkpointer(directory, keep=3)
    assert again.latest_step() == 1
    restored, meta, step = again.restore(_state(0))
    assert step == 1 and meta == {"step": 1}
    np.testing.assert_array_equal(restored["params"]["w"], _state(1)["params"]["w"])
    again.close()


def test_tensorboard_scalars_text_image(tmp_path):
    log = Logger(tmp_path / "tb")
    metrics = {"train": {"success": np.float32(0.25), "return": jnp.float32(-0.5)},
               "actor/grad_norm": 1.5, "vector": np.zeros(3)}
    flat = to_host_scalars(metrics)
    assert flat == {"train/success": 0.25, "train/return": -0.5, "actor/grad_norm": 1.5}
    log.scalars(3, flat)
    log.scalars(4, {"train/success": float("nan")})  # non-finite values are not written
    log.text(3, "transcripts/train", "#P_#\n#_G#")
    img = quadrant_figure([(1, 0.5, 2.0), (2, 0.3, 1.9)], baseline=(0.5, 2.0))
    assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
    log.image(3, "collapse/quadrant", img)
    log.close()
    ev = read_events(tmp_path / "tb")
    assert ev["train/success"] == [(3, 0.25)]
    assert ev["train/return"] == [(3, -0.5)] and ev["actor/grad_norm"] == [(3, 1.5)]
    assert ev["transcripts/train"][0][1] == "text" and ev["collapse/quadrant"][0][1] == "image"


def test_quadrant_lines_follow_the_configured_regime_ratios():
    """The dashed lines are the thresholds ``classify_regime`` uses: ratio × baseline."""
    from unittest import mock

    from ragen_jax.training.event_log import quadrant_lines

    assert quadrant_lines((0.8, 2.0), 0.3, 0.7) == pytest.approx((0.24, 1.4))
    import matplotlib.axes

    with mock.patch.object(matplotlib.axes.Axes, "axhline", autospec=True) as h, \
            mock.patch.object(matplotlib.axes.Axes, "axvline", autospec=True) as v:
        quadrant_figure([(1, 0.8, 2.0)], baseline=(0.8, 2.0), mi_ratio=0.3, entropy_ratio=0.7)
    assert h.call_args[0][1] == pytest.approx(0.24) and v.call_args[0][1] == pytest.approx(1.4)


def test_a_deleted_events_file_is_noticed_and_a_new_one_takes_the_rest(tmp_path, capsys):
    from ragen_jax.training.event_log import read_scalars

    log = Logger(tmp_path / "tb")
    log.scalars(1, {"train/x": 1.0})
    log.flush()
    first = log.events_file
    first.unlink()
    log.scalars(2, {"train/x": 2.0})
    log.scalars(3, {"train/x": 3.0})
    log.close()
    assert "was deleted during the run" in capsys.readouterr().err
    assert read_scalars(tmp_path / "tb")["train/x"] == [(2, 2.0), (3, 3.0)]


def _events_with_a_killed_tail(log_dir):
    """What a run killed after logging step 3 (its last checkpoint: step 2) leaves behind: warm-up
    series with their own step count, validation at 0, StarPO steps 1..3."""
    log = Logger(log_dir)
    for s in (10, 20, 30):
        log.scalars(s, {"warmup/loss": 1.0 / s})
    for s in range(4):
        log.scalars(s, {"val/success": 0.1 * s})
    log.text(3, "transcripts", "step 3")
    log.close()


def test_trim_events_keeps_one_value_per_step_for_a_resumed_run(tmp_path):
    from ragen_jax.training.event_log import read_events, read_scalars, trim_events

    tb = tmp_path / "tb"
    _events_with_a_killed_tail(tb)
    trim_events(tb, 2)
    s = read_scalars(tb)
    assert [step for step, _ in s["warmup/loss"]] == [10, 20, 30]  # never re-run: kept
    assert [step for step, _ in s["val/success"]] == [0, 1, 2]
    assert "transcripts" not in read_events(tb)
    # The resumed run logs step 3 again: one value per step.
    log = Logger(tb)
    log.scalars(3, {"val/success": 0.9})
    log.close()
    assert read_scalars(tb)["val/success"][-1] == (3, pytest.approx(0.9))
    assert [step for step, _ in read_scalars(tb)["val/success"]] == [0, 1, 2, 3]


def test_trim_events_moves_a_dead_first_attempts_events_aside(tmp_path):
    from ragen_jax.training.event_log import read_scalars, trim_events

    tb = tmp_path / "tb"
    _events_with_a_killed_tail(tb)
    trim_events(tb, -1)
    assert not tb.exists()
    stale = list(tmp_path.glob("tb.stale-*"))
    assert len(stale) == 1 and read_scalars(stale[0])["warmup/loss"]


def test_a_run_killed_after_logging_a_step_resumes_with_one_value_per_step(tmp_path):
    """The trainer trims at start-up: a run stopped at step 2 (checkpointed) whose later step 3 was
    logged but not saved (as a kill between the two leaves it) resumes to step 3 with one value of
    every series at every step."""
    from ragen_jax.training.event_log import read_scalars
    from ragen_jax.training.trainer import StopTraining, train
    from tests.training.test_trainer import small_config

    def stop(step, metrics):
        if step == 2:
            raise StopTraining()

    train(small_config(tmp_path, total_steps=3), step_callback=stop)
    stale = Logger(tmp_path / "tensorboard")
    stale.scalars(3, {"train/success": 0.5, "actor/pg_loss": 9.0})  # what the killed step 3 logged
    stale.close()
    train(small_config(tmp_path, total_steps=3))
    for tag, series in read_scalars(tmp_path / "tensorboard").items():
        steps = [step for step, _ in series]
        assert len(steps) == len(set(steps)), (tag, steps)
    assert 9.0 not in [v for _, v in read_scalars(tmp_path / "tensorboard")["actor/pg_loss"]]
