"""EarlyStop: each signal fires when, and only when, its rule says (hand-worked sequences), and the
trainer stops on a signal only when its ``trainer.stop_on_*`` switch is on."""
from __future__ import annotations

import types

from ragen_jax.training.metrics import EarlyStop
from ragen_jax.config import TrainerConfig


def run(early, steps):
    """steps: (consecutive_empty, reward_std, episode_return, mi or None) -> the metrics per step."""
    return [early.update(consecutive_empty=e, reward_std=s, episode_return=r, mi=m) for e, s, r, m in steps]


def test_reward_variance_collapse_needs_window_consecutive_low_steps():
    # baseline 2 steps of std 1.0; threshold 0.1 × 1.0; window 3.
    fire = run(EarlyStop(baseline_steps=2, window=3, ratio=0.1), [(0, 1.0, 0, None)] * 2 + [(0, 0.05, 0, None)] * 3)
    assert [m["early_stop/reward_variance_collapse"] for m in fire] == [0, 0, 0, 0, 1]
    # One step at the threshold or above breaks the run (strictly below counts).
    broken = run(EarlyStop(baseline_steps=2, window=3, ratio=0.1),
                 [(0, 1.0, 0, None)] * 2 + [(0, 0.05, 0, None)] * 2 + [(0, 0.1, 0, None)] + [(0, 0.05, 0, None)] * 2)
    assert [m["early_stop/reward_variance_collapse"] for m in broken] == [0] * 7
    assert [m["early_stop/reward_variance_below_steps"] for m in broken] == [0, 0, 1, 2, 0, 1, 2]
    # Low values inside the baseline window never fire (the baseline is being measured).
    early = run(EarlyStop(baseline_steps=3, window=1, ratio=0.1), [(0, 0.0, 0, None)] * 3)
    assert [m["early_stop/reward_variance_collapse"] for m in early] == [0, 0, 0]


def test_mi_collapse_needs_window_consecutive_low_computations():
    def steps(mis, returns):
        return [(0, 1.0, r, m) for m, r in zip(mis, returns)]

    # Baseline MI 1.0 over 2 computations; threshold 0.7; window 2: fires at the 2nd low one, whatever
    # the reward does (a template collapse need not wait for the return to stop moving).
    for returns in ([0.5] * 5, [0.1, 0.2, 0.3, 0.4, 0.5], [0.5, 0.4, 0.3, 0.2, 0.1]):
        fired = run(EarlyStop(mi_ratio=0.7, mi_window=2, mi_baseline=2), steps([1.0, 1.0, 0.6, 0.6, 0.6], returns))
        assert [m["early_stop/mi_collapse"] for m in fired] == [0, 0, 0, 1, 1]
    # MI at or above the threshold never counts (strictly below); a computation back above it resets
    # the count; steps without a computation (None, NaN) are skipped, not counted as low.
    high = run(EarlyStop(mi_ratio=0.7, mi_window=2, mi_baseline=2),
               steps([1.0, 1.0, 0.7, 0.5, 0.9, 0.5, None, float("nan"), 0.8], [0.5] * 9))
    assert [m["early_stop/mi_collapse"] for m in high] == [0] * 9
    assert [m["early_stop/mi_below_steps"] for m in high] == [0, 0, 0, 1, 0, 1, 1, 1, 0]
    # The default threshold is 0.7 of the baseline: 0.69 counts, 0.71 does not.
    assert run(EarlyStop(mi_window=1, mi_baseline=1), steps([1.0, 0.69], [0, 0]))[-1]["early_stop/mi_collapse"] == 1
    assert run(EarlyStop(mi_window=1, mi_baseline=1), steps([1.0, 0.71], [0, 0]))[-1]["early_stop/mi_collapse"] == 0


def test_mi_collapse_with_the_plateau_condition_waits_for_the_return_to_stop_rising():
    def steps(mis, returns):
        return [(0, 1.0, r, m) for m, r in zip(mis, returns)]

    kw = dict(mi_ratio=0.5, mi_window=2, mi_baseline=2, mi_needs_plateau=True)
    flat = run(EarlyStop(**kw), steps([1.0, 1.0, 0.2, 0.2], [0.5] * 4))
    assert [m["early_stop/mi_collapse"] for m in flat] == [0, 0, 0, 1]
    # The same MI drop while the reward keeps climbing is not flagged.
    rising = run(EarlyStop(**kw), steps([1.0, 1.0, 0.2, 0.2], [0.1, 0.2, 0.3, 0.4]))
    assert [m["early_stop/mi_collapse"] for m in rising] == [0, 0, 0, 0]
    # MI computed every step, window 2: the plateau compares the last step's return with the one
    # before; from the first repeated 0.4 on the count runs.
    stalls = run(EarlyStop(**kw), steps([1.0, 1.0, 0.2, 0.2, 0.2, 0.2], [0.1, 0.2, 0.3, 0.4, 0.4, 0.4]))
    assert [m["early_stop/mi_below_steps"] for m in stalls] == [0, 0, 0, 0, 1, 2]


def test_state_round_trips_exactly():
    early = EarlyStop(baseline_steps=2, window=2, ratio=0.1, mi_window=2, mi_baseline=1)
    run(early, [(0, 1.0, 0.1, 1.0), (1, 0.0, 0.2, None), (0, 0.05, 0.2, 0.3)])
    again = EarlyStop.from_state_dict(early.state_dict())
    nxt = (0, 0.05, 0.2, 0.2)
    assert run(again, [nxt]) == run(early, [nxt])


def test_trainer_stops_only_when_the_switch_is_on():
    from ragen_jax.training.trainer import _early_stop_reason

    def spec(**switches):
        t = TrainerConfig(**{"stop_on_empty_filter": False, "stop_on_reward_collapse": False,
                             "stop_on_mi_collapse": False, **switches})
        return types.SimpleNamespace(trainer=t,
                                     filter=types.SimpleNamespace(empty_stop_steps=2))

    host = types.SimpleNamespace(early=types.SimpleNamespace(consecutive_empty=2))
    fired = {"early_stop/reward_variance_collapse": 1.0, "early_stop/mi_collapse": 1.0}
    assert _early_stop_reason(spec(), host, fired) is None
    assert "empty" in _early_stop_reason(spec(stop_on_empty_filter=True), host, fired)
    assert "reward" in _early_stop_reason(spec(stop_on_reward_collapse=True), host, fired).lower()
    assert "MI collapse (MI below 0.7 x its baseline for 3 computations)" == _early_stop_reason(
        spec(stop_on_mi_collapse=True), host, fired)
    assert "plateaus" in _early_stop_reason(spec(stop_on_mi_collapse=True, mi_collapse_needs_plateau=True), host, fired)
    host.early.consecutive_empty = 1
    quiet = {"early_stop/reward_variance_collapse": 0.0, "early_stop/mi_collapse": 0.0}
    assert _early_stop_reason(spec(stop_on_empty_filter=True, stop_on_reward_collapse=True, stop_on_mi_collapse=True),
                              host, quiet) is None


def test_a_computation_without_enough_parseable_reasonings_is_no_mi_reading():
    """A policy whose replies stopped parsing leaves the MI proxy fewer than two prompts: the update
    reports zeros with ``collapse_first_turn_sample/computed`` 0. The loop must neither count that
    as an MI of 0 (a false collapse alert), nor plot it in the quadrant, nor log the zeros."""
    from ragen_jax.training.trainer import HostState, _drop_uncomputed, _log_step, _track

    def metrics(mi, ran=True, parsed=True):
        m = {"rollout/consecutive_empty_after_filter_steps": 0.0, "train/in_group_reward_std": 1.0,
             "train/return": 0.5, "train/success": 0.5, "timing_s/rollout": 1.0, "timing_s/update": 1.0,
             "collapse/computed": float(ran), "collapse/first_turn_valid_rate": 1.0 if parsed else 0.0}
        ok = ran and parsed
        for sample in ("collapse_first_turn_sample/", "collapse_trajectory_sample/"):
            m.update({sample + "computed": float(ok), sample + "num_samples": 8.0 if ok else 0.0,
                      sample + "num_prompts": 4.0 if ok else 0.0, sample + "mi_estimate": mi if ok else 0.0,
                      sample + "conditional_entropy_est": 0.1 if ok else 0.0})
        return m

    class Recorder:
        def __init__(self):
            self.images = []

        def scalars(self, step, values):
            pass

        def image(self, step, tag, img):
            self.images.append((step, tag))

    spec = types.SimpleNamespace(trainer=TrainerConfig(transcript_every=0),
                                 collapse=types.SimpleNamespace(baseline_steps=2, regime_mi_ratio=0.5,
                                                                regime_entropy_ratio=0.5))
    host = HostState(EarlyStop(mi_ratio=0.7, mi_window=2, mi_baseline=2), {"train": [], "quadrant": []}, {})
    logger = Recorder()
    # Baseline 1.0 over two readings, then three computations without a parseable reply, then one low
    # reading: one low computation, not four.
    sequence = [metrics(1.0), metrics(1.0), metrics(0.0, parsed=False), metrics(0.0, ran=False),
                metrics(0.0, parsed=False), metrics(0.0, parsed=False), metrics(0.5)]
    for step, m in enumerate(sequence, 1):
        _track(spec, host, step, m)
        _log_step(types.SimpleNamespace(spec=spec, host=host, logger=logger, run=None), step, m, None)
    assert [m["early_stop/mi_below_steps"] for m in sequence] == [0, 0, 0, 0, 0, 0, 1]
    assert [m["early_stop/mi_collapse"] for m in sequence] == [0] * 7
    assert [q[0] for q in host.history["quadrant"]] == [1, 2, 7]
    assert logger.images == [(1, "collapse/quadrant"), (2, "collapse/quadrant"), (7, "collapse/quadrant")]
    # Logged: the readings; for the unparseable computation only its flag and counts (zeros that
    # explain the gap); nothing of the sample on a step that did not run it.
    unparsed, skipped, reading = (_drop_uncomputed(sequence[i]) for i in (2, 3, 6))
    assert reading["collapse_first_turn_sample/mi_estimate"] == 0.5
    assert "collapse_first_turn_sample/mi_estimate" not in unparsed
    assert unparsed["collapse_first_turn_sample/computed"] == 0.0
    assert unparsed["collapse_trajectory_sample/num_prompts"] == 0.0
    assert not any(k.startswith("collapse_first_turn_sample/") for k in skipped)
    assert "collapse/first_turn_valid_rate" in skipped  # the cheap counters are logged every step
