"""A run's workdir: one run per directory, never silently replaced, mixed or resumed on another config.

``workdir/config.json`` is the resolved config of the run whose checkpoints are in
``workdir/checkpoints``. Before training, ``prepare_training_workdir`` compares the new config with
it and decides:

* no checkpoint yet: a fresh run (stale evaluation records of an earlier attempt are cleared);
* checkpoints and ``trainer.overwrite=True``: the old run is moved to ``<workdir>.old-<time>``
  (nothing is deleted) and a fresh one starts;
* checkpoints and ``trainer.resume=False``: refused — orbax never writes a step at or below the
  latest one on disk, so a "new" run would keep the old weights under a new ``config.json``;
* checkpoints and ``trainer.resume=True``: resumed, if the configs differ only in
  ``RESUME_SAFE_KEYS`` (reported); a change to the run itself (env, model, algorithm, seed, ...)
  is refused with every differing key.

``check_eval_workdir`` does the same for ``mode=eval``: the env and model must be the run's own.
``WorkdirLock`` keeps a second process from writing into a workdir a run is using.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from ragen_jax.config import ConfigError, LoggingConfig
from ragen_jax.config.checks import field_defaults
from ragen_jax.config.resolve import SECTIONS, train_env_fields

# Keys that change how long a run goes on, how often it logs, evaluates and saves, or how it is
# driven — never what a step computes — so a resume may change them.
RESUME_SAFE_KEYS = (
    "trainer.total_steps", "trainer.time_limit_minutes", "trainer.eval_every", "trainer.log_every",
    "trainer.save_every", "trainer.transcript_every", "trainer.keep_checkpoints", "trainer.progress_bar",
    "trainer.resume", "trainer.overwrite", "trainer.stop_on_success", "trainer.eval_before_train",
    "eval.write_transcripts", "eval.checkpoint_step", "mode", "workdir", "compilation_cache_dir",
    "warmup.cache_dir",  # where a warm-up is kept, not what it computes
    # Where the metrics go besides TensorBoard.
    *(f"logging.{f.name}" for f in dataclasses.fields(LoggingConfig)),
    # A checkpoint restores onto any mesh (orbax reshards it), so a run may resume on other hardware.
    "mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.rollout_devices",
    # The gradient analysis measures; it changes no parameter.
    "trainer.gradient_analysis_every", "trainer.gradient_analysis_buckets", "trainer.gradient_analysis_num_buckets",
)
# In eval mode only these must be the run's own: a checkpoint scored on another env or restored
# into another model measures nothing.
EVAL_MUST_MATCH = ("env.", "model.")
# ... except these, which choose which questions of the same task are scored (a held-out split).
EVAL_MAY_CHANGE = ("env.split",)


# --- one writer per workdir -----------------------------------------------------------------------


def lock_path(workdir: str | Path) -> Path:
    """Where a workdir's lock lives: beside it (``.<name>.lock``), so that moving the workdir aside
    (``trainer.overwrite``) does not move the lock with it."""
    workdir = Path(workdir).expanduser().absolute()
    return workdir.parent / f".{workdir.name}.lock"


class WorkdirLock:
    """An exclusive, advisory lock that makes a workdir one run's (``fcntl.flock`` on ``lock_path``).

    The kernel drops the lock when its holder dies, however it dies (``kill -9`` included), so a lock
    left by a dead run is simply taken over, with a note naming it. The file holds the holder's PID,
    host and start time, which a refused second run names. Used as a context manager.
    """

    def __init__(self, workdir: str | Path):
        self.workdir = Path(workdir)
        self.path = lock_path(workdir)
        self._file = None
        self.note: str | None = None

    def acquire(self) -> "WorkdirLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(self.path, "a+")
        except OSError as e:
            raise ConfigError(f"cannot create the lock {self.path} for workdir={str(self.workdir)!r}: "
                              f"{e.strerror}; choose a writable --config.workdir") from None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise ConfigError(f"workdir={str(self.workdir)!r} is in use by another run ({holder}); a workdir holds one "
                              "run: wait for it to end, or choose another --config.workdir") from None
        handle.seek(0)
        previous = handle.read().strip()
        if previous:  # its holder released the lock without clearing it: it died
            self.note = f"took over the lock of workdir {str(self.workdir)!r} from a run that is gone ({previous})"
        handle.seek(0)
        handle.truncate()
        handle.write(f"PID {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        handle.flush()
        self._file = handle
        return self

    def release(self) -> None:
        if self._file is None:
            return

        self._file.seek(0)
        self._file.truncate()  # an empty lock file: its last holder ended cleanly
        self._file.flush()
        fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        self._file.close()
        self._file = None

    def __enter__(self) -> "WorkdirLock":
        self.acquire()
        if self.note:
            print(f"note: {self.note}")
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}} -> {"a.b": 1}`` (lists and scalars are leaves)."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def config_as_json(config) -> dict:
    """The config as ``config.json`` stores it (tuples become lists, as when read back)."""
    return json.loads(config.to_json_best_effort(sort_keys=True))


def section_defaults() -> dict[str, Any]:
    """Every section key at its dataclass default, flattened as ``config.json`` stores it."""
    defaults = {name: field_defaults(cls) for name, cls in SECTIONS.items()}
    defaults["train_env"] = dict.fromkeys(train_env_fields())  # unset: the training env is config.env
    return flatten(json.loads(json.dumps(defaults)))  # tuples -> lists, nested dicts -> dotted keys


def config_changes(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` for every key whose value differs (missing = ``<unset>``).

    A key the saved config lacks (a run written before the key existed) counts as unchanged while
    it holds its default: a key is added with the default that keeps the earlier behaviour.
    """
    a, b = flatten(saved), flatten(current)
    missing = "<unset>"
    defaults = section_defaults()
    for k in set(b) - set(a):
        if k in defaults and defaults[k] == b[k]:
            a[k] = b[k]
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if a.get(k, missing) != b.get(k, missing)]


def run_changes(saved: dict, config) -> list[tuple[str, Any, Any]]:
    """The ``config_changes`` of ``config`` against a run's saved config that alter the run itself."""
    return [c for c in config_changes(saved, config_as_json(config)) if c[0] not in RESUME_SAFE_KEYS]


def format_changes(changes: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes)


def checkpoint_steps(workdir: Path) -> list[int]:
    d = Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()) if d.is_dir() else []


def saved_config(workdir: Path) -> dict | None:
    path = Path(workdir) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e}); it should hold the run's config. Restore it, "
                          "or start a new run with --config.trainer.overwrite=True (the old run is moved aside)")


def move_aside(workdir: Path) -> Path:
    """Rename ``workdir`` to ``<workdir>.old-<time>`` (a free name); returns the new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = workdir.with_name(f"{workdir.name}.old-{stamp}")
    n = 1
    while target.exists():
        target, n = workdir.with_name(f"{workdir.name}.old-{stamp}-{n}"), n + 1
    shutil.move(str(workdir), str(target))
    return target


def prepare_training_workdir(spec) -> tuple[bool, list[str]]:
    """Check the workdir of the resolved run ``spec`` (a ``RunSpec``) against its config (see the module
    docstring), then write that config to config.json.

    Returns ``(resume, notes)``: whether to restore the latest checkpoint, and what to tell the user.
    Raises ``ConfigError`` for a run that must not start.
    """
    workdir = Path(spec.workdir)
    t = spec.trainer
    notes: list[str] = []
    steps = checkpoint_steps(workdir)
    current = config_as_json(spec.config)  # what the workdir keeps and compares: the whole config
    resume = False
    if steps and t.overwrite:
        notes.append(f"trainer.overwrite=True: the previous run (checkpoints {steps}) moved to {move_aside(workdir)}")
    elif steps and not t.resume:
        raise ConfigError(
            f"workdir {str(workdir)!r} already holds a run (checkpoints at steps {steps}) and trainer.resume=False; "
            "a new run there would keep the old weights (checkpoint steps are never rewritten). Use a new "
            "workdir (--config.workdir=...) or --config.trainer.overwrite=True, which moves the old run to "
            f"{workdir.name}.old-<time> and starts afresh")
    elif steps:
        saved = saved_config(workdir)
        if saved is None:
            notes.append(f"{workdir / 'config.json'} is missing: resuming without comparing configs")
        else:
            changes = config_changes(saved, current)
            unsafe = [c for c in changes if c[0] not in RESUME_SAFE_KEYS]
            if unsafe:
                raise ConfigError(
                    f"workdir {str(workdir)!r} holds a run with another config; resuming it would continue "
                    f"that run under these changes: {format_changes(unsafe)}. Use a new workdir "
                    "(--config.workdir=...), --config.trainer.overwrite=True to move the old run aside, or the "
                    f"run's own config (saved in {workdir / 'config.json'}). A resume may change only: "
                    f"{', '.join(k for k in RESUME_SAFE_KEYS if k not in ('mode', 'workdir'))}")
            safe = [c for c in changes if c[0] not in ("workdir", "trainer.resume")]
            if safe:
                notes.append(f"resuming with changed settings: {format_changes(safe)}")
        resume = True
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(current, indent=2, sort_keys=True))
    return resume, notes


def check_eval_workdir(spec) -> list[str]:
    """``mode=eval`` of the resolved run ``spec``: refuse a config whose env or model is not the run's;
    report other differences."""
    workdir = Path(spec.workdir)
    saved = saved_config(workdir)
    if saved is None or not checkpoint_steps(workdir):
        return []
    changes = run_changes(saved, spec.config)
    wrong = [c for c in changes if c[0].startswith(EVAL_MUST_MATCH) and c[0] not in EVAL_MAY_CHANGE]
    if wrong:
        raise ConfigError(
            f"workdir {str(workdir)!r} was trained with another env or model: {format_changes(wrong)}. "
            f"Evaluate it with the run's own config (saved in {workdir / 'config.json'}), e.g. the config file "
            "it was trained with, with only eval.* keys changed")
    notes = []
    split = [c for c in changes if c[0] in EVAL_MAY_CHANGE]
    if split:
        notes.append(f"evaluating on other data of the run's task: {format_changes(split)}")
    other = [c for c in changes if c[0].startswith("rollout.")]
    if other:
        notes.append(f"evaluating with rollout settings that differ from training: {format_changes(other)}")
    return notes


def explain_mismatch(config) -> str:
    """What to tell a user whose checkpoint does not fit the state this config builds."""
    workdir = Path(config.workdir)
    saved = saved_config(workdir)
    if saved is None:
        return (f"{workdir / 'config.json'} is missing, so the run's config cannot be compared: use the config "
                "the run was trained with (model.* and starpo.critic decide the shapes)")
    changes = run_changes(saved, config)
    if changes:
        return f"config keys that differ from the run's ({workdir / 'config.json'}): {format_changes(changes)}"
    return ("the config matches the run's config.json, so the checkpoint was written by another version of "
            "ragen_jax or edited by hand")


def trim_records(path: Path, last_step: int) -> None:
    """Keep the JSONL records of ``path`` with ``step <= last_step`` (atomically): a resumed run
    re-runs the later steps and writes their records again, once."""
    path = Path(path)
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut by a crash mid-write
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(x + "\n" for x in keep), encoding="utf-8")
    os.replace(tmp, path)
