"""File-system faults end a command with one line, never a traceback or a hang: a workdir on a
read-only file system (a new run, a resume, an evaluation), and a disk that fills up mid-run. The
file systems are small tmpfs mounts made for the test (root may mount here; where it may not, the
test says so and skips)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mount_tmpfs(mnt: Path, size: str) -> None:
    mnt.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()})")


@pytest.fixture
def readonly_dir(tmp_path):
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "1m")
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


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "1500k")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


FILL_AND_LOG = """
import sys
from pathlib import Path
from ragen_jax.training.event_log import Logger, LoggingError
disk = Path(sys.argv[1])
(disk / "filler").write_bytes(b"x" * (1500 * 1024 - 64 * 1024))
log = Logger(disk / "tb")
try:
    for step in range(100_000):
        log.scalars(step, {f"train/m{i}": float(i) for i in range(50)})
        log.flush()
except LoggingError as e:
    print("raised:", e)
try:
    log.close()
except LoggingError:
    pass
"""


def test_a_logger_on_a_full_disk_raises_instead_of_hanging(small_disk):
    """tensorboardX's writer thread dies on ENOSPC; writing on would wait for ever on its queue, and
    so would the process's exit. In a separate process, bounded by the test: the Logger raises, and
    the process ends."""
    out = subprocess.run([sys.executable, "-c", FILL_AND_LOG, str(small_disk)], capture_output=True, text=True,
                         cwd=ROOT, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "raised:" in out.stdout and "space left" in out.stdout.lower(), (out.stdout, out.stderr[-2000:])


def test_a_disk_that_fills_mid_run_is_one_line_and_the_checkpoints_stay_intact(small_disk):
    workdir = small_disk / "run"
    args = [sys.executable, "-m", "ragen_jax.launch", "--config", "configs/frozen_lake.py", f"--config.workdir={workdir}",
            *[f"--config.{k}={v}" for k, v in SMALL.items()]]
    out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip() and "WARNING" not in line]
    # The command's own report is the last line (orbax's writer threads may still log theirs first).
    assert lines[-1].startswith("Disk full:") and str(workdir) in lines[-1], out.stderr[-3000:]
    # What was saved before the disk filled restores: the newest finished checkpoint reads back.
    from ragen_jax.training.workdir import checkpoint_steps

    assert checkpoint_steps(workdir), "no checkpoint was finished before the disk filled"


# The tests' small FrozenLake run, as command-line overrides; a checkpoint every step fills 1.5 MB.
SMALL = {"model.tiny.hidden_size": 32, "model.tiny.intermediate_size": 64, "model.tiny.num_layers": 1,
         "model.tiny.num_heads": 2, "model.tiny.num_kv_heads": 1, "model.tiny.head_dim": 16,
         "rollout.num_groups": 2, "rollout.group_size": 2, "rollout.max_turns": 2, "rollout.max_actions_per_traj": 4,
         "rollout.max_new_tokens": 56, "rollout.max_seq_len": 432, "starpo.mini_batch_size": 4,
         "collapse.num_samples": 4, "collapse.micro_batch_size": 8, "warmup.single_turn_steps": 1, "warmup.steps": 2,
         "warmup.batch_size": 4, "warmup.num_states": 4, "warmup.heldout_states": 8, "eval.num_episodes": 2,
         "trainer.total_steps": 30, "trainer.save_every": 1, "trainer.keep_checkpoints": 30,
         "trainer.progress_bar": False}
