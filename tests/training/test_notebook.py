"""The Colab notebooks execute top to bottom with tiny settings (RAGEN_NOTEBOOK_QUICK=1), and their
first cell installs the project on a kernel that cannot import it yet."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ("quickstart.ipynb", "diagnose_collapse.ipynb")


def _execute(name, workdir):
    import nbclient  # the test extra installs it: a missing one fails rather than skips
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    env = {"RAGEN_NOTEBOOK_QUICK": "1", "RAGEN_NOTEBOOK_WORKDIR": str(workdir)}
    os.environ.update(env)
    try:
        nbclient.NotebookClient(nb, timeout=1200, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    finally:
        for k in env:
            os.environ.pop(k)
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_quickstart_notebook_runs(tmp_path):
    outputs = _execute("quickstart.ipynb", tmp_path / "run")
    assert "success" in outputs and "puzzles" in outputs
    assert (tmp_path / "run" / "checkpoints").is_dir()


def test_diagnose_collapse_notebook_runs(tmp_path):
    from ragen_jax.training.event_log import read_scalars

    outputs = _execute("diagnose_collapse.ipynb", tmp_path / "run")
    # The MI proxy ran at each of the 3 steps; it has a reading where at least two prompts had a
    # parseable first-turn reasoning, and the notebook counts and plots exactly those.
    flags = [v for _, v in read_scalars(tmp_path / "run" / "tensorboard")["collapse_first_turn_sample/computed"]]
    assert len(flags) == 3 and sum(flags) >= 1, flags
    assert f"{int(sum(flags))} MI computations" in outputs and "regime at the last computation:" in outputs
    assert "first-turn reasonings, mean MI" in outputs and "MI share" in outputs
    assert "the most input-specific reasoning" in outputs
    # RAGEN-2's gradient analysis ran at every step (quick mode) and the notebook draws its buckets.
    analysed = [s for s, _ in read_scalars(tmp_path / "run" / "tensorboard")["grad_norm/all/task"]]
    assert analysed == [1, 2, 3], analysed
    assert "gradient analysis at steps [1, 2, 3]" in outputs and "q1:" in outputs and "all:" in outputs


def _install_cell(name):
    nb = json.loads((ROOT / "notebooks" / name).read_text())
    return "".join(next(c for c in nb["cells"] if c["cell_type"] == "code")["source"])


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_first_cell_installs_the_project_when_it_is_not_importable(name, tmp_path):
    """Run the first cell in a fresh interpreter where ``ragen_jax`` cannot be found and every
    subprocess is recorded instead of run: from a checkout it pip-installs that checkout; with no
    checkout it clones REPO first; with neither it stops with what to do."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import importlib.util, json, subprocess, sys\n"
        "calls = []\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n == 'ragen_jax' else real(n, *a)\n"
        "subprocess.run = lambda cmd, check=False: calls.append(cmd)\n"
        f"exec(compile(open({str(tmp_path / 'cell.py')!r}).read(), 'cell', 'exec'))\n"
        "print(json.dumps({'calls': calls, 'path0': sys.path[0]}))\n")
    (tmp_path / "cell.py").write_text(_install_cell(name))

    def run(cwd, repo=""):
        env = {**os.environ, "RAGEN_JAX_REPO": repo}
        return subprocess.run([sys.executable, str(probe)], cwd=cwd, capture_output=True, text=True, env=env,
                              timeout=60)

    p = run(ROOT / "notebooks")
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["calls"] == [[sys.executable, "-m", "pip", "install", "-q", "-e", str(ROOT)]]
    assert out["path0"] == str(ROOT)
    elsewhere = tmp_path / "colab"
    elsewhere.mkdir()
    p = run(elsewhere, repo="https://example.invalid/ragen_jax.git")
    out = json.loads(p.stdout.splitlines()[-1])
    clone = elsewhere / "ragen_jax"
    assert out["calls"] == [["git", "clone", "--depth", "1", "https://example.invalid/ragen_jax.git", "ragen_jax"],
                            [sys.executable, "-m", "pip", "install", "-q", "-e", str(clone)]]
    p = run(elsewhere)
    assert p.returncode != 0 and "set REPO" in p.stderr
