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
from ragen_jax.training.logging import Logger, quadrant_figure, read_events, to_host_scalars


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

    from ragen_jax.training.logging import quadrant_lines

    assert quadrant_lines((0.8, 2.0), 0.3, 0.7) == pytest.approx((0.24, 1.4))
    import matplotlib.axes

    with mock.patch.object(matplotlib.axes.Axes, "axhline", autospec=True) as h, \
            mock.patch.object(matplotlib.axes.Axes, "axvline", autospec=True) as v:
        quadrant_figure([(1, 0.8, 2.0)], baseline=(0.8, 2.0), mi_ratio=0.3, entropy_ratio=0.7)
    assert h.call_args[0][1] == pytest.approx(0.24) and v.call_args[0][1] == pytest.approx(1.4)
