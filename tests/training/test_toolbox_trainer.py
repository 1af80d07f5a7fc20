"""The credit-assignment toolbox through the whole trainer, from config keys: GiGPO with DAPO's
dynamic sampling and overlong shaping and RAGEN-2's gradient analysis; ReMax with its greedy
baseline and the overlong filter. The tests' small FrozenLake config, fixed seeds.
"""
import math

import pytest

from ragen_jax.config import ConfigError
from ragen_jax.training.event_log import read_scalars
from tests.training.test_trainer import small_config


def _scalars(workdir):
    return read_scalars(workdir / "tensorboard")


def test_gigpo_dynamic_sampling_and_gradient_analysis_from_config_keys(tmp_path):
    from ragen_jax.training.trainer import train

    train(small_config(tmp_path, total_steps=2, **{
        "starpo.adv_estimator": "gigpo", "starpo.gigpo_norm": "std", "filter.dynamic_sampling_rounds": 1,
        "trainer.gradient_analysis_every": 1, "trainer.gradient_analysis_num_buckets": 2,
        "starpo.overlong_buffer_len": 8}))
    s = _scalars(tmp_path)
    for key in ("critic/gigpo_anchor_group_size", "critic/gigpo_shared_turn_fraction",
                "rollout/dynamic_sampling_rounds", "rollout/informative_groups", "rollout/overlong_penalty_mean",
                "actor/pg_loss"):
        assert [step for step, _ in s[key]] == [1, 2], key
        assert all(math.isfinite(v) for _, v in s[key]), key
    # The gradient analysis ran at steps 1 and 2 (every step), before and after the filter.
    for prefix in ("grad_norm", "grad_norm_prefilter"):
        for bucket in ("q1", "q2", "all"):
            for name in ("task", "entropy", "per_sample/task", "per_token/entropy", "loss/task", "sample_count",
                         "reward_std_mean"):
                key = f"{prefix}/{bucket}/{name}"
                assert [step for step, _ in s[key]] == [1, 2], key
    assert all(v == 4.0 for _, v in s["grad_norm_prefilter/all/sample_count"])  # 2 groups x 2 episodes
    # Every overlong penalty is <= 0, and some reply of the untrained policy is long enough to pay.
    assert all(v <= 0 for _, v in s["rollout/overlong_penalty_mean"])


def test_remax_with_greedy_baseline_and_overlong_filter(tmp_path):
    from ragen_jax.training.trainer import train

    train(small_config(tmp_path, total_steps=1, **{
        "starpo.adv_estimator": "remax", "rollout.greedy_baseline": True, "starpo.overlong_filter": True,
        "warmup.single_turn_steps": 0, "warmup.steps": 0}))
    s = _scalars(tmp_path)
    assert math.isfinite(s["critic/remax_baseline_mean"][0][1])
    assert s["rollout/overlong_filtered_rows"][0][1] >= 0


def test_remax_without_the_greedy_baseline_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="greedy_baseline=True"):
        small_config(tmp_path, total_steps=1, **{"starpo.adv_estimator": "remax"})
