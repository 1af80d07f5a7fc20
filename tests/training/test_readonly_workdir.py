"""A workdir on a read-only file system (a new run, a resume, an evaluation) ends the command with
one line naming the path and the key to change — never a traceback. The file system is a small
read-only tmpfs mounted for the test (root may mount here; where it may not, the test says so and
skips)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def readonly_dir(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()})")
    try:
        # An existing run's workdir (config.json and a checkpoint directory), then read-only.
        run = mnt / "old_run"
        (run / "checkpoints" / "0").mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"seed": 0}))
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("case", ["new", "resume", "eval"])
def test_read_only_workdir_is_one_line(readonly_dir, case):
    workdir = readonly_dir / ("new_run" if case == "new" else "old_run")
    args = [sys.executable, "-m", "ragen_jax.launch", "--config", "configs/frozen_lake.py",
            f"--config.workdir={workdir}", "--config.trainer.total_steps=1"]
    if case == "eval":
        args.append("--config.mode=eval")
    out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert len(lines) == 1, out.stderr
    assert "Read-only file system" in lines[0] and "--config.workdir" in lines[0] and str(readonly_dir) in lines[0]
