"""The gradient-analysis report on hand-written TensorBoard series (hand-worked tables)."""
import pytest

from ragen_jax.offline import gradient_report
from ragen_jax.training.event_log import Logger


def bucket(prefix, name, task, entropy, pct, std, count):
    p = f"{prefix}/{name}/"
    return {p + "task": task, p + "entropy": entropy, p + "sample_pct": pct, p + "sample_count": count,
            p + "per_sample/task": task / max(count, 1), p + "reward_std_mean": std,
            p + "reward_std_min": std, p + "reward_std_max": std}


@pytest.fixture
def run_dir(tmp_path):
    log = Logger(tmp_path / "tensorboard")
    # Step 1: two buckets, the high-spread one carries 3/4 of the summed task norms.
    log.scalars(1, {**bucket("grad_norm", "q1", 0.1, 1e-4, 0.5, 0.05, 8),
                    **bucket("grad_norm", "q2", 0.3, 2e-4, 0.5, 4.0, 8),
                    **bucket("grad_norm", "all", 0.25, 1e-4, 1.0, 2.0, 16),
                    **bucket("grad_norm_prefilter", "q1", 0.7, 1e-4, 0.5, 0.05, 8),
                    **bucket("grad_norm_prefilter", "q2", 0.7, 1e-4, 0.5, 4.0, 8),
                    **bucket("grad_norm_prefilter", "all", 1.0, 1e-4, 1.0, 2.0, 16),
                    "train/success": 0.5})
    log.scalars(2, {"train/success": 0.6})  # not analysed
    # Step 11: the low-spread bucket is empty (the filter dropped its groups).
    log.scalars(11, {**bucket("grad_norm", "q1", 0.0, 0.0, 0.0, 0.0, 0),
                     **bucket("grad_norm", "q2", 0.5, 4e-4, 1.0, 6.0, 16),
                     **bucket("grad_norm", "all", 0.5, 4e-4, 1.0, 6.0, 16)})
    log.close()
    return tmp_path


def rows(text, heading):
    """The table rows (bucket -> cells) under a heading."""
    part = text.split(heading, 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("bucket",):
            out[cells[0]] = cells
    return out


def test_tables_per_step_and_mean(run_dir):
    text = gradient_report.main([str(run_dir)])
    step1 = rows(text, "## Step 1\n")
    # bucket | std | episodes | task | task/episode | entropy | share
    assert step1["q1"] == ["q1", "0.05 (0.05–0.05)", "50%", "0.1", "0.0125", "0.0001", "25%"]
    assert step1["q2"][3:] == ["0.3", "0.0375", "0.0002", "75%"]
    assert step1["all"][-1] == ""  # no share for the whole batch
    step11 = rows(text, "## Step 11\n")
    assert step11["q1"] == ["q1", "—", "0%", "—", "—", "—", "—"]
    assert step11["q2"][-1] == "100%"
    assert "## Step 2\n" not in text  # a step without the analysis has no table
    mean = rows(text, "## Mean over the 2 analysed steps (1, 11)")
    # q1: measured at step 1 only (empty at 11): task 0.1; its episode share (50% + 0%) / 2.
    assert mean["q1"][2:4] == ["25%", "0.1"]
    # q2: task (0.3 + 0.5) / 2 = 0.4, std (4 + 6) / 2 = 5 ranging 4–6; share 0.4 / (0.1 + 0.4) = 80%.
    assert mean["q2"][1:4] == ["5 (4–6)", "75%", "0.4"]
    assert mean["q2"][-1] == "80%"


def test_prefilter_and_chosen_steps(run_dir):
    text = gradient_report.main([str(run_dir), "--prefilter", "--steps", "1"])
    assert "before the SNR filter" in text
    step1 = rows(text, "## Step 1\n")
    assert step1["q1"][3] == "0.7" and step1["q1"][-1] == "50%"
    assert "Mean over" not in text  # one step: no mean table
    with pytest.raises(SystemExit, match=r"steps \[5\] were not analysed; analysed steps: \[1\]"):
        gradient_report.main([str(run_dir), "--prefilter", "--steps", "5"])


def test_a_run_without_the_analysis_says_how_to_get_it(tmp_path):
    log = Logger(tmp_path / "tensorboard")
    log.scalars(1, {"train/success": 0.5})
    log.close()
    with pytest.raises(SystemExit, match="gradient_analysis_every"):
        gradient_report.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="no such run directory"):
        gradient_report.main([str(tmp_path / "missing")])
