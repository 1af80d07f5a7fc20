"""Behaviour-cloning warm-up: expert conversations come from the rollout itself; the BC loss is exact.

Fixed seeds throughout (env keys, model init), so the expected numbers are reproducible.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import environments
from ragen_jax.rollout import codec as codec_lib
from ragen_jax.config import RolloutConfig
from ragen_jax.rollout.carry import ForcedReplies
from ragen_jax.rollout.loop import make_rollout
from ragen_jax.models.presets import load_tiny_tokenizer, tiny_model_config
from ragen_jax.training import warmup as warmup_lib
from environments.frozen_lake.expert import frozen_lake_reasoning
from ragen_jax.training.warmup import bc_loss, expert_replies, reply_text
from ragen_jax.models import Decoder
from ml_collections import ConfigDict

TINY = ConfigDict(dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=16, rope_theta=10000.0, init_seed=0))


@pytest.fixture(scope="module")
def setup():
    tok = load_tiny_tokenizer()
    model = Decoder(tiny_model_config(tok, TINY), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    env = environments.make("frozen_lake", size=4)
    ep = env.default_params(p=0.8, success_rate=1.0)
    cfg = RolloutConfig(num_groups=4, group_size=1, max_turns=3, max_actions_per_traj=6, max_new_tokens=40,
                        max_seq_len=512)
    return tok, graphdef, params, make_rollout(graphdef, env, ep, tok, cfg), env, ep


def _bfs_len(holes, start, goal):
    """Independent shortest-path length (NumPy BFS over the 4-neighbour grid avoiding holes)."""
    n = holes.shape[0]
    dist = {tuple(start): 0}
    frontier = [tuple(start)]
    while frontier:
        nxt = []
        for r, c in frontier:
            for dr, dc in ((0, -1), (1, 0), (0, 1), (-1, 0)):
                q = (r + dr, c + dc)
                if 0 <= q[0] < n and 0 <= q[1] < n and not holes[q] and q not in dist:
                    dist[q] = dist[(r, c)] + 1
                    nxt.append(q)
        frontier = nxt
    return dist.get(tuple(goal))


def test_expert_conversations_through_the_rollout(setup):
    tok, graphdef, params, rollout, env, ep = setup
    keys = jax.random.split(jax.random.key(7), 4)
    forced, planned, _ = expert_replies(rollout, keys, np.random.default_rng(0))
    traj = rollout.run(params, keys, jax.random.key(8), forced)
    _, states = jax.vmap(env.reset, in_axes=(0, None))(keys, ep)
    for b in range(4):
        holes, start, goal = (np.asarray(x[b]) for x in (states.holes, states.pos, states.goal))
        shortest = _bfs_len(holes, start, goal)
        # The expert reaches the goal exactly when the optimal path fits the action budget (6).
        assert bool(traj.success[b]) == (shortest is not None and shortest <= 6) == bool(planned[b])
        if traj.success[b]:
            assert int(traj.num_actions[b]) == shortest
        # The trained tokens are exactly the expert replies, and the transcript frames them as the
        # rollout does (chat template, forced "<think>" before each reply).
        sampled = codec_lib.decode(tok, np.asarray(traj.tokens[b])[np.asarray(traj.loss_mask[b])])
        replies = [codec_lib.decode(tok, np.asarray(forced.tokens[b, t, : int(forced.lengths[b, t])]))
                   for t in range(int(traj.num_turns[b]))]
        assert sampled == "".join(replies)
        text = codec_lib.decode(tok, np.asarray(traj.tokens[b])[np.asarray(traj.valid_mask[b])])
        first = f"The player is at ({start[0]}, {start[1]}) and the goal at ({goal[0]}, {goal[1]})"
        assert "<|im_start|>assistant\n<think>" + first in text
        assert re.search(r"</think><answer>(Left|Down|Right|Up)( \|\| (Left|Down|Right|Up))?</answer>", text)


def test_reasoning_mentions_the_avoided_hole():
    holes = np.zeros((4, 4), bool)
    holes[1, 2] = True
    text = frozen_lake_reasoning((1, 3), (2, 0), holes, "Down")
    assert text == "The player is at (1, 3) and the goal at (2, 0); moving Down avoids the hole at (1, 2)."
    assert reply_text(text, ["Down", "Left"], True) == text + "</think><answer>Down || Left</answer>"


def test_bc_loss_matches_numpy(setup):
    tok, graphdef, params, rollout, env, ep = setup
    rng = np.random.default_rng(3)
    B, L = 3, 24
    tokens = jnp.asarray(rng.integers(0, len(tok), (B, L)), jnp.int32)
    valid = jnp.asarray(np.arange(L)[None] < np.array([[24], [20], [12]]))
    loss_mask = jnp.asarray(rng.random((B, L)) < 0.5) & valid
    loss, acc = bc_loss(graphdef, params, tokens, loss_mask, valid)
    # NumPy re-derivation from the model's logits: log-softmax at t-1 scores token t.
    model = nnx.merge(graphdef, params)
    logits = np.asarray(model(tokens, jnp.broadcast_to(jnp.arange(L), (B, L)))[0], np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    logp = logits - lse[..., None]
    t = np.asarray(tokens)
    m = np.asarray(loss_mask)[:, 1:]
    picked = np.take_along_axis(logp[:, :-1], t[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(float(loss), -(picked * m).sum() / m.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(acc), ((logp[:, :-1].argmax(-1) == t[:, 1:]) * m).sum() / m.sum(), rtol=1e-6)


def test_shared_prefix_bc_loss_equals_full_pass(setup):
    """Running the common system prompt once per batch changes the cost, not the loss or gradient."""
    tok, graphdef, params, rollout, env, ep = setup
    rng = np.random.default_rng(4)
    B, L, P = 3, 30, 11
    tokens = rng.integers(0, len(tok), (B, L))
    tokens[:, :P] = tokens[0, :P]
    tokens = jnp.asarray(tokens, jnp.int32)
    valid = jnp.asarray(np.arange(L)[None] < np.array([[30], [25], [18]]))
    loss_mask = jnp.asarray((rng.random((B, L)) < 0.5) & (np.arange(L)[None] > P)) & valid
    assert warmup_lib.shared_prefix_length(np.asarray(tokens), np.asarray(loss_mask)) == P

    def grad(prefix):
        return jax.value_and_grad(lambda p: bc_loss(graphdef, p, tokens, loss_mask, valid, prefix), has_aux=True)(params)

    (full, full_acc), g_full = grad(0)
    (shared, shared_acc), g_shared = grad(P)
    np.testing.assert_allclose(float(shared), float(full), rtol=1e-5)
    assert float(shared_acc) == float(full_acc)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_shared)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_shared_prefix_length_stops_before_the_first_trained_token():
    tokens = np.array([[5, 6, 7, 8, 9, 1], [5, 6, 7, 8, 2, 3]])
    none = np.zeros_like(tokens, bool)
    assert warmup_lib.shared_prefix_length(tokens, none) == 4  # rows first differ at column 4
    mask = none.copy()
    mask[1, 3] = True  # token 3 is predicted from position 2: the prefix must end at 2
    assert warmup_lib.shared_prefix_length(tokens, mask) == 2
    assert warmup_lib.shared_prefix_length(tokens[:1], none[:1]) == 4  # one row: all but one prediction
    mask[0, 0] = True
    assert warmup_lib.shared_prefix_length(tokens, mask) == 0


def test_main_job_conversations_fit_every_solvable_start():
    """The main job's rollout (configs/frozen_lake.py) has room for all ``max_turns`` turns.

    Start states whose shortest path (independent BFS) needs 5 or 6 moves take three turns of two
    actions; if ``max_seq_len`` cannot hold the third turn the episode is cut at that boundary and
    the puzzle is unsolvable by construction, whatever the policy.
    """
    import dataclasses

    from configs import frozen_lake
    from ragen_jax.training.build import build_env
    from ragen_jax.config import resolve

    spec = resolve(frozen_lake.get_config())
    env, ep = build_env(spec)
    # Long-path start states: scan fixed keys on the host with the independent BFS.
    cand = jax.random.split(jax.random.key(11), 256)
    _, states = jax.vmap(env.reset, in_axes=(0, None))(cand, ep)
    holes, pos, goal = (np.asarray(x) for x in (states.holes, states.pos, states.goal))
    budget = spec.rollout.max_actions_per_traj
    lengths = [_bfs_len(holes[i], pos[i], goal[i]) for i in range(len(cand))]
    long = [i for i, n in enumerate(lengths) if n is not None and budget - 1 <= n <= budget][:4]
    assert len(long) == 4
    keys = cand[np.asarray(long)]

    tok = load_tiny_tokenizer()
    graphdef, params = nnx.split(Decoder(tiny_model_config(tok, TINY), rngs=nnx.Rngs(0)))
    rollout = make_rollout(graphdef, env, ep, tok, dataclasses.replace(spec.rollout, num_groups=4, group_size=1))
    forced, planned, _ = expert_replies(rollout, keys, np.random.default_rng(0))
    traj = rollout.run(params, keys, jax.random.key(8), forced)
    assert planned.all()
    assert not np.asarray(traj.truncated).any()
    np.testing.assert_array_equal(np.asarray(traj.num_turns), spec.rollout.max_turns)
    assert np.asarray(traj.success).all()
    np.testing.assert_array_equal(np.asarray(traj.num_actions), [lengths[i] for i in long])


def test_single_turn_phase_trains_on_first_turns_then_conversations(setup, monkeypatch):
    """Phase 1 imitates first-turn conversations, phase 2 whole ones; one schedule over both.

    The first-turn transcripts must be exactly the first turn of the full expert conversation
    from the same start state (same framing, observation and reply), so the cheap phase teaches
    what the rollout will ask.
    """
    import dataclasses

    tok, graphdef, params, rollout, env, ep = setup
    one_turn = make_rollout(graphdef, env, ep, tok, dataclasses.replace(rollout.config, max_turns=1))
    keys = jax.random.split(jax.random.key(5), 4)
    forced, _, _ = expert_replies(rollout, keys, np.random.default_rng(0))
    full = rollout.run(params, keys, jax.random.key(8), forced)
    first = one_turn.run(params, keys, jax.random.key(8),
                         ForcedReplies(tokens=forced.tokens[:, :1], lengths=forced.lengths[:, :1]))
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    for b in range(4):
        short = np.asarray(first.tokens[b])[np.asarray(first.valid_mask[b])]
        long = np.asarray(full.tokens[b])[np.asarray(full.valid_mask[b])]
        # Up to and including the first reply's end-of-turn token the two transcripts agree.
        end = int(np.flatnonzero(short == eot)[-1]) + 1
        np.testing.assert_array_equal(short[:end], long[:end])
        assert np.asarray(first.loss_mask[b]).sum() == int(forced.lengths[b, 0])  # the reply is what is trained
        assert int(first.num_turns[b]) == 1

    # The phases run in order with the batches their rollouts produce: record every BC batch.
    seen = []
    real_step = warmup_lib.make_bc_step

    def spy(graphdef_, tx, prefix_len=0):
        step = real_step(graphdef_, tx, prefix_len)

        def wrapped(p, o, tokens, loss_mask, valid_mask):
            seen.append(tokens.shape[1])
            return step(p, o, tokens, loss_mask, valid_mask)
        return wrapped

    monkeypatch.setattr(warmup_lib, "make_bc_step", spy)
    cfg = ConfigDict(dict(steps=2, single_turn_steps=3, batch_size=2, lr=1e-3, num_states=4, action_noise=0.0,
                          seed=1, log_every=1))
    new_params, summary = warmup_lib.run_warmup(rollout, params, cfg, progress=False)
    assert len(seen) == 5
    # Batches are trimmed to their phase's longest transcript: one turn, then whole conversations
    # (these start states need several turns).
    assert len(set(seen[:3])) == 1 and len(set(seen[3:])) == 1 and seen[0] < seen[3]
    assert summary["warmup/single_turn_demonstrations"] == 4.0
    assert summary["warmup/conversation_demonstrations"] == 4.0
    assert np.isfinite(summary["warmup/final_loss"])
    changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), params, new_params)
    assert all(jax.tree.leaves(changed))


def test_bfloat16_weights_train_with_float32_adam_moments(setup):
    """With bfloat16 weights the warm-up's AdamW keeps float32 moments (``in_float32``): a bfloat16
    second moment underflowed to 0 and made the first update inf (the final loss was NaN). The first
    step moves every weight by about lr (Adam's first update is lr * g / (|g| + eps)), rounded to bfloat16."""
    tok, graphdef, params, rollout, env, ep = setup
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    cfg = ConfigDict(dict(steps=0, single_turn_steps=1, batch_size=2, lr=1e-3, num_states=4, action_noise=0.0,
                          seed=1, log_every=1))
    one, summary = warmup_lib.run_warmup(rollout, params16, cfg, progress=False)
    assert np.isfinite(summary["warmup/final_loss"])
    moved = 0
    for before, after in zip(jax.tree.leaves(params16), jax.tree.leaves(one)):
        assert after.dtype == jnp.bfloat16
        step = np.abs(np.asarray(after, np.float32) - np.asarray(before, np.float32))
        assert np.all(np.isfinite(step))
        # lr = 1e-3 (the schedule's first step may be lower, never higher), plus the rounding of the
        # result to bfloat16 (at most one spacing, 2^-7 of the larger magnitude).
        scale = np.maximum(np.abs(np.asarray(before, np.float32)), np.abs(np.asarray(after, np.float32)))
        assert np.all(step <= 1e-3 + scale * 2 ** -7 + 1e-6)
        moved += int(np.count_nonzero(step))
    assert moved > 0
    cfg = ConfigDict(dict(cfg, single_turn_steps=4))
    _, summary = warmup_lib.run_warmup(rollout, params16, cfg, progress=False)
    assert np.isfinite(summary["warmup/final_loss"])


def test_described_tokens_cover_the_state_coordinates(setup):
    """``described`` counts the reply tokens that restate the board: all four coordinates, not the decision."""
    tok, graphdef, params, rollout, env, ep = setup
    keys = jax.random.split(jax.random.key(5), 4)
    forced, _, described = expert_replies(rollout, keys, np.random.default_rng(0))
    _, states = jax.vmap(env.reset, in_axes=(0, None))(keys, ep)
    for b in range(4):
        ids = np.asarray(forced.tokens[b, 0, : int(described[b, 0])]).tolist()
        text = tok.decode(ids)
        (pr, pc), (gr, gc) = np.asarray(states.pos[b]), np.asarray(states.goal[b])
        # Independent spelling of the state sentence, up to the goal's column digit.
        assert text.startswith(f"The player is at ({pr}, {pc}) and the goal at ({gr}, {gc}"), text
        assert "moving" not in text and ";" not in text


def test_reading_check_matches_a_greedy_re_derivation(setup):
    """Rows whose description tokens are the model's own greedy continuation count as read; a
    row with one description token changed does not. The reference is the plain full forward pass."""
    tok, graphdef, params, rollout, env, ep = setup
    one_turn = warmup_lib.first_turn_rollout(rollout)
    keys = jax.random.split(jax.random.key(9), 4)
    forced, _, described = expert_replies(one_turn, keys, np.random.default_rng(0))
    traj = one_turn.run(params, keys, jax.random.key(1), forced)
    tokens = np.array(traj.tokens)
    mask = np.asarray(traj.loss_mask & traj.valid_mask)
    d = np.asarray(described[:, 0])
    model = nnx.merge(graphdef, params)
    L = tokens.shape[1]

    def greedy(row, j):  # argmax prediction for position j from tokens[row, :j] (full pass, causal)
        logits = model(jnp.asarray(tokens[row:row + 1]), jnp.arange(L)[None])[0]
        return int(np.asarray(logits)[0, j - 1].argmax())

    start = mask.argmax(1)
    for row in (0, 2, 3):  # rows 0 and 2 become "read correctly"; row 3 all but its last token
        for j in range(start[row], start[row] + d[row]):
            tokens[row, j] = greedy(row, j)
    last = start[3] + d[3] - 1
    tokens[3, last] = (greedy(3, last) + 1) % len(tok)
    check = warmup_lib.make_reading_check(graphdef, tokens, mask, d, chunk=3)  # 4 rows: a padded chunk
    assert check(params) == 0.5
    prefix = warmup_lib.shared_prefix_length(tokens, mask)
    assert prefix > 0
    assert warmup_lib.make_reading_check(graphdef, tokens, mask, d, prefix)(params) == 0.5


def test_first_turn_phase_ends_when_the_board_is_read(setup, monkeypatch):
    """With ``reading_target`` the first-turn phase stops at the first check that reaches it; the
    learning rate warms up, stays constant through phase 1 and decays over phase 2 (hand formula)."""
    tok, graphdef, params, rollout, env, ep = setup
    readings = iter([0.3, 0.95, 1.0])
    monkeypatch.setattr(warmup_lib, "make_reading_check", lambda *a, **k: (lambda p: next(readings)))
    lrs, widths = [], []
    real_step = warmup_lib.make_bc_step

    def spy(graphdef_, tx, prefix_len=0):
        step = real_step(graphdef_, tx, prefix_len)

        def wrapped(p, o, tokens, loss_mask, valid_mask):
            lrs.append(float(o[1].hyperparams["learning_rate"]))
            widths.append(tokens.shape[1])
            return step(p, o, tokens, loss_mask, valid_mask)
        return wrapped

    monkeypatch.setattr(warmup_lib, "make_bc_step", spy)
    cfg = ConfigDict(dict(steps=4, single_turn_steps=36, batch_size=2, lr=1e-2, num_states=4, action_noise=0.0,
                          seed=1, log_every=1, reading_target=0.9, check_every=2, heldout_states=4))
    _, summary = warmup_lib.run_warmup(rollout, params, cfg, progress=False)
    # Checks after steps 2 (0.3) and 4 (0.95 >= 0.9): phase 1 ran 4 of its 36 steps, then 4 conversation steps.
    assert summary["warmup/single_turn_steps"] == 4.0 and summary["warmup/conversation_steps"] == 4.0
    assert summary["warmup/reading_accuracy"] == 0.95
    assert len(widths) == 8 and widths[3] < widths[4]
    warm = (36 + 4) // 20  # 2 warm-up steps
    expected = [1e-2 * 1 / warm, 1e-2, 1e-2, 1e-2] + [1e-2 * (0.1 + 0.45 * (1 + np.cos(np.pi * k / 4))) for k in range(4)]
    np.testing.assert_allclose(lrs, expected, rtol=1e-6)


def test_first_phase_only_keeps_the_whole_warmups_learning_rate(setup, monkeypatch):
    """``first_phase_only`` (tools/reading_plateau.py) runs phase 1 alone, with the schedule it has in
    the whole warm-up: the ramp counts phase 2's steps and the rate does not decay (hand formula)."""
    tok, graphdef, params, rollout, env, ep = setup
    readings = iter([0.3, 0.5, 0.95])
    monkeypatch.setattr(warmup_lib, "make_reading_check", lambda *a, **k: (lambda p: next(readings)))
    lrs = []
    real_step = warmup_lib.make_bc_step

    def spy(graphdef_, tx, prefix_len=0):
        step = real_step(graphdef_, tx, prefix_len)

        def wrapped(p, o, tokens, loss_mask, valid_mask):
            lrs.append(float(o[1].hyperparams["learning_rate"]))
            return step(p, o, tokens, loss_mask, valid_mask)
        return wrapped

    monkeypatch.setattr(warmup_lib, "make_bc_step", spy)
    cfg = ConfigDict(dict(steps=60, single_turn_steps=20, batch_size=2, lr=1e-2, num_states=4, action_noise=0.0,
                          seed=1, log_every=1, reading_target=0.9, check_every=2, heldout_states=4))
    _, summary = warmup_lib.run_warmup(rollout, params, cfg, progress=False, first_phase_only=True)
    assert summary["warmup/single_turn_steps"] == 6.0 and "warmup/conversation_steps" not in summary
    warm = (20 + 60) // 20  # 4 ramp steps, as in the whole warm-up; then constant (phase 2 would decay)
    np.testing.assert_allclose(lrs, [1e-2 * k / warm for k in (1, 2, 3)] + [1e-2] * 3, rtol=1e-6)


def test_limited_context_warmup_trains_each_turn_on_its_window(setup):
    """With ``context_window=1`` the behaviour-cloning rows are the turns as the policy will see
    them: the system preamble, that turn's user message and the expert's reply — one row per turn
    that happened, re-derived here from the decoded whole-conversation transcript."""
    import dataclasses

    tok, graphdef, params, rollout, env, ep = setup
    limited = make_rollout(graphdef, env, ep, tok, dataclasses.replace(rollout.config, context_mode="limited",
                                                                       context_window=1))
    demos = warmup_lib.demonstrations(limited, params, 8, seed=3)
    (tokens, loss_mask, valid_mask), success, n = warmup_lib.bc_data(demos, limited.per_turn_rows)
    assert n == sum(int(np.sum(d.num_turns)) for d in demos) > 8  # several turns per episode
    assert tokens.shape[1] <= limited.cache_len < limited.config.max_seq_len
    close = "<|im_end|>\n<|im_start|>user\n"
    preamble = codec_lib.decode(tok, np.asarray(limited.codec.preamble_ids))
    expected = []
    for d in demos:
        for b in range(d.batch_size):
            text = codec_lib.decode(tok, np.asarray(d.tokens[b])[np.asarray(d.valid_mask[b])])
            assert text.startswith(preamble)
            turns = text[len(preamble):].removesuffix("<|im_end|>\n").split(close)
            assert len(turns) == int(d.num_turns[b])
            expected += [(preamble + turn, turn.split("<|im_start|>assistant\n<think>")[1]) for turn in turns]
    for i, (row_text, reply) in enumerate(expected):
        row = np.asarray(tokens[i])[np.asarray(valid_mask[i])]
        assert codec_lib.decode(tok, row) == row_text
        assert codec_lib.decode(tok, np.asarray(tokens[i])[np.asarray(loss_mask[i])]) == reply
    assert success == pytest.approx(float(np.mean(np.concatenate([np.asarray(d.success) for d in demos]))))


@pytest.mark.parametrize("warm, decay_start, decay_steps", [(180, 1800, 600), (180, 3000, 600), (50, 10, 30),
                                                             (1, 0, 2), (5, 5, 0)])
def test_warmup_learning_rate_schedule_matches_the_formula(warm, decay_start, decay_steps):
    """The optax schedule gives, bit for bit in float32, the formula the warm-up was tuned with:
    linear rise to the peak over ``warm`` steps, constant, cosine to 10% over ``decay_steps``."""
    from ragen_jax.training.warmup import _phase_lr

    peak = 3e-3
    lr = _phase_lr(peak, warm, decay_start, decay_steps)
    for i in range(decay_start + decay_steps + warm + 3):
        if i < warm:
            want = peak * (i + 1) / warm
        elif i < decay_start:
            want = peak
        else:
            frac = min(1.0, (i - decay_start) / max(decay_steps, 1))
            want = peak * (0.1 + 0.9 * 0.5 * (1.0 + np.cos(np.pi * frac)))
        assert lr(i) == np.float32(want), (i, lr(i), want)


def test_bandit_expert_pulls_the_high_risk_arm_and_noise_picks_a_shown_one():
    from environments.bandit import env as bandit

    env = bandit.Bandit()
    ep = env.default_params()
    rng = np.random.default_rng(0)
    for seed in range(12):
        _, state = env.reset(jax.random.key(seed), ep)
        state = jax.tree.map(np.asarray, state)
        lo, hi = bandit.ARM_PAIRS["train"][int(state.pair)]  # (low-risk, high-risk)
        first, second = (hi, lo) if bool(state.hi_first) else (lo, hi)
        plan = env.expert(state, ep)
        assert plan.answers == [hi]
        assert plan.reasoning([lo]) == f"The arms are {first} and {second}; I pull {lo}."
        # Noise (warmup.action_noise) answers one of the two arms on the prompt, never another name.
        picks = {env.random_answer(state, rng) for _ in range(40)}
        assert picks == {lo, hi}
        _, _, reward, term, _, info = env.step_env(jax.random.key(1), state, env.answer_action(hi), ep)
        assert bool(term) and bool(info["success"])


def test_before_move_reasoning_names_every_adjacent_hole_before_the_move():
    # Hand-worked: player (1, 1) with holes left (1, 0) and below (2, 1), one far hole (3, 3).
    holes = np.zeros((4, 4), bool)
    holes[1, 0] = holes[2, 1] = holes[3, 3] = True
    assert (frozen_lake_reasoning((1, 1), (0, 3), holes, "Up", "before_move")
            == "The player is at (1, 1) and the goal at (0, 3), holes at (1, 0), (2, 1); moving Up.")
    holes[1, 0] = False
    assert (frozen_lake_reasoning((1, 1), (0, 3), holes, "Up", "before_move")
            == "The player is at (1, 1) and the goal at (0, 3), hole at (2, 1); moving Up.")
    assert (frozen_lake_reasoning((0, 0), (0, 3), holes, "Right", "before_move")
            == "The player is at (0, 0) and the goal at (0, 3), no hole near; moving Right.")
    with pytest.raises(ValueError, match="before_move"):
        frozen_lake_reasoning((0, 0), (0, 3), holes, "Right", "holes_first")


def test_expert_reasoning_reaches_the_warmup_plan_and_leaves_old_caches_valid():
    from types import SimpleNamespace

    from configs import frozen_lake
    from ragen_jax.training.warmup_cache import fingerprint

    env, params = environments.make_with_params("frozen_lake", size=4, expert_reasoning="before_move")
    holes = np.zeros((4, 4), bool)
    holes[3, 2] = True
    plan = env.expert(SimpleNamespace(pos=np.array([3, 3]), goal=np.array([0, 0]), holes=holes), params)
    assert plan.answers[0] == "Up"  # Left is the hole; the BFS path goes up first
    assert plan.reasoning(plan.answers) == "The player is at (3, 3) and the goal at (0, 0), hole at (3, 2); moving Up."
    with pytest.raises(ValueError, match="expert_reasoning"):
        environments.make("frozen_lake", expert_reasoning="first")
    # The environment's default (the text every earlier cache was trained on) leaves the fingerprint
    # as it was before the key existed; the other value changes it.
    config = frozen_lake.get_config()
    config.env.expert_reasoning = "after_move"
    with_default = fingerprint(config)
    del config.env["expert_reasoning"]
    assert fingerprint(config) == with_default
    config.env.expert_reasoning = "before_move"
    assert fingerprint(config) != with_default


def test_expert_replies_earn_the_description_reward_through_the_rollout(setup):
    """With ``description_reward`` 0.5 every turn of an expert conversation (whose reasoning opens with
    the board's description, host-side text) earns 0.5 on top of the env's reward; off, none."""
    tok, graphdef, params, rollout, env, ep = setup
    keys = jax.random.split(jax.random.key(7), 4)
    forced, _, _ = expert_replies(rollout, keys, np.random.default_rng(0))
    plain = rollout.run(params, keys, jax.random.key(8), forced)
    paid = make_rollout(graphdef, env, ep.replace(description_reward=jnp.float32(0.5)), tok, rollout.config)
    traj = paid.run(params, keys, jax.random.key(8), forced)
    mask = np.asarray(traj.turn_mask)
    np.testing.assert_array_equal(np.asarray(plain.turn_reasoning_reward), 0.0)
    np.testing.assert_array_equal(np.asarray(traj.turn_reasoning_reward), np.where(mask, 0.5, 0.0))
    np.testing.assert_allclose(np.asarray(traj.turn_rewards), np.asarray(plain.turn_rewards) + 0.5 * mask)
    np.testing.assert_allclose(np.asarray(traj.episode_return), np.asarray(plain.episode_return) + 0.5 * mask.sum(1))
    np.testing.assert_array_equal(np.asarray(traj.tokens), np.asarray(plain.tokens))  # the prompts do not change
    # Every expert turn describes its state exactly (describes_state counts such turns, reward or not);
    # the same replies on other boards do not (each row answers the board of the row after it).
    np.testing.assert_array_equal(np.asarray(plain.turn_describes_state), mask)
    shifted = ForcedReplies(tokens=np.roll(np.asarray(forced.tokens), 1, axis=0),
                            lengths=np.roll(np.asarray(forced.lengths), 1, axis=0))
    other = rollout.run(params, keys, jax.random.key(8), shifted)
    assert np.asarray(other.turn_describes_state)[:, 0].sum() < len(keys)


def test_a_deadline_bounds_both_phases_and_fits_the_decay(setup, monkeypatch):
    """With a deadline (the trainer's ``warmup.time_share`` of its time limit) the first-turn phase
    stops at two thirds of the time and the conversation phase fits its steps, and its learning-rate
    decay, into the rest. A fake clock advances 1 s per BC step, so the counts are exact: 30 s give
    phase 1 20 steps; phase 2 times 5 steps after its first, fits 10 in all, and ends at the decay's end."""
    import types

    tok, graphdef, params, rollout, env, ep = setup
    clock = [1000.0]
    monkeypatch.setattr(warmup_lib, "time", types.SimpleNamespace(time=lambda: clock[0]))
    lrs = []
    real_step = warmup_lib.make_bc_step

    def spy(graphdef_, tx, prefix_len=0):
        step = real_step(graphdef_, tx, prefix_len)

        def wrapped(p, o, *batch):
            lrs.append(float(o[1].hyperparams["learning_rate"]))
            clock[0] += 1.0
            return step(p, o, *batch)
        return wrapped

    monkeypatch.setattr(warmup_lib, "make_bc_step", spy)
    cfg = ConfigDict(dict(steps=100, single_turn_steps=100, batch_size=2, lr=1e-3, num_states=4, seed=1, log_every=50))
    _, summary = warmup_lib.run_warmup(rollout, params, cfg, progress=False, deadline=1030.0)
    assert summary["warmup/single_turn_steps"] == 20.0 and summary["warmup/conversation_steps"] == 10.0
    assert summary["warmup/stopped_by_time"] == 1.0 and len(lrs) == 30
    want = warmup_lib._phase_lr(1e-3, 10, 20, 10)  # the decay re-planned over the 10 steps that fit
    np.testing.assert_allclose(lrs[26:], [want(i) for i in range(26, 30)], rtol=1e-6)
    assert lrs[-1] < 0.2 * 1e-3
    _, unbounded = warmup_lib.run_warmup(rollout, params, dict(cfg, steps=3, single_turn_steps=2), progress=False)
    assert unbounded["warmup/stopped_by_time"] == 0.0 and unbounded["warmup/conversation_steps"] == 3.0


def test_gain_over_warmup_is_the_paired_difference_hand_worked():
    """Five puzzles: before RL 1, 0, 0, 0, 1; at the end 1, 1, 1, 1, 0: differences 0, +1, +1, +1, -1,
    mean +0.4; the sign-flip test over the four differing puzzles enumerates 16 sign patterns, of
    which 10 reach |sum| >= 2 (the two of ±4 and the eight of ±2): p = 10/16."""
    from ragen_jax.training.trainer import gain_over_warmup

    history = {"val_puzzles": [[0, [1.0, 0.0, 0.0, 0.0, 1.0]], [25, [0.0] * 5], [50, [1.0, 1.0, 1.0, 1.0, 0.0]]]}
    gain = gain_over_warmup(history)
    assert gain["val/gain_over_warmup"] == pytest.approx(0.4)
    assert gain["val/gain_over_warmup_se"] == pytest.approx(np.std([0, 1, 1, 1, -1], ddof=1) / np.sqrt(5))
    assert gain["val/gain_over_warmup_p"] == pytest.approx(10 / 16)
    assert gain_over_warmup({"val_puzzles": [[0, [1.0]]]}) == {}
