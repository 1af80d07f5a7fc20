"""End-to-end: warm-up → StarPO steps → TensorBoard → checkpoints → exact resume → eval JSONL.

All runs use the tiny preset on FrozenLake with very small sizes and fixed seeds, so every run of
this file sees the same numbers. Compiled programs go to the tests' persistent XLA cache
(``tests/conftest.py``): the interrupted and resumed runs then skip compilation.
"""
import json
import math
from pathlib import Path

import pytest

from configs import frozen_lake
from ragen_jax.config import resolve
from ragen_jax.training.event_log import read_events, read_scalars


def small_config(workdir, total_steps, **over):
    return resolve(small_config_dict(workdir, total_steps, **over))


def small_config_dict(workdir, total_steps, **over):
    """The main job's config, shrunk so a run takes seconds (a ConfigDict, not yet resolved)."""
    c = frozen_lake.get_config()
    c.workdir = str(workdir)
    c.model.tiny.update(dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                             head_dim=16))
    c.rollout.update(dict(num_groups=2, group_size=2, max_turns=2, max_actions_per_traj=4, max_new_tokens=56,
                          max_seq_len=432))
    c.starpo.mini_batch_size = 4
    # GRPO on one rollout a step, the main job's earlier recipe: the trainer tests stay fast and their
    # series comparable across versions (tools/series_check.py). GiGPO + dynamic sampling through the
    # trainer: tests/training/test_toolbox_trainer.py.
    c.starpo.update(dict(adv_estimator="grpo", entropy_coeff=0.001))
    c.filter.dynamic_sampling_rounds = 0
    c.collapse.update(dict(compute_freq=2, num_samples=4, micro_batch_size=8))
    c.warmup.update(dict(single_turn_steps=1, steps=2, batch_size=4, num_states=4, heldout_states=8))
    c.eval.num_episodes = 2
    c.trainer.update(dict(total_steps=total_steps, eval_every=2, save_every=1, transcript_every=1,
                          progress_bar=False))
    for k, v in over.items():
        section, key = k.split(".")
        c[section][key] = v
    return c


def _logged(workdir):
    """Every scalar written, except wall-clock timings (which differ between any two runs)."""
    return {k: v for k, v in read_scalars(Path(workdir) / "tensorboard").items()
            if not k.startswith("timing_s/") and k != "warmup/seconds"}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    from ragen_jax.training.trainer import train

    workdir = tmp_path_factory.mktemp("straight")
    out = train(small_config(workdir, total_steps=2))
    return workdir, out


def test_smoke_metrics_checkpoints_transcripts(straight_run):
    workdir, out = straight_run
    events = read_events(workdir / "tensorboard")
    families = {k.split("/")[0] for k in events}
    for fam in ("train", "rollout", "actor", "collapse", "collapse_first_turn_sample", "collapse_trajectory_sample",
                "early_stop", "timing_s", "val", "warmup", "transcripts"):
        assert fam in families, (fam, sorted(families))
    for key in ("train/success", "train/return", "train/valid_action_rate", "train/effective_action_rate",
                "train/response_length", "rollout/filter_kept_ratio", "rollout/in_group_reward_std",
                "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac",
                "collapse/first_turn_valid_rate", "collapse_first_turn_sample/computed",
                "collapse_first_turn_sample/num_prompts", "early_stop/reward_variance_collapse",
                "early_stop/mi_collapse", "timing_s/rollout", "timing_s/update", "timing_s/tokens_per_s", "val/success",
                "warmup/loss", "warmup/reading_accuracy", "train/describes_state", "val/describes_state",
                "val/first_turn_describes_state"):
        assert key in events, key
    # Three BC steps do not teach this model the reply format, so no first-turn reasoning parses and
    # the MI proxy has nothing to score: it reports that (computed 0, no prompts) and logs no
    # estimate, rather than zeros that would read as a collapse. (Estimates are checked against a
    # NumPy reference in tests/starpo; the loop's handling of both cases in test_early_stop.py.)
    for sample in ("collapse_first_turn_sample", "collapse_trajectory_sample"):
        computed = [v for _, v in events[f"{sample}/computed"]]
        assert len(computed) == 2 and (f"{sample}/mi_estimate" in events) == any(computed), sample
    assert all(v == 0 for _, v in events["collapse/first_turn_valid_rate"])
    # One-turn windows: the update scores each reply on the window it was sampled in, so its
    # recomputed log-probs equal the sampler's (the same weights) at every step.
    assert all(v < 1e-3 for _, v in events["actor/sampler_logprob_abs_diff_max"])
    # Losses and gradients are finite at every step.
    for key in ("actor/pg_loss", "actor/grad_norm", "warmup/loss", "train/return"):
        assert all(math.isfinite(v) for _, v in events[key]), key
    assert events["transcripts/train"][0][1] == "text"
    # Steps 1, 2 logged; validation before RL (step 0) and at step 2.
    assert [s for s, _ in events["train/success"]] == [1, 2]
    assert [s for s, _ in events["val/success"]] == [0, 2]
    # Checkpoints: step 0 (after warm-up) and the last steps, keep_checkpoints=3.
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [0, 1, 2]
    # Eval JSONL: one record per validation puzzle per evaluation, readable transcripts.
    lines = (workdir / "eval" / "transcripts.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    assert len(recs) == 2 * 2 and {r["step"] for r in recs} == {0, 2}
    for r in recs:
        assert r["transcript"].startswith("<|im_start|>system\n") and "Turn 1:\nState:\n" in r["transcript"]
        assert isinstance(r["success"], bool) and len(r["turn_rewards"]) == r["num_turns"]
    assert (workdir / "learning_curve.png").stat().st_size > 0
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["summary"]["steps"] == 2.0


def test_eval_mode_reproduces_final_validation(straight_run):
    """``mode=eval`` restores the last checkpoint and re-scores the same fixed puzzles identically."""
    from ragen_jax.training.evaluate import run_eval

    workdir, out = straight_run
    spec = small_config(workdir, total_steps=2, **{"trainer.resume": True})
    cfg = spec.config
    with cfg.unlocked():
        cfg.mode = "eval"
    metrics = run_eval(resolve(cfg))
    final = dict(read_scalars(workdir / "tensorboard")["val/success"])[2]
    assert metrics["val/success"] == pytest.approx(final, abs=1e-9)
    assert (workdir / "eval" / "transcripts_step2.jsonl").exists()


def test_eval_chunk_rows_plays_the_same_puzzles(straight_run):
    """``eval.chunk_rows``: the validation episodes in rollouts of that many rows. Greedy, each puzzle's
    episode does not depend on which rows share its rollout: one row at a time and all four at once
    give the same transcripts (the reference is the one-row cut, which shares nothing)."""
    from ragen_jax.training.evaluate import run_eval

    workdir, _ = straight_run
    texts = {}
    for rows in (1, 4):
        cfg = small_config(workdir, total_steps=2, **{"trainer.resume": True}).config
        with cfg.unlocked():
            cfg.mode = "eval"
            cfg.eval.update(dict(chunk_rows=rows, num_episodes=4, temperature=0.0))
        metrics = run_eval(resolve(cfg))
        lines = (workdir / "eval" / "transcripts_step2.jsonl").read_text().splitlines()
        texts[rows] = ([json.loads(line)["transcript"] for line in lines], metrics["val/success"])
    assert len(texts[1][0]) == 4
    assert texts[1] == texts[4]


def test_eval_of_a_step_without_a_checkpoint_names_the_steps_that_exist(straight_run):
    from ragen_jax.training.checkpoint import NoIntactCheckpoint
    from ragen_jax.training.evaluate import run_eval

    workdir, _ = straight_run
    cfg = small_config(workdir, total_steps=2, **{"trainer.resume": True}).config
    with cfg.unlocked():
        cfg.mode = "eval"
        cfg.eval.checkpoint_step = 99
    with pytest.raises(NoIntactCheckpoint, match=r"checkpoint_step=99: .* has no checkpoint 99; it holds steps 0, 1, 2"):
        run_eval(resolve(cfg))


def test_export_of_a_workdir_without_checkpoints_says_so(tmp_path):
    from ragen_jax.training.checkpoint import NoIntactCheckpoint
    from ragen_jax.training.evaluate import run_export

    (tmp_path / "checkpoints").mkdir()
    cfg = small_config(tmp_path, total_steps=1).config
    with cfg.unlocked():
        cfg.mode = "export"
    with pytest.raises(NoIntactCheckpoint, match="holds no checkpoint: nothing to export"):
        run_export(resolve(cfg))


def _resume_matches(tmp_path, total, interrupt_at, **over):
    from ragen_jax.training.trainer import StopTraining, train

    a = tmp_path / "a"
    train(small_config(a, total_steps=total, **over))
    b = tmp_path / "b"

    def interrupt(step, metrics):
        if step == interrupt_at:
            raise StopTraining

    first = train(small_config(b, total_steps=total, **over), step_callback=interrupt)
    assert first["stop_reason"] == "interrupted by callback"
    train(small_config(b, total_steps=total, **over))  # resumes from b/checkpoints/interrupt_at
    la, lb = _logged(a), _logged(b)
    assert set(la) == set(lb)
    for key in la:
        va, vb = dict(la[key]), dict(lb[key])
        assert sorted(va) == sorted(vb), key
        for s in va:
            assert abs(va[s] - vb[s]) <= 1e-6 * max(1.0, abs(va[s])), (key, s, va[s], vb[s])


def test_rows_cut_to_the_widest_window_log_what_full_width_rows_log(straight_run, tmp_path):
    """``starpo.seq_len_multiple`` on the main job (one-turn windows): the transcript and the per-turn
    rows are cut to the batch's widest (a multiple of 16) and the run logs what ``straight_run`` (full
    width, same seed) logs, value for value up to float rounding."""
    from ragen_jax.training.trainer import train

    spec = small_config(tmp_path, total_steps=2, **{"starpo.seq_len_multiple": 16})
    train(spec)
    cut, full = _logged(tmp_path), _logged(straight_run[0])
    widths, full_widths = dict(cut.pop("train/update_row_width")), dict(full.pop("train/update_row_width"))
    for logged in (cut, full):
        logged.pop("train/update_seq_len")  # the transcript's width: cut only where its padding allows
    assert set(cut) == set(full)
    windows = dict(cut["train/window_length_max"])
    for step, width in widths.items():
        assert width % 16 == 0 and width < full_widths[step], (step, width, full_widths[step])
    # The recomputed log-probs of the sampled tokens, on the cut rows, are the sampler's: no context was cut.
    assert max(v for _, v in cut["actor/sampler_logprob_abs_diff_max"]) < 1e-3
    for key in cut:
        a, b = dict(cut[key]), dict(full[key])
        assert sorted(a) == sorted(b), key
        for step in a:
            assert abs(a[step] - b[step]) <= 1e-4 * max(1.0, abs(b[step])), (key, step, a[step], b[step])
    assert sorted(windows) == sorted(widths)


def test_resume_is_exact_short(tmp_path):
    """2 steps straight == 1 step + interrupt + resume 1 step, for every logged metric."""
    _resume_matches(tmp_path, total=2, interrupt_at=1)


def test_kl_reference_is_the_warmed_up_policy_and_survives_a_resume(tmp_path):
    """``configs/sokoban.py``'s KL loss with unsolved-start replay: the reference is the policy the
    warm-up left, so step 1's first mini-batch, taken before any update, has k3 KL exactly 0 to it
    (k3 of two equal distributions); later steps move away from it (> 0); and 3 steps straight ==
    2 + interrupt + resume 1, which holds only if the checkpoint carries the reference (a resumed run
    that rebuilt it from the initial weights would log another KL)."""
    over = {"starpo.use_kl_loss": True, "starpo.kl_coef": 0.1, "starpo.kl_type": "low_var_kl",
            "filter.start_replay_fraction": 0.5, "filter.value": 1.0, "filter.include_zero": True,
            "starpo.mini_batch_size": 8}
    _resume_matches(tmp_path, total=3, interrupt_at=2, **over)
    kl = dict(_logged(tmp_path / "a")["actor/kl_loss"])
    assert kl[1] == pytest.approx(0.0, abs=1e-7)
    assert kl[2] > 1e-6 and kl[3] > 1e-6, kl


@pytest.mark.slow
def test_resume_is_exact_6_vs_3_plus_3(tmp_path):
    """6 steps straight == 3 + interrupt + resume 3 (MI computed at steps 1, 2, 4, 6; eval at 2, 4, 6)."""
    _resume_matches(tmp_path, total=6, interrupt_at=3)


def test_time_limit_stops_after_the_crossing_step_and_checkpoints_it(tmp_path):
    """A budget already spent by the warm-up: step 1 runs, is saved, and the run stops there."""
    from ragen_jax.training.checkpoint import Checkpointer
    from ragen_jax.training.trainer import train

    spec = small_config(tmp_path, total_steps=3, **{"trainer.time_limit_minutes": 1e-6, "trainer.save_every": 10,
                                                    "trainer.eval_every": 0})
    out = train(spec)
    assert out["stop_reason"].startswith("time limit")
    assert out["summary"]["steps"] == 1.0
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3)
    assert ckpt.latest_step() == 1
    ckpt.close()


def test_whole_conversation_context_trains_and_scores_turns_as_sampled(tmp_path):
    """The main job runs one-turn windows (``straight_run``); whole conversations (the base
    default) train end to end too, and the update's recomputed log-probs of the sampled tokens
    match the sampler's (same weights, same context) at every step — here on rows cut to the
    batch's longest (``starpo.seq_len_multiple``), so the cut loses no token the update scores."""
    from ragen_jax.training.trainer import train

    spec = small_config(tmp_path, total_steps=2, **{"rollout.context_mode": "full", "starpo.seq_len_multiple": 16,
                                                    "rollout.max_seq_len": 512,
                                                    "trainer.eval_every": 0, "trainer.save_every": 10})
    out = train(spec)
    assert out["summary"]["steps"] == 2.0
    events = read_events(tmp_path / "tensorboard")
    diffs = [v for _, v in events["actor/sampler_logprob_abs_diff_max"]]
    assert len(diffs) == 2 and max(diffs) < 1e-3, diffs
    for (_, width), (_, longest) in zip(events["train/update_seq_len"], events["train/sequence_length_max"]):
        assert longest <= width < spec.rollout.max_seq_len and width % 16 == 0, (width, longest)
    for key in ("actor/pg_loss", "actor/grad_norm", "collapse_trajectory_sample/computed"):
        assert all(math.isfinite(v) for _, v in events[key]), key


def test_nonfinite_gradients_are_reported_on_the_console(capsys):
    from ragen_jax.training.trainer import _warn_about_step

    spec = small_config("unused", total_steps=1)
    quiet = {"train/nonfinite_grad_skipped": 0.0, "train/nonfinite_grad_skipped_total": 0.0, "train/truncated": 0.0}
    _warn_about_step(spec, 7, quiet, {}, None)
    assert capsys.readouterr().out == ""
    _warn_about_step(spec, 8, {**quiet, "train/nonfinite_grad_skipped": 2.0,
                               "train/nonfinite_grad_skipped_total": 5.0}, {}, None)
    out = capsys.readouterr().out
    assert "step 8: 2 optimizer step(s) skipped for a non-finite gradient (5 in this run)" in out


def test_max_seq_len_that_cuts_episodes_is_logged_and_warned(tmp_path, capsys):
    """A transcript budget just above one turn: every episode still running after turn 1 is cut
    (an untrained model solves none in one turn), logged as train/truncated = 1 and warned once."""
    from ragen_jax.training.trainer import train

    spec = small_config(tmp_path, total_steps=2, **{"rollout.max_seq_len": 336, "trainer.eval_every": 0,
                                                    "trainer.eval_before_train": False, "warmup.steps": 0,
                                                    "warmup.single_turn_steps": 0})
    train(spec)
    out = capsys.readouterr().out
    assert out.count("of the episodes were cut short") == 1, out
    assert "rollout.max_seq_len=336" in out
    events = read_events(tmp_path / "tensorboard")
    assert [v for _, v in events["train/truncated"]] == [1.0, 1.0]
    assert all(v == 1.0 for _, v in events["train/num_turns"])


def test_early_stop_reads_the_update_steps_empty_counter():
    """One empty-filter counter: the update step's. Hand-worked: baseline of 2 non-empty steps
    (std 1.0, 1.0), collapse after 2 consecutive later steps below 0.1 × 1.0; empty steps neither
    extend the baseline nor break the run of low steps."""
    from ragen_jax.training.metrics import EarlyStop

    early = EarlyStop(baseline_steps=2, window=2, ratio=0.1)
    seen = []
    for consecutive_empty, std in ((0, 1.0), (1, 0.0), (0, 1.0), (0, 0.05), (2, 0.0), (0, 0.05)):
        m = early.update(consecutive_empty=consecutive_empty, reward_std=std, episode_return=0.0, mi=None)
        seen.append((float(early.consecutive_empty), m["early_stop/reward_variance_collapse"]))
    assert early.rv_history == [1.0, 1.0, 0.05, 0.05]
    assert seen == [(0.0, 0.0), (1.0, 0.0), (0.0, 0.0), (0.0, 0.0), (2.0, 0.0), (0.0, 1.0)]


def test_ratio_is_scored_at_the_sampling_temperature(tmp_path):
    """A rollout at temperature 0.7: the update rescores its tokens under softmax(logits / 0.7), so
    the sampler's log-probs and the recomputed ones agree (an on-policy ratio); at the old
    temperature 1 they would not."""
    from ragen_jax.training.trainer import train

    # Every group kept: the update's single pass measures the agreement on the rows it trains on, and
    # this untrained model's groups all score alike (the SNR filter would drop them all).
    keep = {"filter.value": 1.0, "filter.include_zero": True}
    spec = small_config(tmp_path / "t07", total_steps=1, **{"rollout.temperature": 0.7, "warmup.steps": 0,
                                                             "warmup.single_turn_steps": 0, **keep})
    assert spec.starpo.logprob_temperature == 0.7
    train(spec)
    diff = read_scalars(tmp_path / "t07" / "tensorboard")["actor/sampler_logprob_abs_diff_max"][-1][1]
    assert diff < 1e-4, diff
    off = small_config(tmp_path / "t1", total_steps=1, **{"rollout.temperature": 0.7, "starpo.logprob_temperature": 1.0,
                                                           "warmup.steps": 0, "warmup.single_turn_steps": 0, **keep})
    with pytest.warns(UserWarning, match="off-policy: starpo.logprob_temperature=1.0 differs"):
        small_config(tmp_path / "t1b", total_steps=1, **{"rollout.temperature": 0.7, "starpo.logprob_temperature": 1.0})
    train(off)
    assert read_scalars(tmp_path / "t1" / "tensorboard")["actor/sampler_logprob_abs_diff_max"][-1][1] > 1e-2


def test_truncated_sampling_warns_that_the_ratio_is_off_policy(tmp_path):
    with pytest.warns(UserWarning, match=r"rollout.top_p=0.9 / rollout.top_k=0 truncate"):
        small_config(tmp_path, total_steps=1, **{"rollout.top_p": 0.9})
