"""The tool task's expert and the behaviour-cloning warm-up on a Python (host) environment."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("bm25s")


def _questions(split):
    """The shipped questions of ``split``, read straight from the data file (the reference)."""
    from pathlib import Path

    import environments

    with open(Path(environments.__file__).parent / "data" / "search_questions.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["split"] == split]


@pytest.mark.parametrize("split", ["train", "test"])
def test_the_search_expert_answers_every_question_from_what_its_searches_returned(split):
    """On every shipped question the expert ends with finish[the ground truth], only after a tool output
    stated it, within the budget: one search for a one-hop question, two for a two-hop (river) one,
    the second for the town the first result names."""
    from ragen_jax.rollout.host_env import HostEnv
    from ragen_jax.tools.env import ToolSearchQA

    def make():
        return ToolSearchQA(top_k=2, max_result_chars=600, max_turns=3, max_tool_calls=2, split=split)

    host = HostEnv.__new__(HostEnv)  # only the expert's side: no tokenizer, no batch
    host.make_env, host._expert_env = make, None
    questions = _questions(split)
    check = make()
    for seed, row in enumerate(questions):
        turns, success = host.expert_episode(seed, max_turns=3, max_answers_per_turn=1, max_answers=3)
        assert success, (seed, row, turns)
        *searches, (reasoning, [final]) = turns
        assert final == f"finish[{row['ground_truth'][0]}]"
        assert len(searches) == (2 if row["question"].startswith("On which river") else 1)
        # Replay the calls on a fresh env: the answer is in the last tool output, not before it.
        assert check.reset(seed) == f"Question: {row['question']}"
        outputs = [check.step(answers[0])[0] for _, answers in searches]
        states = re.compile(rf"\b{row['ground_truth'][0]}\b").search  # a whole word ("Brenna" is in "Brennan")
        assert states(outputs[-1]) and not any(states(o) for o in outputs[:-1])
        first_query = json.loads(re.search(r"<tool_call>(.*)</tool_call>", searches[0][1][0]).group(1))
        assert first_query == {"name": "search", "arguments": {"query": row["question"]}}
        if len(searches) == 2:  # the bridge: a town the first output names and the question does not
            town = json.loads(re.search(r"<tool_call>(.*)</tool_call>", searches[1][1][0]).group(1))
            town = town["arguments"]["query"]
            assert town in outputs[0] and town not in row["question"]
        assert check.step(final)[1] == 1.0


def test_the_warmup_imitates_the_tool_expert_through_the_rollout():
    """The tool task's demonstrations come out of the rollout itself: each row's trained tokens are the
    expert's replies (calls and final answer), the tool outputs are environment text around them, and
    every episode earns the exact-match reward. Then a few BC steps lower the loss. Seeded (config.seed,
    warmup.seed): deterministic."""
    import jax

    from configs import search_tools
    from ragen_jax.config import resolve
    from ragen_jax.rollout import codec as codec_lib
    from ragen_jax.starpo.train_state import policy_params
    from ragen_jax.training.run import setup
    from ragen_jax.training.warmup import expert_replies, run_warmup

    c = search_tools.get_config()
    c.rollout.update(dict(num_groups=2, group_size=2))
    c.warmup.steps = 6
    c.warmup.batch_size = 4
    c.warmup.lr = 3e-3
    c.warmup.log_every = 1
    run = setup(resolve(c))
    tok, params = run.tokenizer, policy_params(run.train_state)
    keys = jax.random.split(jax.random.key(3), 4)
    forced, planned, _ = expert_replies(run.rollout, keys, np.random.default_rng(0))
    assert planned.all()
    traj = run.rollout.run(params, keys, jax.random.key(4), forced)
    assert np.asarray(traj.success).all()
    np.testing.assert_allclose(np.asarray(traj.episode_return), 1.0, rtol=1e-6)  # exact match, no penalty
    assert np.asarray(traj.valid_action_rate).min() == 1.0
    for b in range(4):
        buf = np.asarray(traj.tokens[b])
        learned = codec_lib.decode(tok, buf[np.asarray(traj.loss_mask[b])]).replace(tok.eos_token, "")
        replies = [codec_lib.decode(tok, np.asarray(forced.tokens[b, t, : int(forced.lengths[b, t])]))
                   for t in range(int(traj.num_turns[b]))]
        assert learned == "".join(replies)
        assert '<tool_call>{"name": "search"' in learned and "finish[" in learned
        transcript = codec_lib.decode(tok, buf[np.asarray(traj.valid_mask[b])])
        assert transcript.count("<tool_response>") == int(traj.num_turns[b]) - 1
        assert "<tool_response>" not in learned
    losses = []
    run_warmup(run.warmup_rollout, params, c.warmup, log_fn=lambda step, m: losses.append(m["warmup/loss"])
               if "warmup/loss" in m else None, progress=False)
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_a_warmup_on_a_python_env_without_an_expert_is_a_config_error():
    from configs import search_qa
    from ragen_jax.config import ConfigError, resolve

    c = search_qa.get_config()
    c.warmup.steps = 10
    with pytest.raises(ConfigError, match="no expert solver.*tool_search"):
        resolve(c)
