"""W&B logging (``logging.wandb=True``), offline: the run file holds what TensorBoard holds, and a
resumed run continues the same W&B run. The run file is read with a reader written from W&B's file
format (``wandb_file.py``), independently of the sink. Runs are seeded (``seed=0``)."""
from __future__ import annotations

import glob

import numpy as np
import pytest

pytest.importorskip("wandb")

from ragen_jax.config import ConfigError, resolve  # noqa: E402
from ragen_jax.training.event_log import read_scalars  # noqa: E402
from tests.training import wandb_file  # noqa: E402
from tests.training.test_trainer import small_config_dict  # noqa: E402


def _run_files(workdir):
    return sorted(glob.glob(str(workdir / "wandb" / "offline-run-*" / "run-*.wandb")))


def _wandb_scalars(rows):
    """``{tag: {step: value}}`` from the history rows, each on its own axis (warmup/step or trainer/step)."""
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        step = row.get("warmup/step", row.get("trainer/step"))
        for k, v in row.items():
            if k not in ("warmup/step", "trainer/step", "_step", "_timestamp", "_runtime") and isinstance(v, (int, float)):
                out.setdefault(k, {})[int(step)] = float(v)
    return out


def test_wandb_holds_what_tensorboard_holds_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    from ragen_jax.training.trainer import StopTraining, train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    workdir = tmp_path / "run"
    cfg = small_config_dict(workdir, total_steps=2)
    cfg.logging.wandb = True
    cfg.logging.tags = ("test", "frozen_lake")

    def interrupt(step, metrics):
        if step == 1:
            raise StopTraining

    assert train(resolve(cfg), step_callback=interrupt)["stop_reason"] == "interrupted by callback"
    run_id = (workdir / "wandb_run_id").read_text()
    first_files = _run_files(workdir)
    assert len(first_files) == 1 and wandb_file.run_id(first_files[0]) == run_id
    train(resolve(cfg))  # resumes from checkpoint 1 and runs step 2
    files = _run_files(workdir)
    assert len(files) == 2 and {wandb_file.run_id(f) for f in files} == {run_id}  # one W&B run
    second = [f for f in files if f not in first_files][0]
    second_rows = wandb_file.history(second)
    assert {int(r["trainer/step"]) for r in second_rows if "trainer/step" in r} == {2}  # only the new step

    # Every TensorBoard scalar, at every step, is in the W&B run with the same value (float32 in TB).
    tb = read_scalars(workdir / "tensorboard")
    wb = _wandb_scalars(wandb_file.history(first_files[0]) + second_rows)
    assert set(tb) == set(wb), set(tb) ^ set(wb)
    for tag, series in tb.items():
        for step, value in series:
            assert np.float32(wb[tag][step]) == np.float32(value), (tag, step, wb[tag][step], value)
    assert {"warmup/step", "trainer/step"} <= {k for r in wandb_file.history(first_files[0]) for k in r}

    # The images and the transcript table TensorBoard gets.
    logged = {k for f in files for r in wandb_file.history(f) for k in r}
    assert {"curves/learning_curve", "transcripts/train"} <= logged
    table = [r["transcripts/train"] for r in second_rows if "transcripts/train" in r][-1]
    assert table["_type"] == "table-file" and table["ncols"] == 2


def test_logging_section_is_checked():
    cfg = small_config_dict("/tmp/unused", total_steps=1)
    cfg.logging.mode = "cloud"
    with pytest.raises(ConfigError, match="logging.mode='cloud' is not valid; allowed: online, offline, disabled"):
        resolve(cfg)
