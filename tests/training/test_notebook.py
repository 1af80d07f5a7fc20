"""The Colab quickstart notebook executes top to bottom with tiny settings (RAGEN_NOTEBOOK_QUICK=1)."""
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_notebook_runs(tmp_path):
    import nbclient  # the test extra installs it: a missing one fails rather than skips
    import nbformat
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    os.environ["RAGEN_NOTEBOOK_QUICK"] = "1"
    os.environ["RAGEN_NOTEBOOK_WORKDIR"] = str(tmp_path / "run")
    try:
        nbclient.NotebookClient(nb, timeout=1200, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        os.environ.pop("RAGEN_NOTEBOOK_QUICK")
        os.environ.pop("RAGEN_NOTEBOOK_WORKDIR")
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "success" in outputs and "puzzles" in outputs
    assert (tmp_path / "run" / "checkpoints").is_dir()
