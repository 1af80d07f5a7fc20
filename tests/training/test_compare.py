"""``ragen_jax.compare``: variants, the statistics against hand-worked values, the report against a
NumPy re-derivation, and a real comparison whose runs share one cached warm-up."""
import copy
import itertools
import json
import math

import numpy as np
import pytest

from configs import frozen_lake
from ragen_jax import compare as cmp
from ragen_jax.config import ConfigError


def test_parse_variants_labels_joins_and_types():
    vs = cmp.parse_variants("off:filter.value=1.0+filter.include_zero=true, filter.strategy=top_k,"
                            "env.dim_room=(5, 5)")
    assert [v.label for v in vs] == ["off", "filter.strategy=top_k", "env.dim_room=(5, 5)"]
    assert vs[2].overrides == (("env.dim_room", (5, 5)),)
    assert vs[0].overrides == (("filter.value", 1.0), ("filter.include_zero", True))
    assert vs[1].overrides == (("filter.strategy", "top_k"),)
    assert cmp.parse_variants("a:x.y=3")[0].overrides == (("x.y", 3),)
    with pytest.raises(ConfigError, match="not key=value"):
        cmp.parse_variants("filter.value")
    with pytest.raises(ConfigError, match="same label"):
        cmp.parse_variants("a:filter.value=1.0,a:filter.value=0.9")
    with pytest.raises(ConfigError, match="names no variant"):
        cmp.parse_variants(" , ")


def test_overrides_name_unknown_keys_and_bad_values():
    cfg = frozen_lake.get_config()
    cmp.apply_overrides(cfg, [("filter.value", 0.5), ("filter.strategy", "min_p")])
    assert (cfg.filter.value, cfg.filter.strategy) == (0.5, "min_p")
    with pytest.raises(ConfigError, match=r"unknown config key 'filter.vale'.*Did you mean value"):
        cmp.apply_overrides(cfg, [("filter.vale", 0.5)])
    with pytest.raises(ConfigError, match="filter.value='abc'"):
        cmp.apply_overrides(cfg, [("filter.value", "abc")])
    # A bad strategy name is refused when the run configs are resolved, before anything runs.
    with pytest.raises(ConfigError, match="top_q"):
        cmp.run_configs(frozen_lake.get_config(), cmp.parse_variants("filter.strategy=top_q"), 1,
                        cmp.Path("/tmp/unused"))


def test_a_variant_that_sets_its_seed_keeps_it(tmp_path):
    """``s5:seed=5,s7:seed=7`` compares two seeds (it once ran both at the base seed); a variant
    without a seed counts from the config's."""
    runs = cmp.run_configs(frozen_lake.get_config(), cmp.parse_variants("s5:seed=5,s7:seed=7,plain:filter.value=0.9"),
                           2, tmp_path)
    assert [(v.label, i, cfg.seed) for v, i, cfg in runs] == [
        ("s5", 0, 5), ("s7", 0, 7), ("plain", 0, 0), ("s5", 1, 6), ("s7", 1, 8), ("plain", 1, 1)]


def test_paired_test_hand_worked():
    # Six puzzles, all better by 1: Wilcoxon's exact two-sided p = 2 / 2^6 (every sign positive).
    a, b = np.ones(6), np.zeros(6)
    t = cmp.paired_test(a, b)
    assert t["diff"] == 1.0 and t["se"] == 0.0 and t["differing"] == 6
    assert t["p"] == pytest.approx(2 / 64)
    # Ties are dropped: the same six plus four equal puzzles give the same p.
    t = cmp.paired_test(np.r_[a, 0.5 * np.ones(4)], np.r_[b, 0.5 * np.ones(4)])
    assert t["p"] == pytest.approx(2 / 64) and t["differing"] == 6 and t["puzzles"] == 10
    # Differences +1, +1, -1 (ranks tie at 2): W+ = 4 of 6; exact p = P(|W - 3| >= 1) = 6/8.
    t = cmp.paired_test([1, 1, 0, 0.5], [0, 0, 1, 0.5])
    assert t["diff"] == pytest.approx(0.25)
    assert t["se"] == pytest.approx(np.std([1, 1, -1, 0], ddof=1) / 2)
    assert 0.5 < t["p"] <= 1.0
    assert cmp.paired_test(np.ones(5), np.ones(5))["p"] == 1.0
    assert cmp.paired_test(np.ones(5), np.ones(5))["p_mean"] == 1.0
    with pytest.raises(ConfigError, match="different puzzle sets"):
        cmp.paired_test(np.ones(5), np.ones(4))
    assert math.isnan(cmp.mean_se([0.5])[1])  # one seed: no spread to report
    m, se = cmp.mean_se([0.5, 0.7, 0.9])
    assert m == pytest.approx(0.7) and se == pytest.approx(0.2 / math.sqrt(3))


def _fake_run(path, seed, puzzles_by_step, timing):
    h = {"val": [[s, float(np.mean(p))] for s, p in puzzles_by_step],
         "val_puzzles": [[s, list(map(float, p))] for s, p in puzzles_by_step],
         "timing": timing, "train": [], "quadrant": []}
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({"summary": {"steps": puzzles_by_step[-1][0]},
                                                   "stop_reason": None, "history": h}))


def test_report_matches_numpy(tmp_path):
    rng = np.random.default_rng(0)
    warm = (rng.random(20) < 0.5).astype(float)
    variants = cmp.parse_variants("off:filter.value=1.0,on:filter.value=0.9")
    finals, times = {}, {}
    for vi, v in enumerate(variants):
        for seed in range(3):
            final = (rng.random(20) < 0.5 + 0.2 * vi).astype(float)
            finals[v.label, seed] = final
            # step, rollout s, update s, kept: the first step compiles (slow) and is left out.
            # One step spans a paused process (an hour of wall time): the median ignores it.
            timing = [[1, 9.0, 9.0, 1.0]] + [[s, 1.0 + seed, 2.0 - vi, 1.0 - 0.5 * vi] for s in range(2, 5)]
            timing[2] = [3, 1.0 + seed, 3600.0, 1.0 - 0.5 * vi]
            times[v.label, seed] = (1.0 + seed) + (2.0 - vi)
            _fake_run(tmp_path / v.slug / f"seed{seed}", seed, [(0, warm), (4, final)], timing)
    report = cmp.write_report(tmp_path, variants, 3)
    rows = {r["variant"]: r for r in report["rows"]}
    for label in ("off", "on"):
        fin = [finals[label, s].mean() for s in range(3)]
        assert rows[label]["final"][0] == pytest.approx(np.mean(fin))
        assert rows[label]["final"][1] == pytest.approx(np.std(fin, ddof=1) / np.sqrt(3))
        assert rows[label]["step_s"][0] == pytest.approx(np.mean([times[label, s] for s in range(3)]))
        per_puzzle = np.mean([finals[label, s] for s in range(3)], axis=0)
        assert rows[label]["vs_warmup"]["diff"] == pytest.approx((per_puzzle - warm).mean())
    off = np.mean([finals["off", s] for s in range(3)], axis=0)
    on = np.mean([finals["on", s] for s in range(3)], axis=0)
    assert rows["off"]["vs_baseline"] is None
    assert rows["on"]["vs_baseline"]["diff"] == pytest.approx((on - off).mean())
    assert rows["on"]["step_time_saved"] == pytest.approx(1 - 3.0 / 4.0)  # (2+1) vs (2+2) s on average
    assert rows["on"]["kept"][0] == pytest.approx((1.0 + 3 * 0.5) / 4)
    text = (tmp_path / "comparison.md").read_text()
    assert "| `on` | 3 | 4 |" in text and "| +25% |" in text
    assert (tmp_path / "comparison.png").stat().st_size > 0
    with pytest.raises(ConfigError, match="not a variant"):
        cmp.summarize(cmp.collect(tmp_path, variants, 3), baseline="nope")


def test_report_at_a_common_step(tmp_path):
    """``--at_step``: runs of different lengths read at one step — a 4-step run at its step-2
    validation beside a 2-step one, step times up to that step; a run not validated there is left out."""
    variants = cmp.parse_variants("long:filter.value=0.9,short:filter.value=1.0")
    warm = np.array([1.0, 0.0, 0.0, 0.0])
    long_at2, long_at4 = np.array([1.0, 1.0, 0.0, 0.0]), np.array([1.0, 1.0, 1.0, 1.0])
    short_at2 = np.array([0.0, 1.0, 1.0, 1.0])
    # step, rollout s, update s, kept: steps 3-4 of the long run are slow and must not count at step 2.
    _fake_run(tmp_path / "long" / "seed0", 0, [(0, warm), (2, long_at2), (4, long_at4)],
              [[1, 9.0, 9.0, 1.0], [2, 1.0, 1.0, 0.5], [3, 50.0, 50.0, 0.0], [4, 50.0, 50.0, 0.0]])
    _fake_run(tmp_path / "short" / "seed0", 0, [(0, warm), (2, short_at2)], [[1, 9.0, 9.0, 1.0], [2, 1.0, 3.0, 1.0]])
    # Seed 1 of the long variant validated at 1 and 3 only: not at step 2, so not in that report.
    _fake_run(tmp_path / "long" / "seed1", 1, [(0, warm), (1, warm), (3, long_at4)], [[1, 9.0, 9.0, 1.0]])
    report = cmp.write_report(tmp_path, variants, 2, at_step=2)
    rows = {r["variant"]: r for r in report["rows"]}
    assert report["at_step"] == 2 and rows["long"]["seeds"] == 1 and rows["long"]["steps"] == [2]
    assert rows["long"]["final"][0] == 0.5 and rows["long"]["best"][0] == 0.5  # not step 4's 1.0
    assert rows["long"]["step_s"][0] == 2.0 and rows["long"]["kept"][0] == pytest.approx(0.75)
    assert [c[0] for c in rows["long"]["curve"]] == [0, 2]
    assert rows["short"]["final"][0] == 0.75
    # Paired, by hand: short - long at step 2 = (-1, 0, +1, +1) / 4 puzzles; long - warm-up = (0, +1, 0, 0).
    assert rows["short"]["vs_baseline"]["diff"] == pytest.approx(0.25)
    assert rows["long"]["vs_warmup"]["diff"] == pytest.approx(0.25)
    text = (tmp_path / "comparison_step2.md").read_text()
    assert "| step 2 |" in text and "at step 2" in text and "| `long` | 1 | 2 |" in text
    assert not (tmp_path / "comparison.md").exists()  # the final report is a file of its own
    final = {r["variant"]: r for r in cmp.write_report(tmp_path, variants, 2)["rows"]}
    assert final["long"]["final"][0] == pytest.approx(np.mean([1.0, 1.0]))  # both seeds' last validations


def test_vs_warmup_pairs_each_variant_with_its_own_warmup(tmp_path):
    """A variant that changes what the warm-up depends on (here a larger group) has its own warm-up:
    its "vs warm-up" is paired against that one, not against the first variant's."""
    variants = cmp.parse_variants("base:filter.value=1.0,g8:rollout.group_size=8")
    timing = [[1, 9.0, 9.0, 1.0], [2, 1.0, 1.0, 1.0]]
    base_warm, base_final = [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]  # +0.25 over its warm-up
    g8_warm, g8_final = [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]  # -0.25 over its own warm-up
    _fake_run(tmp_path / "base" / "seed0", 0, [(0, np.array(base_warm)), (2, np.array(base_final))], timing)
    _fake_run(tmp_path / "g8" / "seed0", 0, [(0, np.array(g8_warm)), (2, np.array(g8_final))], timing)
    rows = {r["variant"]: r for r in cmp.summarize(cmp.collect(tmp_path, variants, 1))["rows"]}
    assert rows["base"]["vs_warmup"]["diff"] == pytest.approx(0.25)
    assert rows["g8"]["vs_warmup"]["diff"] == pytest.approx(-0.25)  # against base's warm-up it would be +0.25
    assert rows["g8"]["vs_baseline"]["diff"] == pytest.approx(0.0)


def test_report_before_the_baseline_has_run(tmp_path):
    """The report is rewritten after every run: with ``--baseline`` naming a variant that has not
    finished a run yet, the finished ones are reported with no baseline pairing (it used to stop the
    comparison with a StopIteration before the baseline ran)."""
    variants = cmp.parse_variants("recipe:filter.value=0.9,grpo:filter.value=1.0")
    timing = [[1, 9.0, 9.0, 1.0], [2, 1.0, 2.0, 0.5]]
    _fake_run(tmp_path / "recipe" / "seed0", 0, [(0, np.array([1.0, 0.0])), (2, np.array([1.0, 1.0]))], timing)
    report = cmp.write_report(tmp_path, variants, 1, baseline="grpo")
    (row,) = report["rows"]
    assert row["variant"] == "recipe" and row["vs_baseline"] is None
    assert row["vs_warmup"]["diff"] == pytest.approx(0.5)
    assert math.isnan(row["step_time_saved"])
    assert "| — |" in (tmp_path / "comparison.md").read_text()


def _base_config():
    from tests.training.test_trainer import small_config_dict

    c = small_config_dict("unused", total_steps=2, **{"warmup.single_turn_steps": 2})
    c.eval.num_episodes = 4
    c.eval.write_transcripts = False
    c.trainer.update(dict(save_every=2, transcript_every=0))
    c.compilation_cache_dir = ""
    return c


def test_comparison_shares_one_warmup_and_resumes(tmp_path, monkeypatch):
    from ragen_jax.training import trainer, warmup
    from ragen_jax.training.event_log import read_scalars

    calls = []
    real = warmup.run_warmup
    # Counted where the loop calls it (the trainer imports the function).
    monkeypatch.setattr(trainer, "run_warmup", lambda *a, **k: calls.append(1) or real(*a, **k))
    variants = cmp.parse_variants("off:filter.value=1.0+filter.include_zero=true,top-k:filter.strategy=top_k"
                                  "+filter.value=0.5")
    out = tmp_path / "cmp"
    report = cmp.compare(_base_config(), variants, 2, out)
    assert len(calls) == 1  # four runs, one behaviour cloning
    summaries = {(v.slug, s): json.loads((out / v.slug / f"seed{s}" / "summary.json").read_text())
                 for v in variants for s in range(2)}
    first = summaries["off", 0]
    assert "warmup/from_cache" not in first["summary"]
    for key, saved in summaries.items():
        if key != ("off", 0):
            assert saved["summary"]["warmup/from_cache"] == 1.0
            assert saved["summary"]["warmup/final_loss"] == first["summary"]["warmup/final_loss"]
        # The same validation before RL everywhere (the warm-up's), puzzle by puzzle.
        assert saved["history"]["val_puzzles"][0] == first["history"]["val_puzzles"][0]
    # Seeds differ after the warm-up: the two seeds' rollouts are not the same.
    t0 = summaries["off", 0]["history"]["train"]
    t1 = summaries["off", 1]["history"]["train"]
    assert len(t0) == len(t1) == 2
    assert [len(r["curve"]) for r in report["rows"]] == [2, 2]
    assert (out / "comparison.md").exists() and (out / "comparison.json").exists()

    # A run restored from the cache is the run that computed it: the same variant and seed without a
    # cache logs the same RL values.
    c = _base_config()
    cmp.apply_overrides(c, variants[0].overrides)
    c.workdir = str(tmp_path / "alone")
    trainer.train(cmp.resolve(c))
    assert len(calls) == 2
    cached = read_scalars(out / "off" / "seed0" / "tensorboard")
    alone = read_scalars(tmp_path / "alone" / "tensorboard")
    rl = [k for k in alone if k.startswith(("train/", "actor/", "val/"))]
    assert rl and all(cached[k] == alone[k] for k in rl), [k for k in rl if cached[k] != alone[k]]

    # Re-running the command runs nothing new; the report is rebuilt from the runs.
    stamp = (out / "off" / "seed0" / "summary.json").stat().st_mtime
    again = cmp.compare(_base_config(), variants, 2, out)
    assert len(calls) == 2 and (out / "off" / "seed0" / "summary.json").stat().st_mtime == stamp
    assert again["rows"][0]["final"] == report["rows"][0]["final"]


def test_warmup_fingerprint_covers_what_the_warmup_depends_on():
    from ragen_jax.training.warmup_cache import eval_fingerprint, fingerprint

    base = frozen_lake.get_config()
    key = fingerprint(base)

    def changed(dotted, value, fn=fingerprint, cfg=None):
        c = copy.deepcopy(cfg if cfg is not None else base)
        cmp.apply_overrides(c, [(dotted, value)])
        return fn(c) != fn(cfg if cfg is not None else base)

    # What a comparison varies, and where the cache lives, leave the warm-up's key alone ...
    for dotted, value in (("filter.value", 1.0), ("starpo.actor_lr", 1e-4), ("seed", 7),
                          ("trainer.total_steps", 3), ("warmup.cache_dir", "/elsewhere"), ("eval.num_episodes", 8)):
        assert not changed(dotted, value), dotted
    # ... what the warm-up computes from changes it.
    for dotted, value in (("warmup.steps", 5), ("warmup.seed", 9), ("model.tiny.hidden_size", 32),
                          ("env.p", 0.8), ("rollout.max_new_tokens", 30)):
        assert changed(dotted, value), dotted
    # LoRA adapters draw their initialisation from the run's seed: then it is part of the key.
    lora = copy.deepcopy(base)
    lora.model.lora_rank = 4
    assert fingerprint(lora) != key and changed("seed", 7, cfg=lora)
    assert changed("eval.num_episodes", 8, fn=eval_fingerprint) and not changed("eval.write_transcripts", False,
                                                                                 fn=eval_fingerprint)


def test_cli_refuses_a_bad_variant_before_running_anything(tmp_path):
    import subprocess
    import sys

    root = cmp.Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "ragen_jax.compare", "--config", "configs/frozen_lake.py",
                        "--variants", "filter.value=1.0,filter.vale=0.9", "--seeds", "2", "--out", str(tmp_path)],
                       cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "Configuration error: unknown config key 'filter.vale'" in p.stderr, p.stderr[-1500:]
    assert "Did you mean value" in p.stderr
    assert not any(tmp_path.iterdir())  # no run was started


def test_sign_flip_p_hand_worked_and_against_enumeration():
    # +1 three times: of the 8 sign patterns, 2 reach |total| >= 3.
    assert cmp.sign_flip_p([1, 1, 1, 0]) == pytest.approx(2 / 8)
    # +1, +0.5: totals ±1.5 and ±0.5, so 2 of 4 reach 1.5.
    assert cmp.sign_flip_p([1, 0.5]) == pytest.approx(2 / 4)
    assert cmp.sign_flip_p([1, 1, -1]) == 1.0  # every pattern reaches |total| >= 1
    # Nine puzzles gained by one seed in three, two lost by all three (mean +1/11): each puzzle
    # counts by its difference, checked against an enumeration of all 2^11 sign patterns.
    d = np.r_[np.full(9, 1 / 3), -np.ones(2)]
    totals = np.abs(np.array(list(itertools.product((-1, 1), repeat=d.size))) @ d)
    assert cmp.sign_flip_p(d) == pytest.approx(np.mean(totals >= abs(d.sum()) - 1e-12))
    # Past 16 differences the p-value is drawn from seeded random patterns: it matches the exact
    # enumeration (2^18 patterns here) within Monte-Carlo error, and is the same on every call.
    d = np.r_[np.full(12, 1 / 3), -np.full(3, 2 / 3), -np.ones(3)]
    exact = np.mean(np.abs(np.array(list(itertools.product((-1, 1), repeat=d.size))) @ d) >= abs(d.sum()) - 1e-12)
    assert cmp.sign_flip_p(d) == pytest.approx(exact, abs=0.01)
    assert cmp.sign_flip_p(d) == cmp.sign_flip_p(d)
