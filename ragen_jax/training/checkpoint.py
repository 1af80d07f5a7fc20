"""Orbax checkpoints of the whole training state, for exact resume.

One checkpoint = two items:
  * ``state``: the array pytree — the StarPO ``TrainState`` (policy / critic / reference params,
    optimizer states, step, RNG, collapse EMA and baseline state, filter counters) plus the trainer's
    own device-side values (its RNG key);
  * ``meta``: JSON host state — step counter, early-stop counters and baselines, the MI / entropy
    history behind the quadrant image, so a resumed run logs exactly what an uninterrupted one would.

Orbax's ``CheckpointManager`` writes each step into a temporary directory and renames it when
complete, so a crash mid-save leaves the previous checkpoint as the latest readable one (tested).
A checkpoint damaged afterwards (a truncated data file, deleted metadata) is skipped on resume in
favour of the newest one that restores (``restore_latest_intact``), and one that does not fit the
model being restored into is reported by array path and shape before any data is read.
Typed PRNG keys are stored as their raw ``key_data`` and re-wrapped on restore.

``restore_train_state`` is the one way a run's ``TrainState`` comes back: the trainer's resume,
``mode=eval``, ``mode=export`` and the server all go through it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from ragen_jax.starpo.train_state import saved_part, with_base
from ragen_jax.training.workdir import explain_mismatch


def _is_typed_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _encode(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_typed_key(x) else x, tree)


def _decode(restored: Any, like: Any) -> Any:
    return jax.tree.map(
        lambda r, t: jax.random.wrap_key_data(r, impl=jax.random.key_impl(t)) if _is_typed_key(t) else r,
        restored, like)


def _abstract(tree: Any) -> Any:
    """Shape/dtype (and sharding) target for restoring into the same structure as ``tree``."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, _encode(tree))


class CheckpointMismatch(ValueError):
    """A checkpoint whose arrays do not fit the structure it is restored into (another model or run)."""


class NoIntactCheckpoint(RuntimeError):
    """Every checkpoint in the directory failed to restore (each reason is in the message)."""


def _path_names(path) -> tuple[str, ...]:
    """A pytree key path as plain names, the same for a dataclass state and orbax's metadata dicts."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


def _shapes(tree) -> dict[tuple[str, ...], tuple[int, ...]]:
    return {_path_names(p): tuple(getattr(x, "shape", ())) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def structure_mismatch(saved: dict, wanted: dict, limit: int = 4) -> str | None:
    """One sentence on how two ``{path: shape}`` maps differ, or None when they agree."""
    problems = []
    for path in sorted(set(saved) | set(wanted)):
        name = "/".join(path)
        if path not in saved:
            problems.append(f"{name} is not in the checkpoint")
        elif path not in wanted:
            problems.append(f"{name} is in the checkpoint but not in this model")
        elif saved[path] != wanted[path]:
            problems.append(f"{name} has shape {saved[path]} in the checkpoint and {wanted[path]} here")
    if not problems:
        return None
    more = f" (and {len(problems) - limit} more)" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


@contextlib.contextmanager
def _quiet_stderr(log: list[str]):
    """Route file descriptor 2 to a buffer: a failing tensorstore read prints a traceback per array
    from its own threads, hundreds of lines that say nothing the caught exception does not."""
    sys.stderr.flush()
    saved, hook = os.dup(2), sys.unraisablehook
    # The same tracebacks also reach Python as "unraisable" exceptions of those threads.
    sys.unraisablehook = lambda u: log.append(f"{u.exc_type.__name__}: {u.exc_value}")
    with tempfile.TemporaryFile(mode="w+b") as buf:
        os.dup2(buf.fileno(), 2)
        try:
            yield
        finally:
            time.sleep(0.05)  # let the reader threads finish printing before stderr comes back
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sys.unraisablehook = hook
            buf.seek(0)
            log.append(buf.read().decode("utf-8", "replace"))


def _short_reason(e: BaseException, limit: int = 400) -> str:
    """One line for a damaged checkpoint: the first line of each exception down the chain (orbax wraps
    tensorstore's error, which names the file and byte range), without tensorstore's spec dumps."""
    lines: list[str] = []
    while e is not None and len(lines) < 4:
        text = f"{type(e).__name__}: {e}"
        for noise in (" See full TensorStore details", " [tensorstore_spec"):
            text = text.split(noise)[0]
        text = text.splitlines()[0].rstrip(". ") if text.strip() else type(e).__name__
        if text not in lines:
            lines.append(text)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    text = " <- ".join(lines)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class Checkpointer:
    """Save every ``save_every`` steps, keep the last ``keep`` checkpoints, restore the latest intact one.

    Args:
      directory: where step folders (``<dir>/<step>/``) are written.
      keep: number of most recent checkpoints to keep (older ones are deleted after a save).
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3, placement=None):
        # A run on two disjoint process sets (``placement.peer``) saves its arrays spanning both.
        self.placement = placement if placement is not None and placement.peer is not None else None
        self.directory = Path(directory).resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._manager = ocp.CheckpointManager(
            self.directory,
            # Asynchronous: a save returns once the arrays are copied off the devices, and the files
            # are written while training goes on (the next save, a restore or close waits for it).
            # Processes meet at barriers named by step; the folder's name keeps two managers saving the
            # same step (the train state and the asynchronous rollout's batches in flight) apart.
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True,
                                                 multiprocessing_options=ocp.options.MultiprocessingOptions(
                                                     barrier_sync_key_prefix=self.directory.name)),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
        )

    def latest_step(self) -> int | None:
        self.wait()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        self.wait()
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Write ``state`` (array pytree) and ``meta`` (JSON-able dict) as checkpoint ``step``."""
        state = _encode(state) if self.placement is None else self.placement.spanning(_encode(state))
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(_jsonable(meta))))

    def wait(self) -> None:
        """Block until the last save is on disk."""
        self._manager.wait_until_finished()

    def saved_shapes(self, step: int) -> dict[tuple[str, ...], tuple[int, ...]]:
        """``{array path: shape}`` of checkpoint ``step``, from its metadata (no array is read)."""
        self.wait()
        shapes = _shapes(self._manager.item_metadata(step)["state"])
        if not shapes:  # a save always writes at least the step counter: no entries is damage, not a new layout
            raise FileNotFoundError(f"checkpoint {self.directory}/{step} lists no arrays (its state/_METADATA is "
                                    "missing or empty)")
        return shapes

    def check_fits(self, like: Any, step: int, saved: dict | None = None) -> None:
        """Raise ``CheckpointMismatch`` when checkpoint ``step``'s arrays (``saved``: its
        ``saved_shapes``, read here when not given) do not fit ``like``'s."""
        saved = self.saved_shapes(step) if saved is None else saved
        problem = structure_mismatch(saved, _shapes(_encode(like)))
        if problem:
            raise CheckpointMismatch(f"checkpoint {self.directory}/{step} does not fit the state built from "
                                     f"this config: {problem}")

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict, int]:
        """Restore ``step`` (default: latest) into the structure, dtypes and shardings of ``like``.

        Returns ``(state, meta, step)``. Raises FileNotFoundError when there is no checkpoint and
        ``CheckpointMismatch`` when its arrays do not fit ``like``.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}; train first or set trainer.resume=False")
        self.check_fits(like, step)
        out = self._read(like, step)
        return _decode(out["state"], like), dict(out["meta"]), step

    def read_meta(self, step: int) -> dict:
        """Checkpoint ``step``'s ``meta`` alone (no array is read)."""
        self.wait()
        return dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def _read(self, like: Any, step: int):
        self.wait()
        target = _abstract(like)
        spanning = self.placement is not None  # saved over both sides of the run: read so, keep like's side
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(self.placement.spanning_target(target) if spanning else target),
            meta=ocp.args.JsonRestore()))
        if spanning:
            out = {"state": self.placement.one_side(out["state"], target), "meta": out["meta"]}
        return out

    def restore_latest_intact(self, like: Any, set_aside: bool = True) -> tuple[Any, dict, int, list[tuple[int, str]]]:
        """Restore the newest checkpoint that reads back whole; returns ``(state, meta, step, skipped)``.

        A damaged checkpoint (a truncated data file, missing metadata) is skipped, with its reason in
        ``skipped``, and moved to ``<dir>.damaged/<step>`` so that later saves of those step numbers
        are written (orbax never writes a step at or below its latest) and nothing is deleted. A
        checkpoint that reads but does not fit ``like`` raises ``CheckpointMismatch`` (that is a
        config problem, not damage); when none restores, ``NoIntactCheckpoint`` lists every reason.
        ``set_aside=False`` (evaluation) leaves the damaged ones where they are.
        """
        skipped: list[tuple[int, str]] = []
        for step in sorted(self.all_steps(), reverse=True):
            log: list[str] = []
            try:
                with _quiet_stderr(log):
                    shapes = self.saved_shapes(step)
                self.check_fits(like, step, shapes)
                with _quiet_stderr(log):
                    out = self._read(like, step)
            except CheckpointMismatch:
                raise
            except Exception as e:  # noqa: BLE001 - any read failure means this step is damaged
                skipped.append((step, _short_reason(e)))
                continue
            if set_aside:
                self._set_aside([s for s, _ in skipped])
            return _decode(out["state"], like), dict(out["meta"]), step, skipped
        reasons = "; ".join(f"step {s}: {r}" for s, r in skipped)
        raise NoIntactCheckpoint(f"no checkpoint in {self.directory} restores ({reasons}); start a new run in "
                                 "another workdir, or pass --config.trainer.overwrite=True to move this one aside")

    def _set_aside(self, steps: list[int]) -> None:
        if not steps:
            return
        if jax.process_index() == 0:  # one process moves the folders; every process then rereads
            aside = self.directory.parent / f"{self.directory.name}.damaged"
            aside.mkdir(exist_ok=True)
            for step in steps:
                target = aside / str(step)
                if target.exists():
                    target = aside / f"{step}.{int(time.time())}"
                shutil.move(str(self.directory / str(step)), str(target))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("damaged checkpoints set aside")
        self._manager.reload()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


@dataclasses.dataclass(frozen=True)
class Restored:
    """A run's state read back: ``train_state`` in the layout of the state it was restored into
    (a LoRA run's frozen base taken from there), the host ``meta``, the checkpoint's ``step``, and the
    damaged checkpoints ``skipped`` on the way as ``(step, reason)``."""

    train_state: Any
    meta: dict
    step: int
    skipped: list[tuple[int, str]]


def restore_train_state(ckpt: Checkpointer, fresh: Any, config, step: int | None = None, *,
                        set_aside: bool = True) -> Restored:
    """Checkpoint ``step`` of ``ckpt`` (None: the newest that reads back whole, damaged ones skipped
    and, with ``set_aside``, moved to ``<dir>.damaged/``) restored into the structure, dtypes and
    shardings of ``fresh`` (this run's initial ``TrainState``); a LoRA run's adapters go back onto
    ``fresh``'s base. A checkpoint that does not fit raises ``CheckpointMismatch`` naming the
    ``config`` keys that differ from the run's own; a ``step`` it does not hold, ``NoIntactCheckpoint``."""
    like = saved_part(fresh)
    try:
        if step is None:
            state, meta, step, skipped = ckpt.restore_latest_intact(like, set_aside=set_aside)
        else:
            steps = ckpt.all_steps()
            if step not in steps:
                raise NoIntactCheckpoint(
                    f"{ckpt.directory} has no checkpoint {step}; it holds steps {', '.join(map(str, steps)) or 'none'}")
            (state, meta, step), skipped = ckpt.restore(like, step), []
    except CheckpointMismatch as e:
        raise CheckpointMismatch(f"{e}. {explain_mismatch(config)}") from None
    return Restored(with_base(state, fresh), meta, step, skipped)


def _jsonable(x: Any) -> Any:
    """Convert NumPy / JAX scalars and arrays inside ``x`` into plain JSON values."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.ndarray, jax.Array)):
        return np.asarray(x).tolist()
    if isinstance(x, np.generic):
        return x.item()
    return x
