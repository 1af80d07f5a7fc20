"""Variants × seeds from one warm-up, side by side: RAGEN-2's claims, checkable by one command.

    python -m ragen_jax.compare --config configs/frozen_lake.py \\
        --variants "off:filter.value=1.0,top-p:filter.value=0.9,top-k:filter.strategy=top_k+filter.value=0.25" \\
        --seeds 3 --out runs/compare_filter --config.trainer.total_steps=50

Every run is the config file with the command line's ``--config.*`` overrides, then one variant's
overrides (``key=value`` joined by ``+``; an optional ``label:`` in front names the row), and seed
``config.seed + i`` for ``i < --seeds`` (a variant that sets ``seed`` itself counts from its own).
All runs share one behaviour-cloning warm-up (``warmup.cache_dir``, default ``<out>/warmup_cache``):
it is computed by the first run and restored by the others, so the runs differ only in what the
variant changes after it, and in the RL seed. A variant that changes what the warm-up depends on
(the ``model``, ``env``, ``rollout`` or ``warmup`` sections, e.g. ``rollout.group_size``) gets a
warm-up of its own, cached the same way, and its "against the warm-up" column below pairs it with
that one. Runs are executed seed by seed (every variant once, then every variant again, ...) in
``<out>/<variant>/seed<i>``; a run that finished is not run again, one that was interrupted
resumes from its checkpoint — re-running the command continues a comparison.

After every run the report is rewritten:

* ``<out>/comparison.md`` (and ``.json``): per variant, the final validation success as mean ±
  standard error over seeds; the paired per-puzzle difference against the baseline variant (the
  first one, or ``--baseline``) and against the warm-up alone (validation before RL, the same
  puzzles), each with a Wilcoxon signed-rank p-value and a sign-flip permutation p-value of the mean
  difference over the validation puzzles (a puzzle's value is its success averaged over seeds and
  attempts); the StarPO step time (median over steps after the first, which compiles) split into
  rollout and update, and the rows kept by the SNR filter;
* ``<out>/comparison.png``: validation success against step (mean ± SE over seeds, the warm-up
  as a dashed line) and the step time per variant.

``--report_only`` rewrites the report from the runs already in ``--out``. ``--at_step N`` also writes
``<out>/comparison_step<N>.md`` (``.json``, ``.png``): the same report read at every run's validation
at step ``N`` (curves and step times up to it), so runs of different lengths — a 200-step variant
beside 400-step ones — are compared at a common step; a run not validated at ``N`` is left out of it.
"""
from __future__ import annotations

if __name__ == "__main__":  # first, before JAX is imported: the opt-in restart with huge pages (malloc_tuning)
    from ragen_jax.malloc_tuning import reexec_with_huge_pages

    reexec_with_huge_pages()

import ast
import copy
import dataclasses
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import flags
from matplotlib.figure import Figure
from scipy import stats

from ragen_jax import launch
from ragen_jax.config import ConfigError, resolve
from ragen_jax.training.paired import mean_se, sign_flip_p  # noqa: F401 (re-exported)
from ragen_jax.training.trainer import train

# --------------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    overrides: tuple[tuple[str, Any], ...]  # (dotted key, value)

    @property
    def slug(self) -> str:
        """A directory name for the variant's runs."""
        return re.sub(r"[^A-Za-z0-9._=-]+", "_", self.label).strip("_") or "variant"


def parse_value(text: str):
    """A command-line value as Python: literals (``0.9``, ``True``, ``(6, 6)``), else the string."""
    lowered = {"true": True, "false": False, "none": None}
    if text.lower() in lowered:
        return lowered[text.lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _split_outside_brackets(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` except inside ``()``/``[]`` (``env.dim_room=(5, 5)`` stays whole)."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return parts + [current]


def parse_variants(text: str) -> list[Variant]:
    """``"a:k=v+k2=v2,k=v"`` -> variants; each needs at least one ``key=value``."""
    variants = []
    for item in (part.strip() for part in _split_outside_brackets(text, ",")):
        if not item:
            continue
        label, _, body = item.rpartition(":") if ":" in item.split("=", 1)[0] else ("", "", item)
        overrides = []
        for assignment in body.split("+"):
            key, eq, value = assignment.strip().partition("=")
            if not eq or not key:
                raise ConfigError(f"variant {item!r}: {assignment!r} is not key=value (join several with '+', "
                                 "e.g. filter.strategy=top_k+filter.value=0.25)")
            overrides.append((key.strip(), parse_value(value.strip())))
        variants.append(Variant(label.strip() or body, tuple(overrides)))
    if not variants:
        raise ConfigError("--variants names no variant (e.g. --variants filter.value=1.0,filter.value=0.9)")
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels) or len({v.slug for v in variants}) != len(variants):
        raise ConfigError(f"two variants have the same label: {labels}; give them labels (label:key=value)")
    return variants


def apply_overrides(config, overrides) -> None:
    """Set each ``(dotted key, value)`` in ``config``; a ``ConfigError`` names a key that does not
    exist (with the close matches) or a value of the wrong type."""
    for key, value in overrides:
        message = launch.unknown_key_message(config, key)
        if message:
            raise ConfigError(message)
        *path, name = key.split(".")
        node = config
        for part in path:
            node = node[part]
        try:
            node[name] = value
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{key}={value!r}: {e}") from None


def run_configs(base, variants: list[Variant], seeds: int, out: Path) -> list[tuple[Variant, int, Any]]:
    """``(variant, seed index, config)`` in run order (seed by seed), each with its workdir, seed and
    the shared warm-up cache set; every config is resolved first, so a bad one stops the command
    before anything runs."""

    runs = []
    for i in range(seeds):
        for v in variants:
            cfg = copy.deepcopy(base)
            apply_overrides(cfg, v.overrides)
            cfg.seed = int(cfg.seed) + i  # a variant that sets its own seed keeps it (offset by the seed index)
            cfg.workdir = str(out / v.slug / f"seed{i}")
            if not cfg.warmup.cache_dir:
                cfg.warmup.cache_dir = str(out / "warmup_cache")
            resolve(cfg)
            runs.append((v, i, cfg))
    return runs


def _finished(workdir: Path, config) -> bool:
    """A run whose summary was written for its last step (total steps or a stop reason)."""
    path = workdir / "summary.json"
    if not path.exists():
        return False
    saved = json.loads(path.read_text())
    return bool(saved.get("stop_reason")) or saved["summary"].get("steps", 0) >= config.trainer.total_steps


def compare(base, variants: list[Variant], seeds: int, out: str | Path, baseline: str | None = None,
            report_only: bool = False, at_step: int | None = None) -> dict:
    """Run every variant × seed (those not finished yet) and write the report (and, with ``at_step``,
    the report at that step too); returns the final report."""
    out = Path(out)
    runs = run_configs(base, variants, seeds, out)
    if not report_only:
        for n, (v, i, cfg) in enumerate(runs, 1):
            workdir = Path(cfg.workdir)
            if _finished(workdir, cfg):
                continue
            print(f"== run {n}/{len(runs)}: {v.label}, seed {cfg.seed} -> {workdir}")
            train(resolve(cfg))
            write_report(out, variants, seeds, baseline, _title(base))
    if at_step is not None:
        write_report(out, variants, seeds, baseline, _title(base), at_step)
    return write_report(out, variants, seeds, baseline, _title(base))


def _title(config) -> str:
    return f"{config.env.name} / {config.model.preset}: variants from one warm-up"


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def paired_test(a, b) -> dict[str, float]:
    """Paired comparison of per-puzzle values ``a`` and ``b`` (``[puzzles]``, the same puzzles):
    mean difference ``a - b`` ± its standard error over puzzles, the two-sided Wilcoxon
    signed-rank p-value (puzzles with equal values dropped; 1.0 when every puzzle ties) and the
    sign-flip permutation p-value of the mean difference (``p_mean``, ``sign_flip_p``)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ConfigError(f"paired test of {a.shape[0]} against {b.shape[0]} puzzles: the runs were validated on "
                         "different puzzle sets (eval.num_episodes / eval.validation_seed differ)")
    d = a - b
    diff, se = mean_se(d)
    nonzero = int(np.count_nonzero(d))
    p = 1.0 if nonzero == 0 else float(stats.wilcoxon(a, b, zero_method="wilcox").pvalue)
    return {"diff": diff, "se": se, "p": p, "p_mean": sign_flip_p(d), "puzzles": int(d.size),
            "differing": nonzero}


@dataclasses.dataclass
class RunResult:
    """What the report reads from one finished (or partly run) training run."""

    seed: int
    steps: int
    val: list  # [[step, success]]
    puzzles: dict  # step -> per-puzzle success [P]
    timing: np.ndarray  # [steps, 4]: step, rollout s, update s, kept fraction
    summary: dict

    @classmethod
    def read(cls, workdir: Path, seed: int) -> "RunResult | None":
        path = workdir / "summary.json"
        if not path.exists():
            return None
        saved = json.loads(path.read_text())
        h = saved["history"]
        timing = np.asarray(h.get("timing", []), np.float64).reshape(-1, 4)
        return cls(seed, int(saved["summary"].get("steps", 0)), h.get("val", []),
                   {int(s): np.asarray(p, np.float64) for s, p in h.get("val_puzzles", [])}, timing,
                   saved["summary"])

    def until(self, step: int) -> "RunResult | None":
        """This run as it stood at ``step`` (validations, per-puzzle results and step times up to
        it), or None when it was not validated at ``step``."""
        if step not in self.puzzles or not any(int(s) == step for s, _ in self.val):
            return None
        return dataclasses.replace(
            self, steps=step, val=[[s, v] for s, v in self.val if s <= step],
            puzzles={s: p for s, p in self.puzzles.items() if s <= step},
            timing=self.timing[self.timing[:, 0] <= step] if len(self.timing) else self.timing)

    @property
    def final_puzzles(self) -> np.ndarray | None:
        return self.puzzles[max(self.puzzles)] if self.puzzles else None

    def step_seconds(self) -> tuple[float, float, float]:
        """Median (rollout, update, whole step) seconds over the steps after the first (compilation).

        The median, not the mean: one step that spans a paused or suspended process (hours of wall
        time) would otherwise set a run's step time."""
        t = self.timing[1:] if len(self.timing) > 1 else self.timing
        if not len(t):
            return math.nan, math.nan, math.nan
        return float(np.median(t[:, 1])), float(np.median(t[:, 2])), float(np.median(t[:, 1] + t[:, 2]))


def collect(out: Path, variants: list[Variant], seeds: int, at_step: int | None = None) -> dict[str, list[RunResult]]:
    """Each variant's runs that have validated (with ``at_step``: as they stood at that step, those
    validated at it)."""
    results = {}
    for v in variants:
        runs = [RunResult.read(out / v.slug / f"seed{i}", i) for i in range(seeds)]
        runs = [r for r in runs if r is not None and r.val]
        if at_step is not None:
            runs = [r for r in (r.until(at_step) for r in runs) if r is not None]
        results[v.label] = runs
    return results


def _mean_over_seeds(runs: list[RunResult], step: int | None = None) -> np.ndarray | None:
    """Per-puzzle success averaged over the runs' final validations (or those at ``step``)."""
    rows = [r.final_puzzles if step is None else r.puzzles.get(step) for r in runs]
    rows = [x for x in rows if x is not None]
    return np.mean(rows, axis=0) if rows else None


def summarize(results: dict[str, list[RunResult]], baseline: str | None = None) -> dict:
    """The report's numbers (``comparison.json``)."""
    labels = [k for k, runs in results.items() if runs]
    if not labels:
        return {"baseline": None, "rows": []}
    baseline = baseline if baseline is not None else labels[0]
    if baseline not in results:
        raise ConfigError(f"--baseline {baseline!r} is not a variant; variants: {', '.join(results)}")
    base_puzzles = _mean_over_seeds(results[baseline])
    # Variants that change only what follows the warm-up share one cached warm-up, so the first run
    # validated at step 0 stands for a variant without a step-0 validation of its own. One that
    # changes what the warm-up depends on (the rollout's group layout, the model, ...) has its own
    # warm-up and is paired against that.
    before_rl = {label: _mean_over_seeds(runs, 0) for label, runs in results.items() if runs}
    shared_warmup = next((p for p in before_rl.values() if p is not None), None)
    rows = []
    for label, runs in results.items():
        if not runs:
            continue
        finals = [r.val[-1][1] for r in runs]
        best = [max(v for _, v in r.val) for r in runs]
        seconds = np.asarray([r.step_seconds() for r in runs])
        kept = [float(r.timing[:, 3].mean()) for r in runs if len(r.timing)]
        puzzles = _mean_over_seeds(runs)
        warmup_puzzles = before_rl[label] if before_rl[label] is not None else shared_warmup
        row = {
            "variant": label, "seeds": len(runs), "steps": [r.steps for r in runs],
            "final": mean_se(finals), "best": mean_se(best),
            "before_rl": mean_se([r.val[0][1] for r in runs if r.val and r.val[0][0] == 0]),
            "rollout_s": mean_se(seconds[:, 0]), "update_s": mean_se(seconds[:, 1]),
            "step_s": mean_se(seconds[:, 2]), "kept": mean_se(kept),
            "vs_baseline": (paired_test(puzzles, base_puzzles) if label != baseline and puzzles is not None
                            and base_puzzles is not None else None),
            "vs_warmup": (paired_test(puzzles, warmup_puzzles) if puzzles is not None
                          and warmup_puzzles is not None else None),
            "curve": _curve(runs),
        }
        rows.append(row)
    # The baseline may not have finished a run yet (the report is rewritten after every run).
    base_step = next((r["step_s"][0] for r in rows if r["variant"] == baseline), None)
    for row in rows:
        row["step_time_saved"] = 1.0 - row["step_s"][0] / base_step if base_step else math.nan
    return {"baseline": baseline, "rows": rows}


def _curve(runs: list[RunResult]) -> list[list[float]]:
    """``[[step, mean, se, n]]``: validation success per step over the runs validated at it."""
    by_step: dict[int, list[float]] = {}
    for r in runs:
        for step, success in r.val:
            by_step.setdefault(int(step), []).append(float(success))
    return [[s, *mean_se(v), len(v)] for s, v in sorted(by_step.items())]


def _pm(ms, digits=3) -> str:
    m, se = ms
    if math.isnan(m):
        return "—"
    return f"{m:.{digits}f}" if math.isnan(se) else f"{m:.{digits}f} ± {se:.{digits}f}"


def _paired(t) -> str:
    if t is None:
        return "—"
    p_mean = f", p_mean={t['p_mean']:.3g}" if "p_mean" in t else ""  # reports written before it lack it
    return f"{t['diff']:+.3f} ± {t['se']:.3f} (p={t['p']:.3g}{p_mean}, {t['differing']}/{t['puzzles']} differ)"


def markdown(report: dict, title: str) -> str:
    at = report.get("at_step")
    read_at = "final validation" if at is None else f"the validation at step {at}; curves and step times up to it"
    lines = [f"# {title}", "",
             f"Validation success: mean ± standard error over seeds ({read_at}). Paired: per-puzzle "
             f"difference (success averaged over seeds) ± SE over puzzles, Wilcoxon signed-rank p and "
             f"sign-flip permutation p of the mean difference (p_mean). "
             f"Baseline: `{report['baseline']}`. Step time: median over StarPO steps after the first (mean ± SE over seeds).", "",
             f"| variant | seeds | steps | before RL | {'final' if at is None else f'step {at}'} | best | vs baseline (paired) | vs warm-up (paired) "
             "| step s (rollout + update) | time saved | rows kept |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        steps = sorted(set(r["steps"]))
        lines.append(
            f"| `{r['variant']}` | {r['seeds']} | {'/'.join(map(str, steps))} | {_pm(r['before_rl'])} | "
            f"{_pm(r['final'])} | {_pm(r['best'])} | {_paired(r['vs_baseline'])} | {_paired(r['vs_warmup'])} | "
            f"{_pm(r['step_s'], 2)} ({r['rollout_s'][0]:.2f} + {r['update_s'][0]:.2f}) | "
            f"{'—' if math.isnan(r['step_time_saved']) else format(r['step_time_saved'], '+.0%')} | "
            f"{_pm(r['kept'], 2)} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path, title: str) -> None:
    # A Figure of its own (no pyplot): nothing global changes, whatever backend the caller uses.
    fig = Figure(figsize=(10, 3.8), dpi=100)
    ax, bx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    warm = None
    for i, r in enumerate(report["rows"]):
        c = np.asarray(r["curve"], np.float64).reshape(-1, 4)
        ax.plot(c[:, 0], c[:, 1], "o-", color=f"C{i}", lw=1.8, ms=3, label=f"{r['variant']} (n={r['seeds']})")
        ax.fill_between(c[:, 0], c[:, 1] - c[:, 2], c[:, 1] + c[:, 2], color=f"C{i}", alpha=0.2)
        warm = r["before_rl"][0] if warm is None else warm
    if warm is not None and not math.isnan(warm):
        ax.axhline(warm, color="grey", ls="--", lw=1, label="warm-up only")
    ax.set_xlabel("StarPO step")
    ax.set_ylabel("validation success")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=10)
    names = [r["variant"] for r in report["rows"]]
    roll = [r["rollout_s"][0] for r in report["rows"]]
    upd = [r["update_s"][0] for r in report["rows"]]
    bx.barh(names, roll, color="C0", label="rollout")
    bx.barh(names, upd, left=roll, color="C1", label="update")
    bx.set_xlabel("seconds per StarPO step")
    bx.legend(fontsize=8)
    bx.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path)


def write_report(out: Path, variants: list[Variant], seeds: int, baseline: str | None = None,
                 title: str | None = None, at_step: int | None = None) -> dict:
    """Summarize the runs in ``out`` and write ``comparison.{md,json,png}`` (with ``at_step``:
    ``comparison_step<N>.*``, every run read at step N); returns the report."""
    report = summarize(collect(out, variants, seeds, at_step), baseline)
    report["at_step"] = at_step
    if not report["rows"] or jax.process_index() != 0:  # one process of a multi-process run writes
        return report
    title = title or f"Comparison in {out}"
    if at_step is not None:
        title = f"{title}, at step {at_step}"
    name = "comparison" if at_step is None else f"comparison_step{at_step}"
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(markdown(report, title))
    plot(report, out / f"{name}.png", title)
    print(markdown(report, title))
    return report


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    variants = flags.DEFINE_string("variants", None, "Comma-separated variants, each key=value[+key=value...], "
                                   "optionally label:...; e.g. off:filter.value=1.0,top-p:filter.value=0.9")
    seeds = flags.DEFINE_integer("seeds", 3, "Runs per variant (seeds config.seed + 0 ... + seeds - 1)", lower_bound=1)
    out = flags.DEFINE_string("out", None, "Output directory (default: <config workdir>_compare)")
    baseline = flags.DEFINE_string("baseline", None, "The variant label the paired tests compare against "
                                   "(default: the first)")
    report_only = flags.DEFINE_bool("report_only", False, "Only rewrite the report from the runs in --out")
    at_step = flags.DEFINE_integer("at_step", None, "Also write comparison_step<N>.md: every run read at its "
                                   "validation at step N (runs of different lengths side by side)", lower_bound=0)

    def run(_):
        cfg = launch._CONFIG.value
        if cfg is None or not variants.value:
            print("Configuration error: --config and --variants are required, e.g. --config configs/frozen_lake.py "
                  "--variants filter.value=1.0,filter.value=0.9", file=sys.stderr)
            sys.exit(2)
        launch.start(cfg)
        with launch.user_errors():
            parsed = parse_variants(variants.value)
            directory = Path(out.value or f"{cfg.workdir.rstrip('/')}_compare")
            directory.mkdir(parents=True, exist_ok=True)
            compare(cfg, parsed, seeds.value, directory, baseline.value, report_only.value, at_step.value)

    launch.run(argv, main=run)


if __name__ == "__main__":
    main()
