#!/usr/bin/env python3
"""Environment throughput of ragen_jax against its peers, measured in one invocation.

Runs the shared peer benchmark (``<repo>/../shared/bench/env_peers.py``: jumanji Sokoban, gymnax
FrozenLake, gymnasium FrozenLake, gym-sokoban) with our environments added through its
``--extra`` hook (``benchmarks/env_cases.py``: Sokoban 6x6/1 box and 10x10/3 boxes, FrozenLake 4x4
with a fresh random map on every reset), then prints the ratios for the project's targets:

  * Sokoban steps/s with auto-reset >= 1x jumanji Sokoban at batch 1,024 (aim 2x);
  * Sokoban level generation (6x6, 1 box) >= 100x gym-sokoban levels/s;
  * FrozenLake with random maps >= 0.5x gymnax FrozenLake (fixed map) steps/s.

Usage (from the repository root):
  python benchmarks/envs.py            # full run, writes benchmarks/results_envs.md
  python benchmarks/envs.py --quick    # batches 1, 64, 1024 and short timings
  python benchmarks/envs.py --md /tmp/out.md --batches 1024
  python benchmarks/env_suite.py       # the suite: 2048 / Sudoku vs jumanji and pgx, cube, Countdown

The machine may be shared: every row of the peer table notes the CPU other processes used
(``bg=``); only ratios within one invocation are meaningful.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.normpath(os.path.join(REPO, "..", "shared", "bench"))

JUMANJI = "jumanji Sokoban toy [VmapAutoResetWrapper]"
GYMNAX_FL = "gymnax FrozenLake-misc 4x4 slippery"
GYM_SOKOBAN = "gym-sokoban 6x6 1 box"
GYMNASIUM_FL = "gymnasium FrozenLake-v1 4x4 slippery"
OURS_SOKOBAN = "ragen_jax Sokoban 6x6 1 box"
OURS_SOKOBAN_10 = "ragen_jax Sokoban 10x10 3 box"
OURS_FL = "ragen_jax FrozenLake 4x4 random maps"
TARGET_BATCH = 1024


def _pkg_resources_shim() -> None:
    """gym-sokoban 0.0.6 imports ``pkg_resources`` (gone from setuptools >= 81) only for
    ``resource_filename``; provide that one function so the peer can be measured at all."""
    try:
        import pkg_resources  # noqa: F401
    except ImportError:
        import importlib
        import types

        def resource_filename(module: str, path: str) -> str:  # relative to the module's folder
            return os.path.join(os.path.dirname(importlib.import_module(module).__file__), path)

        shim = types.ModuleType("pkg_resources")
        shim.resource_filename = resource_filename
        sys.modules["pkg_resources"] = shim


def _import_peers():
    if not os.path.isfile(os.path.join(BENCH_DIR, "env_peers.py")):
        sys.exit(f"benchmarks/envs.py: the peer benchmark {BENCH_DIR}/env_peers.py is missing; it is "
                 "expected next to the repository (../shared/bench). Check out the shared folder there.")
    _pkg_resources_shim()
    for path in (BENCH_DIR, REPO):
        if path not in sys.path:
            sys.path.insert(0, path)
    import env_peers

    return env_peers


def _lookup(results: list[dict]):
    table = {(r["case"], r["batch"], r["metric"]): r["median"] for r in results}

    def get(case: str, batch: int, metric: str) -> float:
        v = table.get((case, batch, metric), float("nan"))
        return float("nan") if v is None else v

    return get


def ratio_rows(results: list[dict], batches: list[int]) -> list[tuple[str, int, float, float, float, str]]:
    """(comparison, batch, ours, peer, ratio, target) for every batch measured."""
    get = _lookup(results)
    rows = []
    for batch in batches:
        for ours, label in ((OURS_SOKOBAN, "Sokoban 6x6/1"), (OURS_SOKOBAN_10, "Sokoban 10x10/3")):
            for metric in ("steps/s per-call", "steps/s fused scan"):
                a, b = get(ours, batch, metric), get(JUMANJI, batch, metric)
                target = ">= 1x (aim 2x)" if batch == TARGET_BATCH else ""
                rows.append((f"{label} {metric} / jumanji 10x10/4 (auto-reset)", batch, a, b, a / b, target))
        a, b = get(OURS_SOKOBAN, batch, "reset/s"), get(GYM_SOKOBAN, 1, "reset/s (level gen)")
        rows.append(("Sokoban 6x6/1 level generation / gym-sokoban", batch, a, b, a / b,
                     ">= 100x" if batch >= 64 else ""))
        for metric in ("steps/s per-call", "steps/s fused scan"):
            a, b = get(OURS_FL, batch, metric), get(GYMNAX_FL, batch, metric)
            target = ">= 0.5x" if batch == TARGET_BATCH else ""
            rows.append((f"FrozenLake random maps {metric} / gymnax fixed map", batch, a, b, a / b, target))
        a, b = get(OURS_FL, batch, "reset/s"), get(GYMNASIUM_FL, 1, "reset/s random map+rebuild")
        rows.append(("FrozenLake reset (new valid map) / gymnasium RAGEN-style reset", batch, a, b, a / b, ""))
    return rows


def _verdict(ratio: float, target: str) -> str:
    if not target or ratio != ratio:
        return ""
    need = float(target.split()[1].rstrip("x"))
    return "met" if ratio >= need else "MISSED"


def ratio_table(rows, fmt) -> str:
    lines = ["| comparison | B | ours /s | peer /s | ratio | target | |",
             "|---|---:|---:|---:|---:|---|---|"]
    for name, batch, a, b, r, target in rows:
        ratio = "n/a" if r != r else f"{r:.2f}x"
        lines.append(f"| {name} | {batch} | {fmt(a)} | {fmt(b)} | {ratio} | {target} | {_verdict(r, target)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batches 1, 64, 1024 and short timings")
    ap.add_argument("--batches", default=None, help="comma list (default 1,64,1024,8192; quick: 1,64,1024)")
    ap.add_argument("--only", default=None, help="substring filter on case names (e.g. FrozenLake)")
    # Generous: a procedural Sokoban step compiles for tens of seconds per batch size on 2 cores,
    # and env_peers.py skips the remaining batch sizes of a case once its budget is spent.
    ap.add_argument("--budget", type=float, default=1500.0, help="seconds per JAX case")
    ap.add_argument("--md", default=os.path.join(REPO, "benchmarks", "results_envs.md"),
                    help="markdown report path ('' to skip)")
    args = ap.parse_args(argv)
    peers = _import_peers()

    batches = ([int(b) for b in args.batches.split(",")] if args.batches
               else ([1, 64, 1024] if args.quick else [1, 64, 1024, 8192]))
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "results.json")
        peer_args = ["--extra", "benchmarks.env_cases", "--json", out_json, "--budget", str(args.budget),
                     "--batches", ",".join(map(str, batches))]
        if args.quick:
            peer_args.append("--quick")
        if args.only:
            peer_args += ["--only", args.only]
        started = datetime.datetime.now(datetime.timezone.utc)
        peers.main(peer_args)
        with open(out_json) as f:
            data = json.load(f)

    rows = ratio_rows(data["results"], batches)
    table = ratio_table(rows, peers.fmt)
    print("\n== ragen_jax vs peers (same invocation) ==")
    print(table)
    if args.md:
        full = [peers.Result(**r) for r in data["results"]]
        with open(args.md, "w") as f:
            f.write("# Environment throughput: ragen_jax vs peers\n\n")
            f.write(f"Run `python benchmarks/envs.py{' --quick' if args.quick else ''}` on "
                    f"{started:%Y-%m-%d %H:%M} UTC, {data['versions'].get('cpu', '?')}, "
                    f"{data['versions'].get('cpu_count', '?')} CPUs, backend "
                    f"`{data['versions'].get('jax_backend', '?')}`; load average at start "
                    f"{data['versions'].get('loadavg_at_start', '?')}, other processes used "
                    f"{data['versions'].get('background_cpu_cores_avg', '?')} cores on average. "
                    "Medians of 5 repeats, compile excluded, random actions, auto-reset inside "
                    "`env.step`; ours draw a fresh procedurally generated level on every reset, "
                    "jumanji indexes fixed levels, gymnax FrozenLake has one fixed map.\n\n")
            f.write("## Targets\n\n" + table + "\n\n")
            f.write("## All measurements\n\n" + peers.table(full) + "\n\n")
            f.write(f"versions: `{json.dumps(data['versions'])}`\n")
        print(f"wrote {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
