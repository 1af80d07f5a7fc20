"""A warm-up computed once and reused: the behaviour-cloned policy, keyed by what determines it.

With ``warmup.cache_dir`` set, a run's warm-up result — the trained parameters (a LoRA model's
adapters), the warm-up's summary and the validation before RL — is stored under
``<cache_dir>/<fingerprint>/``, and every later run whose warm-up would be the same starts from it
instead of re-running behaviour cloning. ``ragen_jax.compare`` runs all its variants and seeds from
one such warm-up, so they differ only in what happens after it.

The fingerprint hashes every config key the warm-up's result depends on: the ``model``, ``env``,
``rollout`` and ``warmup`` sections and the package version (the top-level ``seed`` too when the
model has LoRA adapters, whose initialisation it draws; the tiny preset's weights come from
``model.tiny.init_seed`` and the demonstrations from ``warmup.seed``). The StarPO, filter, collapse
and trainer sections are not part of it: those are what a comparison varies. A run that finds a
cached warm-up is the same, bit for bit, as the run that wrote it would have been after its
warm-up. The stored validation is reused only when the ``eval`` section matches as well.

Entries are orbax checkpoints (written to a temporary directory and renamed), so an interrupted
write never leaves a half-entry that a later run would read. Delete the directory to recompute.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

import ragen_jax
from ragen_jax.config import ModelSection
from ragen_jax.training.checkpoint import Checkpointer, NoIntactCheckpoint
from ragen_jax.training.workdir import config_as_json

# Keys that do not change what the warm-up computes (where it is stored, how often it logs).
_IGNORED = ("cache_dir", "log_every")
_EVAL_IGNORED = ("write_transcripts", "checkpoint_step")
# Keys added to a section after caches were written, with the value that reproduces the old behaviour.
_KEYS_ADDED = {"model": {"kv_cache_dtype": None, "matmul_dtype": None}, "env": {"expert_reasoning": "after_move"}}


class CachedWarmup(NamedTuple):
    params: Any  # the trained parameters after the warm-up, in the layout of the template
    summary: dict  # warmup/* values of the run that computed it
    validation: tuple[dict, np.ndarray] | None  # (val/* metrics, per-puzzle success) before RL
    stored: dict  # every stored validation, by eval key (``save`` keeps them)


def _digest(payload: dict) -> str:
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(config) -> str:
    """The key of ``config``'s warm-up (16 hex digits)."""
    c = config_as_json(config)
    warmup = {k: v for k, v in c["warmup"].items() if k not in _IGNORED}
    # A key added after caches were written is left out at its old behaviour's value, so those caches
    # stay valid; any other value is part of the key.
    model, env = ({k: v for k, v in c[name].items() if not (k in _KEYS_ADDED[name] and v == _KEYS_ADDED[name][k])}
                  for name in ("model", "env"))
    # The API keys (a remote policy) never reach a warm-up.
    model = {k: v for k, v in model.items() if k not in ModelSection.API_KEYS}
    payload = {"version": ragen_jax.__version__, "model": model, "env": env, "rollout": c["rollout"],
               "warmup": warmup}
    if c["model"].get("lora_rank"):
        payload["seed"] = c["seed"]
    return _digest(payload)


def eval_fingerprint(config) -> str:
    """The key of the validation set and its sampling (the ``eval`` section that changes results)."""
    return _digest({k: v for k, v in config_as_json(config)["eval"].items() if k not in _EVAL_IGNORED})


class WarmupCache:
    """The entry of one config's warm-up under ``directory`` (see the module docstring)."""

    def __init__(self, directory, config):
        self.key = fingerprint(config)
        self.eval_key = eval_fingerprint(config)
        self.path = Path(directory).expanduser() / self.key

    def load(self, template) -> CachedWarmup | None:
        """The cached warm-up restored into ``template``'s layout; None when there is none yet, or
        when the entry is damaged (it is then recomputed and written again)."""
        if not self.path.exists():
            return None
        ckpt = Checkpointer(self.path, keep=1)
        try:
            if ckpt.latest_step() is None:
                return None
            params, meta, _, _ = ckpt.restore_latest_intact(template)
        except NoIntactCheckpoint as e:
            print(f"warning: the cached warm-up in {self.path} is damaged and is recomputed: {e}")
            return None
        finally:
            ckpt.close()
        stored = dict(meta.get("validation", {}))
        val = stored.get(self.eval_key)
        validation = None if val is None else (val["metrics"], np.asarray(val["puzzles"], np.float64))
        return CachedWarmup(params, {**meta["summary"], "warmup/from_cache": 1.0}, validation, stored)

    def save(self, params, summary: dict, validation: tuple[dict, np.ndarray] | None, earlier: dict | None = None):
        """Store the warm-up (and the validation under this config's eval key, next to the ones of
        other eval settings in ``earlier``, the loaded entry's)."""
        stored = dict(earlier or {})
        if validation is not None:
            metrics, puzzles = validation
            stored[self.eval_key] = {"metrics": {k: float(v) for k, v in metrics.items()},
                                     "puzzles": [float(x) for x in puzzles]}
        summary = {k: float(v) for k, v in summary.items() if k != "warmup/from_cache"}
        ckpt = Checkpointer(self.path, keep=1)
        try:
            step = (ckpt.latest_step() or 0) + 1
            ckpt.save(step, params, {"fingerprint": self.key, "summary": summary, "validation": stored})
            ckpt.wait()
        finally:
            ckpt.close()
