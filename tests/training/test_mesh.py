"""Sharded and multi-process training, each layout in its own process (``mesh_check.py``).

What is compared: every scalar the runs log (losses, gradient norms, advantages, the SNR filter's
statistics, the MI proxy, validation), step by step. Layouts differ only in the order of float
reductions (a sum over 8 shards is not the sum over 1), so values agree to ``ATOL`` / ``RTOL``
(seen: ≤ 2e-5) — except counts of discrete events, which may move by one: clip fractions count
tokens on either side of a threshold (``1 / CLIP_TOKENS``), the MI proxy's retrieval rates rank
log-probs that an untrained model makes nearly equal (``1 / MI_SAMPLES``). Fixed seeds: the same layouts always give the same numbers.
"""
import json
import os
import shutil
import socket
import stat
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CHECK = os.path.join(HERE, "mesh_check.py")
ATOL, RTOL = 1e-4, 1e-4
CLIP_TOKENS = 64  # a clip fraction may differ by one token of at least this many
MI_SAMPLES = 4  # collapse.num_samples of mesh_check.py: retrieval rates may differ by one sample


def _env(**extra):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _check(workdir, steps, devices=1, mesh="1,1,1", **flags):
    out = f"{workdir}.json"
    cmd = [sys.executable, CHECK, "--devices", str(devices), "--mesh", mesh, "--workdir", str(workdir),
           "--steps", str(steps), "--out", out]
    for k, v in flags.items():
        cmd += [f"--{k}", str(v)]
    return cmd, out


def _run(cmd, timeout=900):
    proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    return proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _logged(path):
    with open(path) as f:
        return json.load(f)["logged"]


def _assert_same_metrics(a: dict, b: dict, steps, what: str):
    """Every scalar both runs logged at ``steps`` agrees (module docstring's tolerances)."""
    compared = 0
    for key in sorted(set(a) & set(b)):
        va, vb = dict(map(tuple, a[key])), dict(map(tuple, b[key]))
        for s in steps:
            if s not in va or s not in vb:
                continue
            x, y = va[s], vb[s]
            tol = ATOL + RTOL * abs(x)
            if "clipfrac" in key:
                tol = 1.0 / CLIP_TOKENS
            elif "retrieval_" in key:
                tol = 1.0 / MI_SAMPLES + 1e-6
            assert abs(x - y) <= tol, f"{what}: {key} at step {s}: {x} vs {y}"
            compared += 1
    # One StarPO step of this config logs 96 comparable scalars (more where the MI proxy has a
    # reading; none of its zeros where no reasoning parsed); 100 before four metrics that repeated
    # others under a second name went (README, "Changelog").
    assert compared >= 96, f"{what}: only {compared} values compared"
    for key in ("actor/grad_norm", "critic/grad_norm", "actor/kl_loss", "val/success", "rollout/filter_kept_ratio",
                "warmup/loss"):
        assert key in a and key in b, f"{what}: {key} not logged"
    # The update really trained (no SNR filtering, GAE with a critic): gradients are not zero.
    assert all(v > 0 for _, v in a["actor/grad_norm"]) and all(v > 0 for _, v in a["critic/grad_norm"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """1 device for 3 steps; 2 processes × 4 devices on a (data 2, fsdp 2, tensor 2) mesh for 2
    steps; that workdir resumed to step 3 by one process with 8 devices on the same mesh and by one
    with a single device. Each new run starts with 2 + 2 behaviour-cloning steps (demonstrations,
    BC updates, board reading). Four processes in all: the 8-device mesh in one process is checked by
    its resumed step, which the uninterrupted 1-device run also took."""
    d = tmp_path_factory.mktemp("mesh")
    one_cmd, one = _check(d / "one", 3, warmup=2)
    _run(one_cmd)

    port = _free_port()
    procs = []
    for pid in range(2):
        cmd, multi = _check(d / "multi", 2, devices=4, mesh="2,2,2", coordinator=f"127.0.0.1:{port}",
                            num_processes=2, process_id=pid, warmup=2)
        if pid:
            cmd = cmd[:cmd.index("--out")] + cmd[cmd.index("--out") + 2:]  # process 1 reports nothing
        procs.append(subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, f"process failed\nstdout:\n{o[-3000:]}\nstderr:\n{e[-6000:]}"
    multi = str(d / "multi.json")

    resumed = {}
    for name, devices, mesh in (("resumed8", 8, "2,2,2"), ("resumed1", 1, "1,1,1")):
        shutil.copytree(d / "multi", d / name)
        cmd, out = _check(d / name, 3, devices=devices, mesh=mesh, dump_restored=d / f"{name}.npz",
                          warmup=2)  # the run's own config (its warm-up is not run again)
        _run(cmd)
        resumed[name] = (out, d / f"{name}.npz")
    return {"dir": d, "one": one, "multi": multi, "multi_out": outs, **resumed}


def test_two_processes_on_an_eight_device_mesh_log_what_one_device_logs(runs):
    _assert_same_metrics(_logged(runs["one"]), _logged(runs["multi"]), (0, 1, 2), "1 device vs 2 processes x 4")
    # Step 2 replayed 2 of its 4 groups' starts from step 1 (mesh_check's start_replay_fraction=0.5), on
    # every layout; the resumed step 3 below replays from the queue its checkpoint held.
    for name in ("one", "multi"):
        replayed = dict(map(tuple, _logged(runs[name])["rollout/replayed_groups"]))
        assert (replayed[1], replayed[2]) == (0.0, 2.0), (name, replayed)
    assert "training on mesh data 2 × fsdp 2 × tensor 2 (8 cpu devices over 2 processes)" in runs["multi_out"][0][0]
    # Only process 0 wrote: one TensorBoard file, one summary, and nothing printed by process 1.
    events = os.listdir(runs["dir"] / "multi" / "tensorboard")
    assert len(events) == 1 and events[0].startswith("events.out.tfevents"), events
    assert "== frozen_lake" not in runs["multi_out"][1][0]
    summary = json.loads((runs["dir"] / "multi" / "summary.json").read_text())
    assert summary["summary"]["steps"] == 2.0
    assert sorted(os.listdir(runs["dir"] / "multi" / "checkpoints")) == ["0", "1", "2"]


def test_multi_process_checkpoint_resumes_on_one_process_with_eight_and_with_one_device(runs):
    a, b = (np.load(runs[name][1]) for name in ("resumed8", "resumed1"))
    assert int(a["__step__"]) == int(b["__step__"]) == 2
    arrays = [f for f in a.files if f != "__step__"]
    assert len(arrays) > 100 and sorted(arrays) == sorted(f for f in b.files if f != "__step__")
    for f in arrays:  # restored bit for bit into both layouts
        assert a[f].dtype == b[f].dtype and np.array_equal(a[f], b[f]), f
    # Step 3 after the resume, on one process with the 8-device mesh and with one device, is the
    # step 3 of the uninterrupted 1-device run.
    _assert_same_metrics(_logged(runs["one"]), _logged(runs["resumed8"][0]), (3,), "resumed on 1 x 8")
    _assert_same_metrics(_logged(runs["one"]), _logged(runs["resumed1"][0]), (3,), "resumed on 1 x 1")


FAKE_SRUN = """#!/usr/bin/env bash
# Stands in for SLURM's srun on one machine: SLURM_NTASKS copies of the command, each with the
# task variables srun gives it (SLURM_PROCID, SLURM_LOCALID); exits with the first failure.
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i "$@" > "$SRUN_LOG_DIR/task$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def test_slurm_script_trains_two_steps_as_a_two_task_job(tmp_path):
    """``launch/slurm_gpu.sbatch`` as srun would run it in a 2-task job: jax detects the job from
    the SLURM variables alone (coordinator = first node of SLURM_STEP_NODELIST)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    workdir = tmp_path / "run"
    job_id = str(_free_port())  # jax derives the coordinator port from the job id
    # The running interpreter first on PATH: under a virtualenv that is not activated, python3 from
    # PATH would be the system's (without this project's dependencies).
    python_dir = os.path.dirname(sys.executable)
    env = _env(PATH=f"{bin_dir}{os.pathsep}{python_dir}{os.pathsep}{os.environ['PATH']}", SRUN_LOG_DIR=str(tmp_path),
               SLURM_JOB_ID=job_id, SLURM_STEP_NODELIST="127.0.0.1", SLURM_NTASKS="2",
               SLURM_STEP_NUM_NODES="1", SLURM_SUBMIT_DIR=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHON=sys.executable)
    overrides = [
        f"--config.workdir={workdir}", "--config.compilation_cache_dir=", "--config.trainer.total_steps=2",
        "--config.trainer.progress_bar=False", "--config.trainer.eval_every=2", "--config.eval.num_episodes=2",
        "--config.warmup.steps=0", "--config.warmup.single_turn_steps=0", "--config.rollout.num_groups=2",
        "--config.rollout.group_size=2", "--config.rollout.max_turns=2", "--config.rollout.max_new_tokens=24",
        "--config.rollout.max_seq_len=400", "--config.starpo.mini_batch_size=4",
        "--config.model.tiny.hidden_size=32", "--config.model.tiny.intermediate_size=64",
        "--config.model.tiny.num_layers=1", "--config.model.tiny.head_dim=8",
    ]
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "slurm_gpu.sbatch"), "configs/frozen_lake.py",
                           *overrides], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=900)
    logs = {i: (tmp_path / f"task{i}.log").read_text() for i in range(2) if (tmp_path / f"task{i}.log").exists()}
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n" + "\n".join(v[-4000:] for v in logs.values())
    assert "over 2 processes" in logs[0] and "== frozen_lake / tiny: 2 steps" in logs[0], logs[0][-3000:]
    assert "== frozen_lake" not in logs[1]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["summary"]["steps"] == 2.0 and len(os.listdir(workdir / "tensorboard")) == 1
