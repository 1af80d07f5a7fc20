"""Which groups carry a run's policy gradient: RAGEN-2's gradient analysis, read back as tables.

    python -m ragen_jax.offline.gradient_report runs/sokoban [--prefilter] [--steps 1,11]

A run with ``--config.trainer.gradient_analysis_every=N`` logs, at steps 1, 1 + N, …, the gradient of
each loss term per bucket of groups sorted by their reward spread (``starpo/gradient_analysis.py``).
This prints those series from the run's TensorBoard logs: one table per analysed step, then the mean
over the analysed steps, one row per bucket (lowest reward spread first, then ``all``):

  * ``reward std``: the bucket's groups' in-group reward std, mean (min–max);
  * ``episodes``: the bucket's share of the batch's episodes;
  * ``task`` / ``entropy`` / ``kl``: the global norm of that term's gradient over the bucket's rows
    (``kl`` only when the run has a KL loss), and ``task / episode``, the task norm per episode;
  * ``task share``: the bucket's task norm over the sum of the buckets' task norms (``all`` excluded):
    how the signal divides between low- and high-spread groups. Norms of different buckets do not add
    as vectors; the share says which buckets dominate, not how the update's direction splits.

By default the buckets are of what the SNR filter kept (``grad_norm/``, the batch the update trains
on); ``--prefilter`` reads the whole rollout batch instead (``grad_norm_prefilter/``). A bucket
with no episodes at a step (fewer groups than buckets, or the filter dropped them) shows "—" there
and is left out of its mean, except for its share of the episodes.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from ragen_jax.training.event_log import read_scalars

_ORDER = re.compile(r"^(?:q|rv)(\d+)")


def _bucket_key(name: str) -> tuple[int, int]:
    """q1 < q2 < … and rv0-1 < rv1-2 < … < rv5+; ``all`` last."""
    m = _ORDER.match(name)
    return (1, 0) if name == "all" else (0, int(m.group(1)) if m else 0)


def collect(run_dir: str | Path, prefilter: bool = False) -> dict[int, dict[str, dict[str, float]]]:
    """``{step: {bucket: {metric: value}}}`` of a run's gradient analysis (metric as after
    ``grad_norm/<bucket>/``, e.g. ``task``, ``per_sample/task``, ``sample_pct``)."""
    run_dir = Path(run_dir)
    log_dir = run_dir / "tensorboard" if (run_dir / "tensorboard").is_dir() else run_dir
    if not log_dir.is_dir():
        raise SystemExit(f"{run_dir}: no such run directory (give the run's workdir, e.g. runs/sokoban)")
    prefix = "grad_norm_prefilter/" if prefilter else "grad_norm/"
    out: dict[int, dict[str, dict[str, float]]] = {}
    for tag, series in read_scalars(log_dir).items():
        if not tag.startswith(prefix):
            continue
        bucket, metric = tag[len(prefix):].split("/", 1)
        for step, value in series:
            out.setdefault(step, {}).setdefault(bucket, {})[metric] = value
    if not out:
        raise SystemExit(f"{log_dir}: no {prefix} series; the run was not analysed. Run it with "
                         "--config.trainer.gradient_analysis_every=N (e.g. 10) to log them.")
    return out


def table(buckets: dict[str, dict[str, float]]) -> list[str]:
    """Markdown rows for one step (or a mean over steps)."""
    names = sorted(buckets, key=_bucket_key)
    has_kl = any("kl" in m for m in buckets.values())
    total = sum(buckets[n].get("task", 0.0) for n in names if n != "all")
    shares = {n: (buckets[n].get("task", 0.0) / total if total > 0 else 0.0) for n in names if n != "all"}
    head = "| bucket | reward std mean (min–max) | episodes | task | task / episode | entropy |"
    rule = "|---|---|---:|---:|---:|---:|"
    if has_kl:
        head, rule = head + " kl |", rule + "---:|"
    rows = [head + " task share |", rule + "---:|"]
    for n in names:
        m = buckets[n]
        if not m.get("sample_pct", 0.0):
            rows.append(f"| {n} | — | 0% | — | — | — |" + (" — |" if has_kl else "") + (" |" if n == "all" else " — |"))
            continue
        row = (f"| {n} | {m.get('reward_std_mean', 0.0):.3g} ({m.get('reward_std_min', 0.0):.3g}–"
               f"{m.get('reward_std_max', 0.0):.3g}) | {m.get('sample_pct', 0.0):.0%} | {m.get('task', 0.0):.3g} "
               f"| {m.get('per_sample/task', 0.0):.3g} | {m.get('entropy', 0.0):.3g} |")
        if has_kl:
            row += f" {m.get('kl', 0.0):.3g} |"
        rows.append(row + (" |" if n == "all" else f" {shares[n]:.0%} |"))
    return rows


def mean_over_steps(per_step: dict[int, dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Every bucket's metrics averaged over the analysed steps where it held episodes (an empty bucket
    reports zeros, which are not measurements); its share of the episodes over all the steps; its
    reward-std range over the steps (the lowest min, the highest max)."""
    sums: dict[str, dict[str, list[float]]] = {}
    for buckets in per_step.values():
        for name, metrics in buckets.items():
            sums.setdefault(name, {}).setdefault("sample_pct", []).append(metrics.get("sample_pct", 0.0))
            if not metrics.get("sample_pct", 0.0):
                continue
            for metric, value in metrics.items():
                if metric != "sample_pct":
                    sums[name].setdefault(metric, []).append(value)
    combine = {"reward_std_min": min, "reward_std_max": max}  # the range over the steps, not a mean of ranges
    return {n: {k: combine.get(k, lambda v: sum(v) / len(v))(v) for k, v in ms.items()} for n, ms in sums.items()}


def report(run_dir: str | Path, prefilter: bool = False, steps: list[int] | None = None) -> str:
    per_step = collect(run_dir, prefilter)
    if steps:
        missing = sorted(set(steps) - set(per_step))
        if missing:
            raise SystemExit(f"steps {missing} were not analysed; analysed steps: {sorted(per_step)}")
        per_step = {s: per_step[s] for s in steps}
    which = "the whole rollout batch (before the SNR filter)" if prefilter else "what the SNR filter kept"
    lines = [f"# Gradient analysis of {run_dir}: {which}", ""]
    for step in sorted(per_step):
        lines += [f"## Step {step}", "", *table(per_step[step]), ""]
    if len(per_step) > 1:
        lines += [f"## Mean over the {len(per_step)} analysed steps ({', '.join(map(str, sorted(per_step)))})", "",
                  *table(mean_over_steps(per_step)), ""]
    return "\n".join(lines)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="the run's workdir (its tensorboard/ folder holds the series)")
    parser.add_argument("--prefilter", action="store_true", help="the whole rollout batch, before the SNR filter")
    parser.add_argument("--steps", default=None, help="comma-separated analysed steps (default: all)")
    args = parser.parse_args(argv)
    steps = [int(s) for s in args.steps.split(",")] if args.steps else None
    text = report(args.run_dir, args.prefilter, steps)
    print(text)
    return text


def cli() -> None:
    """The console entry point (``ragen-gradient-report``): ``main`` on the command line's arguments."""
    main()


if __name__ == "__main__":
    main()
