"""Asynchronous rollout (``trainer.max_staleness``, ``mesh.rollout_devices``; ``training.pipeline``).

Each run is a subprocess (``async_check.py``: the CPU device count is fixed when jax is imported) of
the trainer tests' small FrozenLake config with AReaL's decoupled objective, seeds fixed.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

CHECK = Path(__file__).with_name("async_check.py")
TIMING = ("timing_s/", "async/trainer_wait_s", "async/launch_s", "async/rollout_idle", "warmup/seconds")


def _run(tmp_path, name, **flags):
    out = tmp_path / f"{name}.json"
    args = [sys.executable, str(CHECK), "--workdir", str(tmp_path / name), "--out", str(out),
            "--policy_loss", "decoupled_ppo"]
    for k, v in flags.items():
        args += [f"--{k}", str(v)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def _free_ports(n: int) -> int:
    """A port such that it and the next ``n - 1`` are free (the coordinator's, then each process's
    cross-host transfer socket: ``launch.cross_host_transfer_address``)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65536:
            continue
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def _run_two_processes(tmp_path, name, **flags):
    """Process 0 trains, process 1 runs the rollout (``mesh.rollout_devices=1``, one device each), on
    127.0.0.1; process 0's logged scalars."""
    port = _free_ports(3)
    out = tmp_path / f"{name}.json"
    procs = []
    for pid in (0, 1):
        args = [sys.executable, str(CHECK), "--workdir", str(tmp_path / name), "--policy_loss", "decoupled_ppo",
                "--devices", "1", "--rollout_devices", "1", "--coordinator", f"127.0.0.1:{port}",
                "--num_processes", "2", "--process_id", str(pid)] + (["--out", str(out)] if pid == 0 else [])
        for k, v in flags.items():
            args += [f"--{k}", str(v)]
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=dict(os.environ)))
    for p in procs:
        o, e = p.communicate(timeout=900)
        assert p.returncode == 0, f"process failed\nstdout:\n{o[-2000:]}\nstderr:\n{e[-4000:]}"
    return json.loads(out.read_text())


def _assert_same_logs(a, b, what, rtol=1e-5, atol=1e-6):
    keys = sorted(k for k in set(a) | set(b) if not k.startswith(TIMING))
    assert set(a) == set(b), f"{what}: {sorted(set(a) ^ set(b))}"
    for key in keys:
        assert a[key].keys() == b[key].keys(), key
        steps = sorted(a[key], key=int)
        np.testing.assert_allclose([a[key][s] for s in steps], [b[key][s] for s in steps], rtol=rtol, atol=atol,
                                   err_msg=f"{what}: {key}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    return {"own_devices": _run(tmp, "own_devices", devices=2, rollout_devices=1, staleness=1),
            "colocated": _run(tmp, "colocated", devices=1, staleness=1),
            "synchronous": _run(tmp, "synchronous", devices=1, staleness=0)}


def _series(run, key):
    return [run[key][str(s)] for s in (1, 2, 3)]


def test_the_pipeline_trains_each_batch_one_version_after_the_policy_that_sampled_it(runs):
    """η = 1: step 1 trains on the warm-up policy's batch (nothing older exists); steps 2 and 3 on the
    batch version 0 and 1 sampled while the previous update ran. The decoupled objective sees it: its
    weights pi_prox / pi_behav are 1 (up to the sampler's numerics) where the batch is fresh — every
    step of the synchronous run and step 1 here — and move away from 1 where it is stale."""
    a, sync = runs["own_devices"], runs["synchronous"]
    assert _series(a, "async/staleness") == [0.0, 1.0, 1.0]
    assert _series(a, "async/policy_version") == [0.0, 0.0, 1.0]
    # Every turn of the trained batch records the version that sampled it (Trajectory.turn_policy_version).
    assert _series(a, "train/oldest_turn_policy_version") == [0.0, 0.0, 1.0]
    assert "train/oldest_turn_policy_version" not in sync
    assert "async/staleness" not in sync
    fresh = np.abs(np.array(_series(sync, "actor/behaviour_weight_mean")) - 1.0)
    assert fresh.max() < 1e-3
    stale = np.abs(np.array(_series(a, "actor/behaviour_weight_mean")) - 1.0)
    assert stale[0] < 1e-3 and stale[1:].min() > 5 * fresh.max() and stale[1:].min() > 1e-4
    # Step 1 is the same batch in both (version 0, the step's key): the same rollout statistics.
    for key in ("train/return", "train/sampled_tokens", "train/success"):
        assert a[key]["1"] == sync[key]["1"], key


def test_the_rollouts_own_devices_change_nothing_but_the_timing(runs):
    """The rollout on a device of its own (overlapping the update) and colocated with it run the same
    schedule: every logged value but the timings is the same."""
    a, b = runs["own_devices"], runs["colocated"]
    keys = sorted(k for k in set(a) | set(b) if not k.startswith(TIMING))
    assert set(a) - set(b) == set() and set(b) - set(a) == set()
    for key in keys:
        assert a[key].keys() == b[key].keys(), key
        steps = sorted(a[key], key=int)
        np.testing.assert_allclose([a[key][s] for s in steps], [b[key][s] for s in steps], rtol=1e-5, atol=1e-6,
                                   err_msg=key)


def test_an_interrupted_asynchronous_run_resumes_exactly(runs, tmp_path):
    """Interrupted after step 2 (step 3's batch in flight, sampled by version 1) and resumed: the checkpoint
    kept that batch's policy (``checkpoints_pipeline/2``), the rollout is launched again from it with the
    same key, and every logged value equals the uninterrupted run's."""
    flags = dict(devices=2, rollout_devices=1, staleness=1)
    _run(tmp_path, "resumed", stop_at=2, **flags)
    assert (tmp_path / "resumed" / "checkpoints_pipeline" / "2").is_dir()
    resumed, straight = _run(tmp_path, "resumed", **flags), runs["own_devices"]
    keys = sorted(k for k in straight if not k.startswith(TIMING))
    assert set(keys) <= set(resumed)
    for key in keys:
        assert resumed[key].keys() == straight[key].keys(), key
        steps = sorted(straight[key], key=int)
        np.testing.assert_allclose([resumed[key][s] for s in steps], [straight[key][s] for s in steps], rtol=1e-6,
                                   atol=1e-7, err_msg=key)


def test_a_lora_run_pipelines_its_adapters(tmp_path):
    """A LoRA policy, colocated: the pipeline copies the frozen base once and the adapters each version
    (two different trees). Three steps run and train each batch one version late. Seeded: deterministic."""
    from ragen_jax.config import resolve
    from ragen_jax.training.event_log import read_scalars
    from ragen_jax.training.trainer import train
    from tests.training.test_trainer import small_config_dict

    c = small_config_dict(tmp_path, 3, **{"trainer.max_staleness": 1, "starpo.policy_loss": "decoupled_ppo"})
    c.model.lora_rank = 4
    c.warmup.update(dict(steps=0, single_turn_steps=0))
    c.trainer.update(dict(eval_every=0, eval_before_train=False))
    c.filter.update(dict(value=1.0, include_zero=True))
    train(resolve(c))
    staleness = read_scalars(tmp_path / "tensorboard")["async/staleness"]
    assert [v for _, v in sorted(staleness)] == [0.0, 1.0, 1.0]


def test_asynchronous_rollout_settings_are_checked():
    from configs import frozen_lake
    from ragen_jax.config import ConfigError, resolve

    c = frozen_lake.get_config()
    c.trainer.max_staleness = 1
    with pytest.raises(ConfigError, match="dynamic_sampling_rounds=2"):
        resolve(c)
    with pytest.raises(ValueError, match="max_staleness"):
        c.trainer.max_staleness = -1
        c.filter.dynamic_sampling_rounds = 0
        resolve(c)
    c.trainer.max_staleness = 0
    c.mesh.rollout_devices = -2
    with pytest.raises((ValueError, ConfigError), match="rollout_devices"):
        resolve(c)


def test_the_rollout_on_a_process_of_its_own_logs_what_one_process_logs(runs, tmp_path):
    """Two processes (jax.distributed on 127.0.0.1, one CPU device each): process 1 holds the rollout's
    mesh, process 0 the update's; weights and batches cross by cross-host device transfers
    (``placement.send``) and every host read is sent over (``Placement.fetch`` with a ``peer``). Every
    logged value but the timings equals the one-process run with the rollout on its own device."""
    _assert_same_logs(_run_two_processes(tmp_path, "two_processes", staleness=1), runs["own_devices"],
                      "2 processes vs 1 process with 2 devices")


@pytest.mark.slow
def test_a_two_process_asynchronous_run_resumes_exactly(runs, tmp_path):
    """Interrupted after step 2 and resumed, both on two processes, validating every 2 steps: the
    checkpoints were written spanning both processes' devices (``Placement.spanning``: orbax writes
    multi-process arrays) and restored onto each side; the run logs what the uninterrupted one-process
    run (no validation) logs."""
    _run_two_processes(tmp_path, "resumed", staleness=1, stop_at=2, eval_every=2)
    assert (tmp_path / "resumed" / "checkpoints_pipeline" / "2").is_dir()
    resumed = _run_two_processes(tmp_path, "resumed", staleness=1, eval_every=2)
    # Validation ran on the update's process and every process read its results (the run went on).
    assert set(resumed["val/success"]) == {"2", "3"}
    trained = {k: v for k, v in resumed.items() if not k.startswith(("val/", "timing_s/eval"))}
    _assert_same_logs(trained, runs["own_devices"], "resumed on 2 processes vs straight", rtol=1e-6, atol=1e-7)


def test_a_multi_process_run_gives_the_rollout_whole_processes(monkeypatch):
    """Across processes the rollout takes the last processes whole and as many devices as the update
    keeps (the cross-host transfer pairs the two meshes device by device); another split names the
    value that works. Devices faked: 2 processes x 2 devices."""
    import types

    import jax

    from ragen_jax.config import ConfigError
    from ragen_jax.training import run

    devices = [types.SimpleNamespace(id=i, process_index=i // 2) for i in range(4)]
    monkeypatch.setattr(jax, "devices", lambda: devices)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "local_device_count", lambda: 2)
    spec = types.SimpleNamespace(mesh=types.SimpleNamespace(rollout_devices=2))
    update, rollout = run._split_devices(spec)
    assert [d.id for d in update] == [0, 1] and [d.id for d in rollout] == [2, 3]
    spec.mesh.rollout_devices = 1  # would put process 1's devices on both sides
    with pytest.raises(ConfigError, match="set mesh.rollout_devices=2"):
        run._split_devices(spec)


def test_each_cpu_process_receives_transfers_on_a_port_of_its_own(monkeypatch):
    """The cross-host transfer socket of a CPU process: the coordinator's host when it is this machine,
    the coordinator's port + 1 + the process index (distinct on one machine, free of the coordinator's);
    none without a named coordinator (a scheduler's run sets RAGEN_JAX_TRANSFER_ADDRESS), which overrides."""
    from ragen_jax.launch import cross_host_transfer_address

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("RAGEN_JAX_TRANSFER_ADDRESS", raising=False)
    assert [cross_host_transfer_address("127.0.0.1:4000", i) for i in (0, 1, 2)] == [
        "127.0.0.1:4001", "127.0.0.1:4002", "127.0.0.1:4003"]
    assert cross_host_transfer_address(None, None) is None
    monkeypatch.setenv("RAGEN_JAX_TRANSFER_ADDRESS", "10.0.0.7:5555")
    assert cross_host_transfer_address("127.0.0.1:4000", 1) == "10.0.0.7:5555"
