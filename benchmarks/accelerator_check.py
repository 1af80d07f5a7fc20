"""The accelerator check: what the project does on the device it is given, in one results file.

    benchmarks/accelerator_check.sh                  # installs offline, then runs this
    python benchmarks/accelerator_check.py --out benchmarks/results_accelerator.md

Three parts, each in its own process (a clean allocator peak, and one part failing does not stop
the others), within ``--budget_s`` (480 s, an accelerator lease's 8 minutes) in all; part 2's CPU
planner runs in the background from the start (it needs only the host's cores):

1. ``gpu_check.py`` at the 0.5B shape: rollout sampled tokens/s, env turns/s, update tokens/s, model
   FLOPs utilisation against the measured bf16 matmul peak, peak memory.
2. The planner against the device: for Qwen2.5-0.5B and 1.5B (GRPO, one device, the README's planner
   flags) the CPU planner's peak (what the README's table shows), the device compiler's own estimate
   of the same programs (``plan --measure``) and the allocator's measured peak of running them once
   with random weights, as predicted / measured.
3. A 3-step StarPO run of a 0.5B-shaped model through ``python -m ragen_jax.launch`` (no warm-up),
   its wall time and summary.

On a CPU (``--shape tiny``, the default there) the same three parts run with the tiny shape, so CI
exercises the command end to end; CPU figures say nothing about an accelerator and the CPU client
keeps no allocator statistics (measured: n/a).

``--missing`` prints the runtime requirements of ``setup.py`` that this Python lacks (the shell
script installs them from a local wheel folder) and exits.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The README's planner flags (configs/sokoban_ragen.py: 8 groups × 16, 5 turns, 400-token replies).
PLAN_FLAGS = ["--config", "configs/sokoban_ragen.py", "--config.mesh.data=1", "--config.mesh.fsdp=1",
              "--config.model.scan_layers=True", "--config.model.remat=True", "--config.model.dtype=bfloat16",
              "--config.starpo.micro_batch_size=4", "--config.collapse.micro_batch_size=8",
              "--config.starpo.adv_estimator=grpo"]
# On CPU: the tiny preset and a small rollout, so the same path runs in CI in seconds.
PLAN_FLAGS_TINY = ["--config.rollout.num_groups=2", "--config.rollout.group_size=2", "--config.rollout.max_turns=2",
                   "--config.rollout.max_new_tokens=16", "--config.rollout.max_seq_len=512",
                   "--config.collapse.num_samples=4", "--config.starpo.mini_batch_size=4"]
QWEN_05B_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64)


def missing_requirements() -> list[str]:
    """``setup.py``'s install_requires that are not installed (by distribution name)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    tree = ast.parse((ROOT / "setup.py").read_text())
    requires: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            requires = [ast.literal_eval(e) for e in node.value.elts]
    missing = []
    for name in (Requirement(req).name for req in requires):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def _text_tail(output: bytes | str | None, chars: int = 2000) -> str:
    """The last ``chars`` of a stopped child's output (``TimeoutExpired`` hands it over as bytes)."""
    text = output.decode(errors="replace") if isinstance(output, bytes) else (output or "")
    return text[-chars:]


def run_part(args: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    """``(exit status, stdout + stderr tail, seconds)`` of one part; a timeout is status 124."""
    start = time.time()
    try:
        out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1),
                             env={**os.environ, **(env or {})})
        code, text = out.returncode, out.stdout + (f"\n{out.stderr[-3000:]}" if out.returncode else "")
    except subprocess.TimeoutExpired as e:
        # What the part printed before it was stopped says where the time went (its progress lines).
        code, text = 124, f"timed out after {timeout:.0f} s\n{_text_tail(e.stdout)}\n{_text_tail(e.stderr)}"
    return code, text, time.time() - start


def plan_command(preset: str, extra: list[str]) -> list[str]:
    """``python -m ragen_jax.plan`` with the README's planner flags for ``preset``."""
    return [sys.executable, "-m", "ragen_jax.plan", *PLAN_FLAGS, f"--config.model.preset={preset}", *extra]


def start_cpu_plans(presets: list[str], extra: list[str], folder: Path) -> dict[str, tuple[subprocess.Popen, float]]:
    """Start the CPU planner of every preset at once, in the background: it never touches the device, so
    on an accelerator machine it runs on the host's cores beside part 1 instead of after it. Each writes
    ``<preset>.cpu.json`` and its output to ``<preset>.cpu.log`` in ``folder``."""
    procs = {}
    for preset in presets:
        with open(folder / f"{preset}.cpu.log", "w") as log:  # the child keeps its own handle
            procs[preset] = (subprocess.Popen([*plan_command(preset, extra), f"--json={folder / f'{preset}.cpu.json'}"],
                                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                              env={**os.environ, "JAX_PLATFORMS": "cpu"}), time.time())
    return procs


def wait_cpu_plan(proc: subprocess.Popen, started: float, log: Path, deadline: float) -> tuple[int, str, float]:
    """``(exit status, output, seconds)`` of a planner started by ``start_cpu_plans``; 124 past ``deadline``."""
    try:
        code = proc.wait(timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = 124
    text = log.read_text(errors="replace")
    return code, (text if code == 0 else text[-3000:]), time.time() - started


def plan_rows(presets: list[str], extra: list[str], cpu_plans: dict, folder: Path,
              deadline: float) -> tuple[list[str], list[str]]:
    """Table rows (CPU planner, device compiler, measured) and the raw outputs."""
    rows, raw = [], []
    for preset in presets:
        cpu_json, dev_json = folder / f"{preset}.cpu.json", folder / f"{preset}.device.json"
        c2, t2, s2 = run_part([*plan_command(preset, extra), "--measure", f"--json={dev_json}"], deadline - time.time())
        c1, t1, s1 = wait_cpu_plan(*cpu_plans[preset], folder / f"{preset}.cpu.log", deadline)
        raw.append(f"### {preset}: CPU planner ({s1:.0f} s, in the background, exit {c1})\n\n```\n{t1.strip()}\n```\n\n"
                   f"### {preset}: on the device (`--measure`, {s2:.0f} s, exit {c2})\n\n```\n{t2.strip()}\n```\n")
        cpu = json.loads(cpu_json.read_text())["figures"] if c1 == 0 else None
        dev = json.loads(dev_json.read_text()) if c2 == 0 else None
        gb = lambda b: f"{b / 1e9:.1f} GB" if b else "n/a"  # noqa: E731
        measured = (dev or {}).get("measured") or {}
        m_peak = measured.get("peak")
        cpu_peak = cpu["peak"] if cpu else None
        dev_peak = dev["figures"]["peak"] if dev else None
        ratio = lambda p: f"{p / m_peak:.2f}" if p and m_peak else "n/a"  # noqa: E731
        where = f"{measured.get('device_kind', 'n/a')}" if dev else f"failed (exit {c2})"
        rows.append(f"| {preset} | {gb(cpu_peak) if cpu else f'failed (exit {c1})'} | {gb(dev_peak)} | {gb(m_peak)} "
                    f"| {ratio(cpu_peak)} | {ratio(dev_peak)} | {where} |")
    return rows, raw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--missing", action="store_true", help="print the missing runtime requirements and exit")
    ap.add_argument("--shape", choices=["0.5b", "tiny"], default=None,
                    help="0.5b on an accelerator (default there), tiny on CPU (default there)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results_accelerator.md"))
    ap.add_argument("--budget_s", type=float, default=480.0)
    args = ap.parse_args(argv)
    if args.missing:
        print(" ".join(missing_requirements()))
        return 0

    import jax

    start = time.time()
    deadline = start + args.budget_s
    device = jax.devices()[0]
    shape = args.shape or ("tiny" if device.platform == "cpu" else "0.5b")
    tiny = shape == "tiny"
    header = [f"# Accelerator check: {jax.device_count()} × {device.device_kind} ({device.platform})", "",
              f"`benchmarks/accelerator_check.sh` — jax {jax.__version__}, Python {sys.version.split()[0]}, "
              f"shape {shape}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", ""]
    if device.platform == "cpu":
        header += ["On a CPU: the command's own smoke test with the tiny shape; none of these figures describe an "
                   "accelerator.", ""]
    sections: list[str] = []
    failures = 0
    presets = ["tiny"] if tiny else ["qwen2.5-0.5b", "qwen2.5-1.5b"]
    plan_extra = PLAN_FLAGS_TINY if tiny else []
    plan_folder = Path(tempfile.mkdtemp(prefix="accelerator_check_"))
    cpu_plans = start_cpu_plans(presets, plan_extra, plan_folder)

    # 1. Throughput and utilisation.
    code, text, secs = run_part([sys.executable, "benchmarks/gpu_check.py", "--shape", shape], 0.45 * args.budget_s)
    failures += code != 0
    sections.append(f"## 1. Throughput (`gpu_check.py --shape {shape}`, {secs:.0f} s, exit {code})\n\n"
                    + (text.split("\n", 1)[1].strip() if code == 0 and text.startswith("## ") else f"```\n{text.strip()}\n```")
                    + "\n")

    # 2. The planner against the device.
    rows, raw = plan_rows(presets, plan_extra, cpu_plans, plan_folder, start + 0.8 * args.budget_s)
    shutil.rmtree(plan_folder, ignore_errors=True)
    failures += sum("failed" in r for r in rows)
    sections.append("## 2. Planner against the device (GRPO, one device, the README's planner flags)\n\n"
                    "| preset | CPU planner peak | device compiler's peak | measured peak | CPU planner / measured "
                    "| device compiler / measured | device |\n|---|---:|---:|---:|---:|---:|---|\n"
                    + "\n".join(rows) + "\n\n" + "\n".join(raw))

    # 3. Three StarPO steps through the normal command.
    with tempfile.TemporaryDirectory() as workdir:
        dims = {} if tiny else {**QWEN_05B_SHAPE, "rope_theta": 1000000.0}
        launch = [sys.executable, "-m", "ragen_jax.launch", "--config", "configs/frozen_lake.py",
                  f"--config.workdir={workdir}/run", "--config.warmup.steps=0", "--config.warmup.single_turn_steps=0",
                  "--config.trainer.total_steps=3", "--config.eval.num_episodes=8", "--config.trainer.progress_bar=False",
                  "--config.compilation_cache_dir=",
                  *(["--config.model.dtype=bfloat16", "--config.model.scan_layers=True"] if not tiny else []),
                  *[f"--config.model.tiny.{k}={v}" for k, v in dims.items()]]
        code, text, secs = run_part(launch, deadline - time.time())
        failures += code != 0
        summary = Path(workdir) / "run" / "summary.json"
        body = (f"```json\n{json.dumps(json.loads(summary.read_text()), indent=1)[:3000]}\n```" if summary.exists()
                else f"```\n{text.strip()[-3000:]}\n```")
    sections.append(f"## 3. Three StarPO steps through `python -m ragen_jax.launch` "
                    f"({'tiny' if tiny else 'Qwen2.5-0.5B'}-shaped model, {secs:.0f} s, exit {code})\n\n"
                    f"`{' '.join(launch[1:]).replace(workdir, '$TMP')}`\n\n{body}\n")

    total = time.time() - start
    text = "\n".join(header + sections + [f"Wall time of the whole check: {total:.0f} s "
                                           f"(budget {args.budget_s:.0f} s); {failures} part(s) failed.", ""])
    Path(args.out).write_text(text, encoding="utf-8")
    print(text)
    print(f"results written to {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
