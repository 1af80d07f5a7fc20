"""Behaviour-cloning warm-up: imitate the env solvers' optimal actions before RL.

A model that starts with no task signal (every reply malformed, every reward 0) gives StarPO
nothing to work with: all groups have zero reward variance. A short supervised phase on expert
conversations fixes that. The conversations are produced by the rollout itself with scripted
replies (``ForcedReplies``), so their tokens, chat framing, observations, reward messages and loss
mask are exactly what RL rollouts produce — one piece of code builds both.

Expert. At every turn the env's closed-loop expert (``env.expert``, in each environment's
``expert.py``) re-plans from the current state with its solver (BFS for Sokoban, shortest path avoiding
holes for FrozenLake, search for the cube, Sudoku and Countdown, expectimax for 2048) and takes
the first ``max_actions_per_turn`` actions. States are simulated on the host with the rollout's own
step keys (``fold_in(env_key, actions_taken + 1)``), so even slippery FrozenLake's outcomes match
what the scripted rollout then produces. A Python (host) environment's expert is its ``expert()``
method, played on a spare instance (``HostEnv.expert_episode``). Each reply is short, state-specific reasoning plus the
answer, e.g. ``The player is at (1, 3) and the goal at (2, 0); moving Left avoids the hole at
(1, 2).</think><answer>Left || Down</answer>``.

Training: cross-entropy on the assistant tokens (``Trajectory.loss_mask``), optax AdamW, one
jitted step. ``warmup.num_states`` limits the demonstrations to that many start states (a weak,
deliberately partial warm-up leaves RL room to improve); ``warmup.action_noise`` replaces that
fraction of expert turns by a random action (imperfect demonstrations).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from ragen_jax.config import WarmupConfig
from ragen_jax.config.checks import section_from_dict
from ragen_jax.rollout import codec as codec_lib
from ragen_jax.rollout.carry import ForcedReplies
from ragen_jax.rollout.host_env import HostEnv
from ragen_jax.rollout.loop import Rollout, make_rollout
from ragen_jax.rollout.trajectory import Trajectory
from ragen_jax.rollout.turn_rows import turn_rows
from ragen_jax.starpo.update import in_float32

# --------------------------------------------------------------------------------------------
# Expert replies (the experts themselves: each environment's expert.py)
# --------------------------------------------------------------------------------------------


def reply_text(reasoning: str, answers: list[str], enable_think: bool) -> str:
    """The assistant reply after the forced prefix: ``reasoning</think><answer>A || B</answer>``."""
    answer = " || ".join(answers)
    if enable_think:
        return f"{reasoning}</think><answer>{answer}</answer>"
    return f"{answer}</answer>"


@functools.lru_cache(maxsize=8)
def _compiled_env(env):
    """(batched reset, single-state step), jitted once per env: demonstrations call them for every
    batch, and un-jitted JAX runs them op by op."""
    return jax.jit(jax.vmap(env.reset, in_axes=(0, None))), jax.jit(env.step_env)


def expert_replies(rollout: Rollout, env_keys: jax.Array, rng: np.random.Generator,
                   action_noise: float = 0.0) -> tuple[ForcedReplies, np.ndarray, np.ndarray]:
    """Scripted expert replies for the episodes started from ``env_keys``.

    Args:
      rollout: the training rollout (its env, params and config).
      env_keys: ``[B]`` reset keys, one per row.
      rng: host generator for ``action_noise``.
    Returns:
      ``(ForcedReplies(tokens [B, T, N], lengths [B, T]), planned_success bool [B],
      described int32 [B, T])``: ``described`` counts the reply's leading tokens that only restate
      the observation (``"The player is at (2, 1) and the goal at (0, 3)"``, the reasoning before
      its first ``;``) — what ``make_reading_check`` checks.
    """
    c = rollout.config
    B, T, N = env_keys.shape[0], c.max_turns, c.max_new_tokens
    if isinstance(rollout.env, HostEnv):
        episodes = [rollout.env.expert_episode(seed, T, c.max_actions_per_turn, c.max_actions_per_traj, rng,
                                               action_noise) for seed in HostEnv.seeds_of(env_keys)]
    else:
        episodes = _device_expert_episodes(rollout, env_keys, rng, action_noise)
    tokens = np.full((B, T, N), rollout.codec.pad_id, np.int32)
    lengths = np.zeros((B, T), np.int32)
    described = np.zeros((B, T), np.int32)
    for b, (turns, _) in enumerate(episodes):
        for t, (reasoning, answers) in enumerate(turns):
            ids = codec_lib.encode(rollout.tokenizer, reply_text(reasoning, answers, c.enable_think))
            if len(ids) > N:
                raise ValueError(f"an expert reply needs {len(ids)} tokens but rollout.max_new_tokens={N}; "
                                 "raise rollout.max_new_tokens")
            tokens[b, t, : len(ids)] = ids
            lengths[b, t] = len(ids)
            described[b, t] = _described_tokens(rollout.tokenizer, reasoning, ids) if c.enable_think else 0
    success = np.array([ok for _, ok in episodes], bool)
    return ForcedReplies(tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths)), success, described


def _device_expert_episodes(rollout: Rollout, env_keys: jax.Array, rng: np.random.Generator,
                            action_noise: float) -> list[tuple[list[tuple[str, list[str]]], bool]]:
    """An on-device env's expert over each row's episode: ``[([(reasoning, answers)] per turn, success)]``.
    States are simulated on the host with the rollout's own step keys, so stochastic outcomes match."""
    env, ep, c = rollout.env, rollout.env_params, rollout.config
    reset, step = _compiled_env(env)
    states = jax.tree.map(np.asarray, reset(env_keys, ep)[1])
    episodes = []
    for b in range(env_keys.shape[0]):
        state = jax.tree.map(lambda x: x[b], states)  # numpy: per-row slicing on the host
        key = env_keys[b]
        turns, n_actions, done, success = [], 0, False, False
        for _ in range(c.max_turns):
            if done or n_actions >= c.max_actions_per_traj:
                break
            expert = env.expert(jax.tree.map(np.asarray, state), ep)
            answers = list(expert.answers[: c.max_actions_per_turn])
            if not answers or (action_noise and rng.random() < action_noise):
                answers = [env.random_answer(state, rng)]
            turns.append((expert.reasoning(answers), answers))
            for answer in answers[: c.max_actions_per_traj - n_actions]:
                skey = jax.random.fold_in(key, n_actions + 1)
                _, state, _, term, trunc, info = step(skey, state, env.answer_action(answer), ep)
                n_actions += 1
                if bool(term) or bool(trunc):
                    done = True
                    success = bool(info["success"]) and bool(term)
                    break
        episodes.append((turns, success))
    return episodes


def _described_tokens(tokenizer, reasoning: str, reply_ids: list[int]) -> int:
    """Leading tokens of ``reply_ids`` that spell the state description (reasoning before its first
    ``;`` or ``.``). Counted as the tokens shared with that text encoded alone: BPE may merge the
    description's last character with the next one (``)`` + ``;`` -> ``);``), which then is not
    counted."""
    head = reasoning.split(";")[0].split(".")[0]
    alone = codec_lib.encode(tokenizer, head)
    n = 0
    while n < min(len(alone), len(reply_ids)) and alone[n] == reply_ids[n]:
        n += 1
    return n


def _demonstration_batches(rollout: Rollout, params, num_states: int, seed: int, action_noise: float = 0.0,
                           max_batches: int | None = None):
    """Yields ``(Trajectory, described [B, T])`` per batch of ``rollout`` rows (see ``demonstrations``)."""
    B = rollout.config.batch_size
    n_batches = max(1, -(-num_states // B))
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    rng = np.random.default_rng(seed)
    base = jax.random.key(seed)
    for i in range(n_batches):
        env_keys = jax.random.split(jax.random.fold_in(base, i), B)
        forced, _, described = expert_replies(rollout, env_keys, rng, action_noise)
        traj = rollout.run(params, env_keys, jax.random.fold_in(base, 10_000 + i), forced)
        # Demonstrations are assembled on the host (every process holds them all); each BC step
        # then places its batch on the mesh (``_on_mesh``).
        yield (rollout.placement.fetch(traj) if rollout.placement is not None else traj), described


def demonstrations(rollout: Rollout, params, num_states: int, seed: int, action_noise: float = 0.0,
                   max_batches: int | None = None) -> list[Trajectory]:
    """Expert trajectories from the scripted rollout, one batch of ``rollout`` rows at a time.

    ``num_states`` distinct start states (rounded up to whole batches); each row is its own state.
    """
    return [traj for traj, _ in _demonstration_batches(rollout, params, num_states, seed, action_noise, max_batches)]


# --------------------------------------------------------------------------------------------
# Behaviour cloning
# --------------------------------------------------------------------------------------------


def _on_mesh(placement, batch, replicated=None):
    """A host-made BC batch split over the mesh's batch axes (``replicated``: values every device
    needs whole, e.g. the learning rate); unchanged without a placement."""
    if placement is None:
        return batch if replicated is None else (batch, replicated)
    batch = placement.put_batch(batch)
    return batch if replicated is None else (batch, placement.put_replicated(replicated))


def _next_token_logits(graphdef, params, tokens, prefix_len: int):
    """Logits ``[B, L - P - 1, V]`` predicting ``tokens[:, P + 1:]``; the shared prefix
    ``tokens[:, :P]`` (the same in every row) runs once, for one row (``Decoder.encode_prefix``)."""
    model = nnx.merge(graphdef, params)
    B, L = tokens.shape
    P = prefix_len
    prefix = model.encode_prefix(tokens[:1, :P])[1] if P else None
    positions = jnp.broadcast_to(jnp.arange(P, L, dtype=jnp.int32), (B, L - P))
    hidden, _ = model.hidden(tokens[:, P:], positions, prefix)
    return model.logits(hidden[:, :-1])  # position t predicts t + 1


def bc_loss(graphdef, params, tokens, loss_mask, valid_mask, prefix_len: int = 0):
    """Token-mean cross-entropy of the assistant tokens.

    Args:
      tokens, loss_mask, valid_mask: ``[B, L]`` (the Trajectory's). ``tokens[:, t]`` is predicted
        by the logits at ``t - 1``.
      prefix_len: static; when > 0, ``tokens[:, :prefix_len]`` must be the same in every row and
        ``loss_mask[:, :prefix_len + 1]`` all False (see ``shared_prefix_length``). The prefix (the
        system prompt every demonstration starts with) is then run once, for one row, and every
        row continues from its keys/values (``Decoder.encode_prefix``): the gradient is the same,
        the prompt's share of the compute is paid once per batch instead of once per row.
    Returns:
      (loss, accuracy) scalars over the masked tokens.
    """
    P = prefix_len
    logp = jax.nn.log_softmax(_next_token_logits(graphdef, params, tokens, P).astype(jnp.float32), axis=-1)
    target = tokens[:, P + 1:]
    tok_logp = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    mask = (loss_mask[:, P + 1:] & valid_mask[:, P + 1:]).astype(jnp.float32)
    denom = jnp.maximum(mask.sum(), 1.0)
    loss = -(tok_logp * mask).sum() / denom
    acc = ((jnp.argmax(logp, -1) == target) * mask).sum() / denom
    return loss, acc


def make_reading_check(graphdef, tokens, loss_mask, described, prefix_len: int = 0,
                       chunk: int = 64, placement=None) -> Callable[[Any], float]:
    """``check(params) -> float``: the fraction of held-out first-turn demonstrations whose state
    description the model reads exactly.

    Teacher-forced: every token of the reply's description of the board (the ``described`` leading
    reply tokens, e.g. ``The player is at (2, 1) and the goal at (0, 3)``) must be the argmax of
    the model's next-token distribution. The template words are learned in a few steps; what this
    measures is whether the model reads the cells' coordinates off the observation.

    Args:
      tokens, loss_mask: ``[N, L]`` one-turn demonstrations (the reply starts at the first loss token).
      described: ``[N]`` description tokens per row (``expert_replies``).
      prefix_len: as in ``bc_loss`` (the shared system prompt).
      chunk: rows per forward pass (the last chunk is padded with repeated rows, so one program).
    """
    tokens, loss_mask, described = np.asarray(tokens), np.asarray(loss_mask), np.asarray(described)
    n, P = tokens.shape[0], prefix_len
    start = loss_mask.argmax(axis=1)
    cols = np.arange(tokens.shape[1])[None]
    checked = ((cols >= start[:, None]) & (cols < (start + described)[:, None]))[:, P + 1:]
    pad = -n % chunk
    tokens = np.concatenate([tokens, tokens[np.arange(pad) % n]]) if pad else tokens
    predict = jax.jit(lambda p, t: jnp.argmax(_next_token_logits(graphdef, p, t, P), -1))

    def check(params) -> float:
        fetch = placement.fetch if placement is not None else np.asarray
        pred = np.concatenate([fetch(predict(params, _on_mesh(placement, jnp.asarray(tokens[i: i + chunk]))))
                               for i in range(0, tokens.shape[0], chunk)])[:n]
        return float(np.mean(((pred == tokens[:n, P + 1:]) | ~checked).all(axis=1)))

    return check


def shared_prefix_length(tokens: np.ndarray, loss_mask: np.ndarray) -> int:
    """The longest prefix every row of ``tokens [N, L]`` shares and that ``bc_loss`` may run once:
    no loss token inside it, or as the first token after it (that one is predicted from the last
    prefix position, which the suffix pass does not produce). At most ``L - 2``: the suffix keeps
    at least one prediction."""
    tokens, loss_mask = np.asarray(tokens), np.asarray(loss_mask)
    differs = np.flatnonzero(np.any(tokens != tokens[:1], axis=0))
    common = int(differs[0]) if differs.size else tokens.shape[1] - 2
    trained = np.flatnonzero(np.any(loss_mask, axis=0))
    if trained.size:
        common = min(common, int(trained[0]) - 1)
    return max(common, 0)


def make_bc_step(graphdef, tx: optax.GradientTransformation, prefix_len: int = 0) -> Callable:
    """``step(params, opt_state, tokens, loss_mask, valid_mask, frozen=None) -> (params, opt_state,
    metrics)`` (jitted). ``frozen``: state merged in but not trained (a LoRA model's base)."""

    @jax.jit
    def step(params, opt_state, tokens, loss_mask, valid_mask, frozen=None):
        def loss_of(p):
            return bc_loss(graphdef, _with_frozen(p, frozen), tokens, loss_mask, valid_mask, prefix_len)

        (loss, acc), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "token_accuracy": acc, "grad_norm": optax.global_norm(grads)}

    return step


def _with_frozen(params, frozen):
    """The whole model state: the trained ``params`` and the ``frozen`` rest (None: nothing frozen)."""
    return params if frozen is None else nnx.merge_state(params, frozen)


def first_turn_rollout(rollout: Rollout) -> Rollout:
    """The same rollout stopped after one turn: the first-turn demonstrations of phase 1."""
    return make_rollout(rollout.graphdef, rollout.env, rollout.env_params, rollout.tokenizer,
                        dataclasses.replace(rollout.config, max_turns=1), placement=rollout.placement)


def bc_data(demos: list[Trajectory], per_turn_rows: tuple[int, int] | None = None):
    """Concatenate demonstration batches; trim the right padding every row shares (the forward
    pass only needs the longest row). -> ((tokens, loss_mask, valid_mask) [N, W], expert success, N).

    ``per_turn_rows`` ``(preamble_len, row_len)``: the demonstrations come from a limited-context
    rollout; each turn then becomes its own row, holding the window the policy will see
    (``rollout.turn_rows``), and rows of turns that never happened are dropped."""
    data = jax.tree.map(lambda *xs: jnp.concatenate(xs), *demos)
    success = float(jnp.mean(data.success))
    if per_turn_rows is not None and data.max_turns > 1:  # a one-turn transcript is its own turn row
        view = turn_rows(data, *per_turn_rows).view
        keep = np.flatnonzero(np.asarray(jnp.any(view.loss_mask, axis=1)))
        data = jax.tree.map(lambda x: x[keep], view)
    width = int(jnp.max(data.lengths)) + 1
    width = min(data.tokens.shape[1], -(-width // 8) * 8)
    arrays = tuple(x[:, :width] for x in (data.tokens, data.loss_mask, data.valid_mask))
    return arrays, success, data.tokens.shape[0]


def _phase_lr(peak: float, warm: int, decay_start: int, decay_steps: int) -> Callable[[int], np.float32]:
    """Learning rate at (0-based) step ``i``: linear warm-up over ``warm`` steps (first step
    ``peak / warm``), constant, then a cosine decay to 10% over the ``decay_steps`` steps from
    ``decay_start`` — an optax schedule, evaluated on the host in float64 and rounded once to
    float32: a float32 evaluation differs in the last bits, and the first-turn phase's reading
    plateau moves with any such change (``docs/experiments.md``)."""
    rise = optax.linear_schedule(peak / warm, peak, warm - 1) if warm > 1 else optax.constant_schedule(peak)
    decay = optax.cosine_decay_schedule(peak, max(decay_steps, 1), alpha=0.1)
    start = max(decay_start, warm)  # the decay never interrupts the warm-up ...
    late = start - decay_start  # ... but counts its steps from decay_start
    schedule = optax.join_schedules([rise, optax.constant_schedule(peak), lambda c: decay(c + late)], [warm, start])

    def lr(i: int) -> np.float32:
        with jax.enable_x64(True):
            return np.float32(float(schedule(i)))

    return lr


def bc_optimizer(lr: float) -> optax.GradientTransformation:
    """The warm-up's AdamW (clipped at global norm 1, no weight decay). Its learning rate is set on the
    host before every step: where phase 2's decay starts is only known once phase 1 has ended. The
    moments and arithmetic are float32 whatever the weights' dtype (``in_float32``): with bfloat16
    weights a bfloat16 second moment underflows to 0 and the first step's update is inf."""
    return in_float32(optax.chain(optax.clip_by_global_norm(1.0),
                                  optax.inject_hyperparams(optax.adamw)(learning_rate=lr, weight_decay=0.0)))


def run_warmup(rollout: Rollout, params, warmup_cfg, log_fn: Callable[[int, dict], None] | None = None,
               progress: bool = True, frozen=None, first_phase_only: bool = False,
               deadline: float | None = None) -> tuple[Any, dict]:
    """Behaviour-clone ``params`` on expert conversations; returns ``(params, summary)``.

    ``deadline`` (``time.time()`` seconds; the trainer sets it from ``warmup.time_share``): the
    warm-up ends by then — phase 1 by two thirds of the time left when there is a phase 2, which
    then fits its steps and its learning-rate decay into the rest (measured on its first steps).
    ``warmup/stopped_by_time`` says whether a phase was cut.

    ``frozen``: model state merged with ``params`` but not trained (a LoRA model's base weights:
    then only the adapters in ``params`` learn). ``first_phase_only``: stop after phase 1, with the
    learning rate it has in the whole warm-up (``tools/reading_plateau.py`` measures that phase).

    Two phases share one AdamW optimiser:

    1. Up to ``single_turn_steps`` on first-turn conversations (system prompt, one observation, the
       expert's reply). They are a third of a full conversation's length, so each step is ~3×
       cheaper; since FrozenLake and Sokoban are Markov, every start state is also a mid-episode
       state, and this is where the model learns to read the board. How many steps that takes
       varies a lot with the initialisation (a plateau at chance, then a quick rise, anywhere from
       ~600 to over 2,200 steps for the main job's model), so with ``reading_target > 0`` the phase
       ends as soon as ``make_reading_check`` on ``heldout_states`` unseen start states reaches it
       (checked every ``check_every`` steps): a model that reads early gets the rest of the time
       for conversations and RL, one that reads late still gets there.
    2. ``steps`` on whole multi-turn expert conversations (the context RL rollouts produce; in
       limited context mode one row per turn, holding that turn's window).

    Learning rate: linear warm-up over the first 5% of ``single_turn_steps + steps``, constant
    through phase 1 (its length is not known in advance), cosine decay to 10% over phase 2 (over
    phase 1 when there is no phase 2).

    Each step runs the system prompt every demonstration starts with once, not once per row
    (``shared_prefix_length``, ``bc_loss(prefix_len=...)``).

    ``warmup_cfg``: the ``config.warmup`` section, a ``WarmupConfig`` or a mapping of its keys (missing
    ones take its defaults).
    """
    t0 = time.time()
    if not isinstance(warmup_cfg, WarmupConfig):
        warmup_cfg = section_from_dict(WarmupConfig, "warmup", warmup_cfg)
    phases, check = _warmup_phases(rollout, _with_frozen(params, frozen),
                                   dataclasses.replace(warmup_cfg, steps=0) if first_phase_only else warmup_cfg)
    conv_steps = int(warmup_cfg.steps)  # the schedule's length counts phase 2 even when it is not run
    total = conv_steps + int(warmup_cfg.single_turn_steps)
    tx = bc_optimizer(warmup_cfg.lr)
    # Initialised under jit: every leaf (the step counter too) lives on the devices of the params.
    run = _BCRun(params=params, opt_state=jax.jit(tx.init)(params), rng=np.random.default_rng(warmup_cfg.seed),
                 log_fn=log_fn, summary={})
    if progress:
        run.bar = tqdm(total=total, desc="warm-up (BC)", leave=False)
    warm = max(1, total // 20)
    run.summary["warmup/stopped_by_time"] = 0.0
    for name, n_steps, demos in phases:
        decays = name == "conversation" or not conv_steps
        decay_start = run.done if decays else total
        lr_for = lambda n, start=decay_start: _phase_lr(warmup_cfg.lr, warm, start, n)  # noqa: E731
        phase_deadline = deadline
        if deadline is not None and name == "single_turn" and conv_steps and not first_phase_only:
            phase_deadline = time.time() + (deadline - time.time()) * 2.0 / 3.0
        _run_phase(run, rollout, tx, name, n_steps, demos, lr_for, warmup_cfg,
                   check=check if name == "single_turn" else None, frozen=frozen, deadline=phase_deadline)
        if run.bar is not None and name == "single_turn":
            run.bar.total = run.done + conv_steps  # the unused first-turn steps are not run
            run.bar.refresh()
    if run.bar is not None:
        run.bar.close()
    summary = run.summary
    last = phases[-1][0] if phases else None
    summary.update({
        "warmup/num_demonstrations": summary.get(f"warmup/{last}_demonstrations", 0.0),
        "warmup/expert_success": summary.get(f"warmup/{last}_expert_success", 0.0),
        "warmup/seconds": time.time() - t0, **{f"warmup/final_{k}": v for k, v in run.metrics.items()}})
    return run.params, summary


def _warmup_phases(rollout: Rollout, params, warmup_cfg):
    """``([(name, steps, demonstrations)], reading_check or None)`` for the configured phases."""
    single_steps = int(warmup_cfg.single_turn_steps)
    conv_steps = int(warmup_cfg.steps)

    def states_for(n_steps):  # no more distinct states than the phase can visit
        cap = n_steps * warmup_cfg.batch_size
        return min(warmup_cfg.num_states, cap) if warmup_cfg.num_states else cap

    phases = []
    check = None
    if single_steps:
        one_turn = first_turn_rollout(rollout)
        # Different start states from phase 2 (seed + 1): more boards seen for the same cost.
        phases.append(("single_turn", single_steps,
                       demonstrations(one_turn, params, states_for(single_steps), warmup_cfg.seed + 1,
                                      warmup_cfg.action_noise)))
        if float(warmup_cfg.reading_target) > 0:
            # Held-out start states (another seed) with noise-free expert replies.
            batches = list(_demonstration_batches(one_turn, params, int(warmup_cfg.heldout_states),
                                                  warmup_cfg.seed + 2))
            (held_tokens, held_loss, held_valid), _, _ = bc_data([t for t, _ in batches])
            held_mask = np.asarray(held_loss & held_valid)
            described = np.concatenate([d[:, 0] for _, d in batches])
            check = make_reading_check(rollout.graphdef, held_tokens, held_mask, described,
                                       shared_prefix_length(np.asarray(held_tokens), held_mask),
                                       placement=rollout.placement)
    if conv_steps:
        phases.append(("conversation", conv_steps,
                       demonstrations(rollout, params, states_for(conv_steps), warmup_cfg.seed,
                                      warmup_cfg.action_noise)))
    return phases, check


@dataclasses.dataclass
class _BCRun:
    """What the warm-up's phases carry from one to the next."""

    params: Any
    opt_state: Any
    rng: np.random.Generator  # the order demonstrations are drawn in
    log_fn: Callable[[int, dict], None] | None
    summary: dict
    done: int = 0  # BC steps run so far, both phases
    metrics: dict = dataclasses.field(default_factory=dict)  # the last logged step's
    bar: Any = None


FIT_AFTER_STEPS = 5  # a phase with a deadline times this many steps (the first compiles) to fit the rest


def _run_phase(run: _BCRun, rollout: Rollout, tx, name: str, n_steps: int, demos, lr_for, warmup_cfg,
               check=None, frozen=None, deadline: float | None = None) -> None:
    """Up to ``n_steps`` BC steps on ``demos`` (shuffled, batch by batch); with ``check`` (phase 1
    with a reading target) the phase ends once held-out board reading reaches the target. ``lr_for(n)``:
    the learning rate by step for a phase of ``n`` steps. ``deadline``: the phase ends by then; a
    phase whose rate decays (phase 2) re-plans its length from its first steps' speed so that the
    decay completes in time."""
    lr_at = lr_for(n_steps)
    (tokens, loss_mask, valid_mask), expert_success, n = bc_data(demos, rollout.per_turn_rows)
    run.summary[f"warmup/{name}_demonstrations"] = float(n)
    run.summary[f"warmup/{name}_expert_success"] = expert_success
    bs = min(warmup_cfg.batch_size, n)
    # Every demonstration opens with the same system prompt: run it once per batch.
    prefix = shared_prefix_length(np.asarray(tokens), np.asarray(loss_mask & valid_mask))
    step_fn = make_bc_step(rollout.graphdef, tx, prefix)
    run.summary[f"warmup/{name}_shared_prefix_tokens"] = float(prefix)
    target = float(warmup_cfg.reading_target)
    check_every = int(warmup_cfg.check_every)
    order, cursor = run.rng.permutation(n), 0
    limit, t_timed = n_steps, None
    i = -1
    while i + 1 < limit:
        i += 1
        if cursor + bs > n:
            order, cursor = run.rng.permutation(n), 0
        idx = jnp.asarray(order[cursor: cursor + bs])
        cursor += bs
        batch, lr = _on_mesh(rollout.placement, (tokens[idx], loss_mask[idx], valid_mask[idx]),
                             jnp.asarray(lr_at(run.done), jnp.float32))
        run.opt_state[1].hyperparams["learning_rate"] = lr
        extra = {} if frozen is None else {"frozen": frozen}  # a LoRA model's base rides along, untrained
        run.params, run.opt_state, m = step_fn(run.params, run.opt_state, *batch, **extra)
        run.done += 1
        if run.done % warmup_cfg.log_every == 0 or i + 1 == n_steps:
            m = rollout.placement.fetch(m) if rollout.placement is not None else m
            run.metrics = {k: float(v) for k, v in m.items()}
            _report(run, {f"warmup/{k}": v for k, v in run.metrics.items()}, phase=name,
                    loss=f"{run.metrics['loss']:.3f}", acc=f"{run.metrics['token_accuracy']:.2f}")
        if run.bar is not None:
            run.bar.update(1)
        if check is not None and ((i + 1) % check_every == 0 or i + 1 == n_steps):
            reading = check(_with_frozen(run.params, frozen))
            run.summary["warmup/reading_accuracy"] = reading
            _report(run, {"warmup/reading_accuracy": reading}, phase=name, reading=f"{reading:.2f}")
            if reading >= target:
                break
        if deadline is not None:
            now = time.time()
            if now >= deadline:
                run.summary["warmup/stopped_by_time"] = 1.0
                break
            if i == 0:
                t_timed = now  # after the first (compiling) step
            elif i == FIT_AFTER_STEPS and check is None:
                per_step = (now - t_timed) / i  # steps 1..i since the first
                fit = min(n_steps, i + 1 + int((deadline - now) / max(per_step, 1e-9)))
                if fit < n_steps:
                    run.summary["warmup/stopped_by_time"] = 1.0
                    limit, lr_at = fit, lr_for(fit)
                    if run.bar is not None:
                        run.bar.total -= n_steps - fit
                        run.bar.refresh()
    run.summary[f"warmup/{name}_steps"] = float(i + 1)


def _report(run: _BCRun, scalars: dict, **postfix) -> None:
    if run.log_fn is not None:
        run.log_fn(run.done, scalars)
    if run.bar is not None:
        run.bar.set_postfix(**postfix)
