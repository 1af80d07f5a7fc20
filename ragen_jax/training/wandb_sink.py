"""Weights & Biases as a second sink of the run's logger (``config.logging.wandb=True``).

The ``event_log.Logger`` hands every scalar, image and text it writes to TensorBoard to this sink
too, on the main process only (other processes of a multi-host run have no logger). W&B keeps one
step counter per run that must only grow, while a run logs two series with their own steps (the
warm-up's behaviour-cloning steps, then StarPO steps from 0): each record therefore carries its
own x-axis value, ``warmup/step`` or ``trainer/step`` (``define_metric``), and W&B's internal step
just counts records. The same holds after a resume: the run id is kept in ``<workdir>/wandb_run_id``
and the resumed process continues that W&B run; the steps after the last checkpoint, which it runs
again, appear twice on the ``trainer/step`` axis, as in TensorBoard before its events are trimmed.

Offline (``logging.mode=offline`` or ``WANDB_MODE=offline``) the run is written under
``<workdir>/wandb/`` and can be uploaded later with ``wandb sync``.
"""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Mapping

import numpy as np

from ragen_jax.config import ConfigError, LoggingConfig

RUN_ID_FILE = "wandb_run_id"


class WandbSink:
    """One W&B run for one workdir: ``scalars`` / ``image`` / ``text`` / ``close`` like the logger's."""

    def __init__(self, cfg: LoggingConfig, workdir: str | Path, config: dict):
        try:
            import wandb
        except ImportError:
            raise ConfigError("logging.wandb=True needs the wandb package: pip install 'ragen_jax[wandb]' "
                              "(or pip install wandb), or set logging.wandb=False") from None
        self._wandb = wandb
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        id_file = workdir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.run_name or workdir.name,
                              tags=list(cfg.tags), config=config, id=run_id, resume="allow", dir=str(workdir),
                              mode=cfg.mode, settings=wandb.Settings(quiet=True, console="off"))
        id_file.write_text(run_id)
        self.run_id = run_id
        self.run.define_metric("trainer/step")
        self.run.define_metric("warmup/step")
        self._families: set[str] = set()
        self._transcripts: dict[str, list] = {}

    def _axis(self, tag: str) -> str:
        """The x-axis of ``tag``'s family (declared to W&B the first time the family is seen)."""
        family = tag.split("/", 1)[0]
        axis = "warmup/step" if family == "warmup" else "trainer/step"
        if family not in self._families:
            self._families.add(family)
            self.run.define_metric(f"{family}/*", step_metric=axis)
        return axis

    def scalars(self, step: int, metrics: Mapping[str, float]) -> None:
        by_axis: dict[str, dict] = {}
        for name, value in metrics.items():
            if np.isfinite(value):
                by_axis.setdefault(self._axis(name), {})[name] = float(value)
        for axis, values in by_axis.items():
            self.run.log({**values, axis: step})

    def image(self, step: int, tag: str, rgb: np.ndarray) -> None:
        self.run.log({tag: self._wandb.Image(np.asarray(rgb)), self._axis(tag): step})

    def text(self, step: int, tag: str, text: str) -> None:
        """A table per tag, one row per logged text (the whole table is logged again each time: W&B
        tables are immutable)."""
        rows = self._transcripts.setdefault(tag, [])
        rows.append([step, text])
        self.run.log({tag: self._wandb.Table(columns=["step", "text"], data=[list(r) for r in rows]),
                      self._axis(tag): step})

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
