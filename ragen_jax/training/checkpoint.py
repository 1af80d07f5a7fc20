"""Orbax checkpoints of the whole training state, for exact resume.

One checkpoint = two items:
  * ``state``: the array pytree — the StarPO ``TrainState`` (policy / critic / reference params,
    optimizer states, step, RNG, collapse EMA and baseline state, filter counters) plus the trainer's
    own device-side values (its RNG key);
  * ``meta``: JSON host state — step counter, early-stop counters and baselines, the MI / entropy
    history behind the quadrant image, so a resumed run logs exactly what an uninterrupted one would.

Orbax's ``CheckpointManager`` writes each step into a temporary directory and renames it when
complete, so a crash mid-save leaves the previous checkpoint as the latest readable one (tested).
Typed PRNG keys are stored as their raw ``key_data`` and re-wrapped on restore.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


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


class Checkpointer:
    """Save every ``save_every`` steps, keep the last ``keep`` checkpoints, restore the latest.

    Args:
      directory: where step folders (``<dir>/<step>/``) are written.
      keep: number of most recent checkpoints to keep (older ones are deleted after a save).
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3):
        self.directory = Path(directory).resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False,
                                                 create=True),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Write ``state`` (array pytree) and ``meta`` (JSON-able dict) as checkpoint ``step``."""
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_encode(state)),
                                                         meta=ocp.args.JsonSave(_jsonable(meta))))
        self._manager.wait_until_finished()

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict, int]:
        """Restore ``step`` (default: latest) into the structure, dtypes and shardings of ``like``.

        Returns ``(state, meta, step)``. Raises FileNotFoundError when there is no checkpoint.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}; train first or set trainer.resume=False")
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract(like)), meta=ocp.args.JsonRestore()))
        return _decode(out["state"], like), dict(out["meta"]), step

    def close(self) -> None:
        self._manager.close()


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
