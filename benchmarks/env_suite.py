#!/usr/bin/env python3
"""The environment suite's throughput against jumanji and pgx, in one invocation.

Runs ``benchmarks/env_suite_cases.py`` through the shared peer harness
(``../shared/bench/env_peers.py``: median of 5 repeats, compile excluded, random actions,
auto-reset inside the step) and prints the targets at batch 1,024:
  * 2048 steps/s >= 1x jumanji ``Game2048-v1`` and >= 1x pgx ``2048``;
  * Sudoku steps/s >= 1x jumanji ``Sudoku-v0``;
  * the cube's and Countdown's steps/s, reported.

    python benchmarks/env_suite.py                 # writes benchmarks/results_env_suite.md
    python benchmarks/env_suite.py --batches 1024 --md ''

Ours generate every new puzzle on device (a Sudoku grid by symmetries, a Countdown derivation
search over 96 candidates, a cube scramble); jumanji's Sudoku draws from a bundled database.
The machine may be shared: the harness records the CPU other processes used; compare only
within one invocation.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from envs import REPO, _import_peers, _lookup  # noqa: E402

PAIRS = (
    ("2048 / jumanji Game2048-v1", "ragen_jax 2048 [suite]", "jumanji Game2048-v1 [suite]", ">= 1x"),
    ("2048 / pgx 2048", "ragen_jax 2048 [suite]", "pgx 2048 [suite]", ">= 1x"),
    ("Sudoku 9x9 / jumanji Sudoku-v0", "ragen_jax Sudoku 9x9 easy [suite]", "jumanji Sudoku-v0 [suite]", ">= 1x"),
)
REPORTED = ("ragen_jax Rubik's cube 2x2 scramble 5 [suite]", "ragen_jax Countdown 3-4 numbers [suite]")


def rows(results, batches):
    get = _lookup(results)
    out = []
    for b in batches:
        for label, ours, peer, target in PAIRS:
            for metric in ("steps/s per-call", "steps/s fused scan"):
                a, p = get(ours, b, metric), get(peer, b, metric)
                out.append((f"{label} {metric}", b, a, p, a / p, target if b == 1024 else ""))
        for case in REPORTED:
            out.append((f"{case.replace(' [suite]', '')} steps/s fused scan", b, get(case, b, "steps/s fused scan"),
                        float("nan"), float("nan"), ""))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64,1024")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=600.0, help="seconds per case")
    ap.add_argument("--md", default=os.path.join(REPO, "benchmarks", "results_env_suite.md"))
    args = ap.parse_args(argv)
    peers = _import_peers()
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        peer_args = ["--extra", "benchmarks.env_suite_cases", "--only", "[suite]", "--skip-python", "--json", out,
                     "--budget", str(args.budget), "--batches", args.batches] + (["--quick"] if args.quick else [])
        started = datetime.datetime.now(datetime.timezone.utc)
        peers.main(peer_args)
        data = json.load(open(out))
    from envs import ratio_table

    table = ratio_table(rows(data["results"], batches), peers.fmt)
    print("\n== environment suite vs jumanji / pgx (same invocation) ==\n" + table)
    if args.md:
        with open(args.md, "w") as f:
            v = data["versions"]
            f.write("# Environment suite throughput: ragen_jax vs jumanji and pgx\n\n")
            f.write(f"Run `python benchmarks/env_suite.py --batches {args.batches}` on {started:%Y-%m-%d %H:%M} UTC, "
                    f"{v.get('cpu', '?')}, {v.get('cpu_count', '?')} CPUs, backend `{v.get('jax_backend', '?')}`; "
                    f"load average at start {v.get('loadavg_at_start', '?')}, other processes used "
                    f"{v.get('background_cpu_cores_avg', '?')} cores on average. Medians of 5 repeats, compile "
                    "excluded, random actions, auto-reset inside the step.\n\n")
            f.write("## Targets\n\n" + table + "\n\n## All measurements\n\n"
                    + peers.table([peers.Result(**r) for r in data["results"]]) + "\n\n")
            f.write(f"versions: `{json.dumps(v)}`\n")
        print(f"wrote {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
