"""Python text environments, run in the on-device loop through ``ragen_jax.rollout.host_env.HostEnv``.

Each class has ``reset(seed) -> str`` and ``step(action: str) -> (str, reward, done, info)``, plus
``instruction`` (the task paragraph of the system prompt) and ``action_names`` (``None``: free
text — every answer part reaches ``step`` as written). Their data are local files; a missing file
is an error naming the path and the ``config.env`` key that sets it.
"""
from __future__ import annotations

import os
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def data_file(path: str | os.PathLike | None, default: str, key: str) -> Path:
    """``path`` (or the shipped ``default`` file) as an existing Path, else a clear error."""
    p = Path(os.path.expanduser(str(path))) if path else DATA_DIR / default
    if not p.is_file():
        raise FileNotFoundError(f"{p} does not exist; set config.env.{key} to a local file "
                                f"(--config.env.{key}=/path/to/file)")
    return p


def load_records(path: Path, columns: tuple[str, ...], key: str) -> list[dict]:
    """Rows of a local JSONL / JSON / parquet / CSV file, read with the ``datasets`` library's local
    loaders; every row must have ``columns``."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - the envs extra installs it
        raise ImportError("reading a dataset file needs the `datasets` package: pip install 'ragen_jax[envs]'") from e
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(path.suffix)
    if kind is None:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r} (config.env.{key}); use .jsonl, .json, "
                         ".parquet or .csv")
    datasets.disable_progress_bars()
    ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise ValueError(f"{path} (config.env.{key}) has no column(s) {missing}; it has {ds.column_names}")
    if len(ds) == 0:
        raise ValueError(f"{path} (config.env.{key}) has no rows")
    return ds.to_list()
