"""The training loop: rollout → StarPO update → log → checkpoint → evaluate.

The loop is thin on purpose. Everything per token or per env happens in two compiled functions
owned by other parts: ``rollout(params, key) -> Trajectory`` (ragen_jax.rollout) and
``update(train_state, trajectory) -> (train_state, metrics)`` (ragen_jax.starpo: SNR filter,
advantages, PPO/GRPO losses, optimizer, MI diagnostics). The host only derives keys, moves scalars
to TensorBoard, saves checkpoints, runs evaluations and tracks the early-stop signals.

Reproducibility and exact resume. Step ``s`` uses the rollout key ``fold_in(key(seed), s)`` and
the update's own RNG carried in the train state, so a run interrupted after step 3 and resumed
from its checkpoint logs bit-for-bit what an uninterrupted run logs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from ragen_jax.config import ConfigError, RunSpec
from ragen_jax.rollout import codec as codec_lib
from ragen_jax.rollout.trajectory import trim, trimmed_width
from ragen_jax.starpo import dynamic_sampling
from ragen_jax.starpo.start_replay import StartReplay
from ragen_jax.starpo.train_state import frozen_base, policy_params, saved_part
from ragen_jax.training.checkpoint import Checkpointer, restore_train_state
from ragen_jax.training.evaluate import Evaluator
from ragen_jax.training.event_log import Logger, quadrant_figure, save_learning_curve, to_host_scalars, trim_events
from ragen_jax.training.metrics import EarlyStop, rollout_metrics
from ragen_jax.training.paired import mean_se, sign_flip_p
from ragen_jax.training.pipeline import RolloutPipeline
from ragen_jax.training.run import Setup, make_placement, setup
from ragen_jax.training.wandb_sink import WandbSink
from ragen_jax.training.warmup import run_warmup
from ragen_jax.training.warmup_cache import WarmupCache
from ragen_jax.training.workdir import WorkdirLock, config_as_json, prepare_training_workdir, trim_records

# Update-step metric names (ragen_jax.starpo) the loop reads for early stopping and the progress bar.
MI_KEY = "collapse_first_turn_sample/mi_estimate"
COND_ENT_KEY = "collapse_first_turn_sample/conditional_entropy_est"
MI_SAMPLES = ("collapse_first_turn_sample/", "collapse_trajectory_sample/")
SAMPLE_COMPUTED_KEY = MI_SAMPLES[0] + "computed"  # the first-turn sample had a reading
SAMPLE_COUNTS = ("computed", "num_samples", "num_prompts")  # logged even when a sample had too few


class StopTraining(Exception):
    """Raised by a step callback to end the run early (the checkpoint of that step is kept)."""


def _mi_values(metrics: dict) -> tuple[float | None, float | None, bool]:
    """(MI, H(Z|X), computed-this-step) of the first-turn sample from the update metrics.

    A step that ran the diagnostic but found fewer than two distinct prompts with a parseable
    reasoning (``collapse_first_turn_sample/computed`` 0: a policy whose replies stopped parsing)
    has no estimate: its zeros are not an MI of 0, so neither the alert nor the quadrant sees them.
    """
    computed = bool(metrics.get("collapse/computed", 0.0)) and bool(metrics.get(SAMPLE_COMPUTED_KEY, 0.0))
    if not computed:
        return None, None, False
    return metrics.get(MI_KEY), metrics.get(COND_ENT_KEY), True


def _drop_uncomputed(metrics: dict) -> dict:
    """MI-proxy metrics are zeros on steps where they were not computed (not this step's turn, or
    too few parseable reasonings in a sample): do not log those. A sample that ran but had too few
    keeps its ``computed`` flag (0) and its counts, so the gap in its curves is explained."""
    ran = bool(metrics.get("collapse/computed", 0.0))

    def keep(key: str) -> bool:
        sample = next((p for p in MI_SAMPLES if key.startswith(p)), None)
        if sample is None:
            return True
        return ran and (bool(metrics.get(sample + "computed", 0.0)) or key[len(sample):] in SAMPLE_COUNTS)

    return {k: v for k, v in metrics.items() if keep(k)}


@dataclasses.dataclass
class HostState:
    """What the loop keeps on the host between steps; saved as every checkpoint's ``meta``, so a
    resumed run continues its early-stop counters, curves and summary exactly."""

    early: EarlyStop
    # train / val success per step, per-puzzle validation success, [step, rollout s, update s, kept
    # fraction] per step, (step, MI, H(Z|X)) points, the warm-up mark
    history: dict[str, Any]
    summary: dict[str, float]
    start_replay: StartReplay | None = None  # the unsolved-start queue (``filter.start_replay_fraction``)

    @classmethod
    def fresh(cls, spec: RunSpec) -> "HostState":
        t = spec.trainer
        early = EarlyStop(baseline_steps=t.reward_collapse_baseline_steps, window=t.reward_collapse_window,
                          ratio=t.reward_collapse_ratio, mi_ratio=t.mi_collapse_ratio,
                          mi_window=t.mi_collapse_window, mi_baseline=spec.collapse.baseline_steps,
                          mi_needs_plateau=t.mi_collapse_needs_plateau)
        history = {"train": [], "val": [], "val_puzzles": [], "timing": [], "quadrant": [], "warmup_val": None,
                   "title": f"{spec.env_name} / {spec.preset}"}
        f = spec.filter
        replay = None
        if f.start_replay_fraction > 0:
            words = jax.random.key_data(jax.random.key(0)).shape[-1]
            replay = StartReplay.empty(f.start_replay_fraction, f.start_replay_max_uses, f.start_replay_capacity, words)
        return cls(early, history, {}, replay)

    @classmethod
    def from_meta(cls, meta: dict, spec: RunSpec) -> "HostState":
        host = cls.fresh(spec)
        host.early = EarlyStop.from_state_dict(meta["early_stop"])
        host.history, host.summary = meta["history"], meta.get("summary", {})
        if host.start_replay is not None and "start_replay" in meta:
            host.start_replay.load_state_dict(meta["start_replay"])
        return host

    def meta(self, step: int) -> dict:
        meta = {"step": step, "early_stop": self.early.state_dict(), "history": self.history,
                "summary": self.summary}
        if self.start_replay is not None:
            meta["start_replay"] = self.start_replay.state_dict()
        return meta


@dataclasses.dataclass
class Loop:
    """What the stages of one run's loop share: the spec, the assembled run, the host-side state, the
    writers (TensorBoard, checkpoints, validation transcripts) and the run's clock (wall, CPU)."""

    spec: RunSpec
    run: Setup
    host: HostState
    evaluator: Evaluator | None
    logger: Logger
    ckpt: Checkpointer
    transcripts: Path | None  # validation transcripts (JSONL); None: not written by this process
    clock: tuple[float, float]
    step_callback: Callable[[int, dict], None] | None = None


def train(spec: RunSpec, step_callback: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
    """Run (or resume) training as configured; returns the final summary metrics.

    ``step_callback(step, metrics)`` runs after each step; raising ``StopTraining`` from it saves a
    checkpoint of that step and ends the run (tests use it to interrupt and resume).
    """
    clock = (time.time(), time.process_time())
    placement = make_placement(spec)
    # One writer per workdir: the main process holds its lock for the whole run (a second run is refused).
    lock = WorkdirLock(spec.workdir) if placement.is_main else contextlib.nullcontext()
    with lock:
        return _train(spec, placement, clock, step_callback)


def _train(spec: RunSpec, placement, clock, step_callback) -> dict[str, Any]:
    """``train``'s body, under the workdir's lock."""
    t = spec.trainer
    workdir = Path(spec.workdir)
    resume = _prepare_workdir(spec, placement)  # refuses to mix runs; writes config.json
    run = setup(spec, placement)
    main = placement.is_main  # the one process that writes logs, transcripts and the summary
    if placement.num_processes > 1 and main:
        print(f"training on {placement.describe}")
    evaluator = _make_evaluator(spec, run)
    ckpt = Checkpointer(workdir / "checkpoints", keep=t.keep_checkpoints, placement=placement)
    transcripts = workdir / "eval" / "transcripts.jsonl" if spec.eval.write_transcripts and main else None

    if resume:
        train_state, host, start_step = _resume(spec, run, ckpt)
    else:
        train_state, host, start_step = run.train_state, HostState.fresh(spec), 0
    if main:  # records and TensorBoard series of steps after the checkpoint are written again, once
        if transcripts is not None:
            trim_records(transcripts, start_step if resume else -1)
        trim_events(workdir / "tensorboard", start_step if resume else -1)
    sinks = (WandbSink(spec.logging, workdir, config_as_json(spec.config)),) if spec.logging.wandb and main else ()
    loop = Loop(spec, run, host, evaluator, Logger(workdir / "tensorboard", enabled=main, sinks=sinks), ckpt,
                transcripts, clock, step_callback)
    try:
        if not resume:
            train_state = _warm_up_and_validate(loop, train_state)
            ckpt.save(0, saved_part(train_state), host.meta(0))
        step, stop_reason = _run_steps(loop, train_state, start_step)
        result = _finish(loop, step, stop_reason, write=main)
    except BaseException:
        _close_after_failure(loop.logger)
        raise
    loop.logger.close()
    ckpt.close()
    return result


def _close_after_failure(logger: Logger) -> None:
    """Close the TensorBoard writer when the run fails, so what was logged is on disk and its
    thread ends now rather than at the interpreter's shutdown (where Python 3.12 prints its error
    after the command's own report). The checkpointer is left as it is: every finished checkpoint
    is already committed, and closing it after a failed save only wakes orbax's threads. A failure
    while closing is secondary to the one being raised: it is dropped."""
    try:
        logger.close(failed=True)
    except Exception:  # noqa: BLE001 - the original error is the one the user needs
        pass


def _run_steps(loop: Loop, train_state, start_step: int) -> tuple[int, str | None]:
    """The StarPO steps from ``start_step``: rollout → update → log → validate → checkpoint.
    -> ``(last step, stop reason or None)``."""
    spec, run, host = loop.spec, loop.run, loop.host
    t = spec.trainer
    steps, bar = _steps(spec, start_step, show=run.placement.is_main)
    base_key = jax.random.key(spec.seed)
    # Asynchronous rollout: the next steps' batches are sampled while this one trains (training.pipeline).
    pipeline = _start_pipeline(loop, train_state, start_step, base_key) if t.max_staleness else None
    step, stop_reason = start_step, None
    for step in steps:
        sampled, pipeline_metrics = pipeline.take(step, train_state) if pipeline is not None else (None, {})
        train_state, traj, metrics = starpo_step(run, train_state, jax.random.fold_in(base_key, step),
                                                 spec.rollout.group_size, spec.starpo.seq_len_multiple,
                                                 spec.filter.dynamic_sampling_rounds,
                                                 _analyses_gradients(t.gradient_analysis_every, step),
                                                 host.start_replay, sampled)
        metrics.update(pipeline_metrics)
        _warn_about_step(spec, step, metrics, host.summary, bar)
        _track(spec, host, step, metrics)
        _log_step(loop, step, metrics, traj)
        out_of_time = bool(t.time_limit_minutes) and time.time() - loop.clock[0] >= 60.0 * t.time_limit_minutes
        if out_of_time:  # this step is the last, and it gets the final validation
            stop_reason = f"time limit of {t.time_limit_minutes:g} min reached"
        if loop.evaluator is not None and t.eval_every and (step % t.eval_every == 0 or step == t.total_steps
                                                            or out_of_time):
            stop_reason = _validate(loop, train_state, step, metrics) or stop_reason
        stop_reason = _early_stop_reason(spec, host, metrics) or stop_reason
        host.summary.update({k: metrics[k] for k in ("train/success", "train/return") if k in metrics})
        if loop.step_callback is not None:
            try:
                loop.step_callback(step, metrics)
            except StopTraining:
                stop_reason = "interrupted by callback"
        # A stopped run always saves its last step, so a resume continues exactly where it ended.
        if step % t.save_every == 0 or step == t.total_steps or stop_reason:
            loop.ckpt.save(step, saved_part(train_state), host.meta(step))
            in_flight = pipeline.state_dict() if pipeline is not None else None
            if in_flight is not None:  # the batches in flight, for an exact resume
                pipeline.checkpointer.save(step, *in_flight)
        if bar is not None:
            bar.set_postfix(_progress_fields(metrics))
        if stop_reason:
            break
    if bar is not None:
        bar.close()
    if pipeline is not None:
        pipeline.checkpointer.close()
    return step, stop_reason


def _start_pipeline(loop: Loop, train_state, start_step: int, base_key) -> RolloutPipeline:
    """The asynchronous run's pipeline; a resumed run launches again what its checkpoint had in flight."""
    t = loop.spec.trainer
    # Where the run keeps what it has in flight at each checkpoint, for an exact resume.
    ckpt = Checkpointer(Path(loop.spec.workdir) / "checkpoints_pipeline", keep=t.keep_checkpoints,
                        placement=loop.run.placement)
    pipeline = RolloutPipeline(loop.run, t.max_staleness, base_key, t.total_steps, checkpointer=ckpt)
    if start_step == 0 or start_step >= t.total_steps:
        return pipeline
    if start_step in ckpt.all_steps():
        try:  # the meta names the versions in flight, which give the arrays' structure
            meta = ckpt.read_meta(start_step)
            arrays, meta, _ = ckpt.restore(pipeline.like(train_state, meta), start_step)
        except Exception as e:  # noqa: BLE001 - a damaged part costs only exactness, and the note says so
            meta = {"error": f"{type(e).__name__}: {e}"}
        if meta.get("in_flight") and meta["in_flight"][0][0] == start_step + 1:
            pipeline.resume(arrays, meta, train_state)
            return pipeline
    if loop.run.placement.is_main:
        print(f"note: checkpoint {start_step} holds no batches in flight for the asynchronous rollout; the "
              f"pipeline starts afresh, so the next {t.max_staleness} steps train on fresher batches than an "
              "uninterrupted run would")
    return pipeline


def starpo_step(run: Setup, train_state, key: jax.Array, group_size: int, seq_len_multiple: int = 0,
                dynamic_sampling_rounds: int = 0, analyse_gradients: bool = False,
                start_replay: StartReplay | None = None, sampled=None):
    """One StarPO iteration: rollout with the current policy, then the compiled update.

    ``seq_len_multiple`` > 0: the update sees the batch cut to its longest row, rounded up to a
    multiple of it (``starpo.seq_len_multiple``); in limited context its per-turn rows are cut to
    the widest window the same way (one compiled update per width). ``dynamic_sampling_rounds`` > 0:
    DAPO's dynamic sampling refills the batch with informative groups (``starpo.dynamic_sampling``);
    the ``train/*`` statistics stay those of the step's first rollout (the policy as it plays).
    ``analyse_gradients``: run ``run.gradient_analysis`` on the batch before the update (its
    ``grad_norm*/`` metrics join the step's; timed as ``timing_s/gradient_analysis``).
    ``start_replay``: some groups replay unsolved starts from its queue, and this rollout's unsolved
    groups join it (``starpo.start_replay``; logged as ``rollout/replayed_*``). ``sampled``: the
    step's batch, already sampled (``training.pipeline``: by an earlier policy, on the update's
    devices); then no rollout runs here and ``timing_s/rollout`` is what reading its statistics took.

    Returns ``(train_state, trajectory, metrics)``: ``train/*`` episode statistics of the rollout,
    the update's metrics (MI-proxy keys only on steps that computed them) and ``timing_s/*``.
    """
    t0 = time.time()
    params = policy_params(train_state)
    sampling_metrics = {}
    if sampled is not None:
        traj = sampled
    elif start_replay is None:
        traj = run.rollout(params, key)
    else:
        traj, sampling_metrics = _rollout_with_replay(run, params, key, group_size, start_replay)
    rollout_stats = run.placement.fetch(_episode_statistics(run.placement, group_size)(traj))
    if dynamic_sampling_rounds:
        traj, refill_metrics = dynamic_sampling.refill(run.rollout, params, key, traj, group_size=group_size,
                                                         max_rounds=dynamic_sampling_rounds, placement=run.placement)
        sampling_metrics.update(refill_metrics)
        if refill_metrics["rollout/dynamic_sampling_rounds"]:  # the widths of the batch that trains
            trained = run.placement.fetch(_episode_statistics(run.placement, group_size)(traj))
            rollout_stats = dict(rollout_stats, **{k: trained[k] for k in ("sequence_length_max", "window_length_max")
                                                   if k in trained})
    t1 = time.time()
    width, row_width = update_widths(rollout_stats, traj.seq_len, run.rollout.per_turn_rows, seq_len_multiple)
    if width < traj.seq_len:
        traj = _trim_program(run.placement, width)(traj)
    update = run.update
    if row_width is not None and row_width < run.rollout.per_turn_rows[1]:
        update = run.update_on_rows(row_width)
    analysis = {}
    if analyse_gradients and run.gradient_analysis is not None:  # before the update donates the state
        t_a = time.time()
        analysis = to_host_scalars(run.placement.fetch(run.gradient_analysis(train_state, traj)))
        analysis["timing_s/gradient_analysis"] = time.time() - t_a
        t1 += analysis["timing_s/gradient_analysis"]  # not part of the update's time
    train_state, update_metrics = update(train_state, traj)
    update_metrics = _drop_uncomputed(to_host_scalars(run.placement.fetch(update_metrics)))
    t2 = time.time()
    metrics = {f"train/{k}": float(v) for k, v in rollout_stats.items()}
    metrics.update(update_metrics)
    metrics.update(sampling_metrics)
    metrics.update(analysis)
    metrics["train/update_seq_len"] = float(width)  # the transcript width the update ran on
    if row_width is not None:
        metrics["train/update_row_width"] = float(row_width)  # and its per-turn rows' width
    take_counters = getattr(run.env, "take_counters", None)  # a Python env's events (the code sandbox's)
    if callable(take_counters):
        metrics.update({f"env/{k}": float(v) for k, v in take_counters().items()})
    metrics["timing_s/rollout"] = t1 - t0
    metrics["timing_s/update"] = t2 - t1
    metrics["timing_s/step"] = t2 - t0
    metrics["timing_s/tokens_per_s"] = float(rollout_stats["sampled_tokens"]) / max(t1 - t0, 1e-9)
    return train_state, traj, metrics


def _rollout_with_replay(run: Setup, params, key: jax.Array, group_size: int, replay: StartReplay):
    """The step's first rollout with some starts from the unsolved-start queue; the rollout's unsolved
    groups join the queue. -> ``(trajectory, rollout/replayed_* metrics)``."""
    group_keys, uses, replayed = replay.starts(key, run.rollout.config.num_groups)
    _, sample_key = jax.random.split(key)  # the sampling key ``rollout(params, key)`` would use
    traj = run.rollout.from_starts(params, group_keys, sample_key)
    # Every episode of the group succeeded (a collective: every process fetches the whole batch's [B]).
    solved = np.asarray(run.placement.fetch(traj.success), bool).reshape(-1, group_size).all(axis=1)
    replay.record(group_keys, uses, solved)
    return traj, {"rollout/replayed_groups": float(replayed),
                  "rollout/replayed_groups_solved": float(solved[:replayed].sum()),
                  "rollout/start_replay_queue": float(len(replay.keys))}


def _analyses_gradients(every: int, step: int) -> bool:
    """RAGEN's cadence: the first StarPO step, then every ``every`` steps after it (1, 1 + N, ...)."""
    return bool(every) and step >= 1 and (step - 1) % every == 0


def update_widths(rollout_stats: dict, seq_len: int, per_turn_rows: tuple[int, int] | None,
                  multiple: int) -> tuple[int, int | None]:
    """``(transcript width, per-turn row width)`` the update needs for a batch with these
    ``rollout_metrics``: the longest row, and in limited context (``per_turn_rows`` = ``(preamble,
    full row width)``) the preamble plus the widest turn window, each rounded up to a multiple of
    ``multiple`` (0: the full widths). The row width is None in full context."""
    width = trimmed_width(rollout_stats["sequence_length_max"], seq_len, multiple)
    if per_turn_rows is None:
        return width, None
    preamble, full_rows = per_turn_rows
    return width, trimmed_width(preamble + rollout_stats["window_length_max"], full_rows, multiple)


@functools.lru_cache(maxsize=None)
def _trim_program(placement, width: int):
    """``trim(traj, width)`` as a program on the mesh (rows stay where they are)."""
    return placement.jit(functools.partial(trim, width=width))


@functools.lru_cache(maxsize=None)
def _episode_statistics(placement, group_size: int):
    """``rollout_metrics`` of the whole (global) batch as one program with replicated results."""
    return jax.jit(functools.partial(rollout_metrics, group_size=group_size), out_shardings=placement.replicated)


def _prepare_workdir(spec: RunSpec, placement) -> bool:
    """``prepare_training_workdir`` on the main process; every process learns whether to resume.

    Only one process may move a workdir aside or write its config.json; the others wait for its
    verdict (a refusal stops every process, the reason printed by the main one).
    """
    verdict, error = 0, None
    if placement.is_main:
        try:
            resume, notes = prepare_training_workdir(spec)
            for note in notes:
                print(f"note: {note}")
            verdict = 1 if resume else 0
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other processes heard of it
            verdict, error = 2, e
    verdict = int(placement.broadcast(np.int32(verdict)))
    if error is not None:
        raise error
    if verdict == 2:
        raise ConfigError(f"process 0 refused the workdir {spec.workdir!r} (its message says why)")
    placement.sync("workdir prepared")
    return verdict == 1


def _make_evaluator(spec: RunSpec, run: Setup):
    t = spec.trainer
    if not (t.eval_every or t.eval_before_train):
        return None
    return Evaluator(run.graphdefs.policy, run.env, run.env_params, run.tokenizer, spec.rollout, spec.eval,
                     chunk_rows=spec.eval.chunk_rows or spec.rollout.batch_size, placement=run.placement)


def _resume(spec: RunSpec, run: Setup, ckpt: Checkpointer):
    """``(train_state, host, step)`` from the newest intact checkpoint (damaged ones are skipped),
    restored into this run's layout whatever mesh wrote it."""
    restored = restore_train_state(ckpt, run.train_state, spec.config)
    train_state, meta, step = restored.train_state, restored.meta, restored.step
    if run.placement.is_main:
        for bad, reason in restored.skipped:
            print(f"warning: checkpoint {ckpt.directory}/{bad} is damaged and was skipped "
                  f"(moved to {ckpt.directory}.damaged/): {reason}")
        print(f"resumed from {ckpt.directory}/{step}")
    # Buffers of its own, in the update's layout: the update donates its input state.
    own = jax.jit(lambda s: jax.tree.map(jnp.copy, s), out_shardings=run.state_shardings)
    return own(train_state), HostState.from_meta(meta, spec), step


def _warm_up_and_validate(loop: Loop, train_state):
    """A new run: behaviour cloning (when configured; restored when ``warmup.cache_dir`` holds this
    config's), then the "after warm-up" validation at step 0."""
    spec, run, host, logger = loop.spec, loop.run, loop.host, loop.logger
    w = spec.warmup
    warms = w.steps > 0 or w.single_turn_steps > 0
    # The cache is keyed by the whole resolved config (what the run saves), so it keeps the ConfigDict.
    cache = WarmupCache(w.cache_dir, spec.config) if warms and w.cache_dir else None
    cached = cache.load(train_state.params) if cache is not None else None
    if cached is not None:
        params, warm_summary = cached.params, cached.summary
        if run.placement.is_main:
            print(f"warm-up restored from {cache.path}")
    elif warms:
        limit_s = 60.0 * spec.trainer.time_limit_minutes
        # warmup.time_share: the warm-up's part of the run's time limit, so RL keeps the rest.
        deadline = loop.clock[0] + w.time_share * limit_s if w.time_share > 0 and limit_s > 0 else None
        params, warm_summary = run_warmup(run.warmup_rollout, train_state.params, w,
                                          log_fn=logger.scalars, progress=spec.trainer.progress_bar,
                                          frozen=frozen_base(train_state), deadline=deadline)
    if warms:
        train_state = train_state.replace(params=params)
        if train_state.ref_params is not None:  # the KL reference is the warmed-up policy
            train_state = train_state.replace(ref_params=jax.tree.map(jnp.copy, params))
        # Back in the update's layout (the BC steps leave their outputs where XLA put them).
        train_state = run.placement.put(train_state, run.state_shardings)
        logger.scalars(0, warm_summary)
        host.summary.update(warm_summary)
    validation = None
    if loop.evaluator is not None and spec.trainer.eval_before_train:
        validation = cached.validation if cached is not None else None
        if validation is None:
            validation = loop.evaluator.evaluate(policy_params(train_state), 0, loop.transcripts)
        val, puzzles = validation
        logger.scalars(0, val)
        _record_validation(host, 0, val, puzzles)
        host.history["warmup_val"] = val["val/success"]
        host.summary["val/success_before_rl"] = val["val/success"]
    if cache is not None and (cached is None or (validation is not None and cached.validation is None)):
        cache.save(train_state.params, warm_summary, validation, cached.stored if cached is not None else None)
    return train_state


def _steps(spec: RunSpec, start_step: int, show: bool = True):
    """The StarPO steps still to run, and the progress bar over them (None when switched off)."""
    t = spec.trainer
    steps = range(start_step + 1, t.total_steps + 1)
    if not (t.progress_bar and show):
        return steps, None
    bar = tqdm(steps, desc=f"StarPO {spec.env_name}", initial=start_step, total=t.total_steps)
    return bar, bar


def _track(spec: RunSpec, host: HostState, step: int, metrics: dict) -> None:
    """Advance the early-stop signals (their ``early_stop/*`` values join ``metrics``) and the curves."""
    mi, ce, computed = _mi_values(metrics)
    metrics.update(host.early.update(consecutive_empty=int(metrics["rollout/consecutive_empty_after_filter_steps"]),
                                     reward_std=metrics["train/in_group_reward_std"],
                                     episode_return=metrics["train/return"], mi=mi))
    host.history["train"].append([step, metrics["train/success"]])
    host.history.setdefault("timing", []).append(
        [step, metrics["timing_s/rollout"], metrics["timing_s/update"], metrics.get("rollout/filter_kept_ratio", 1.0)])
    if computed and ce is not None:
        host.history["quadrant"].append([step, float(mi), float(ce)])


def _log_step(loop: Loop, step: int, metrics: dict, traj) -> None:
    """TensorBoard: the step's scalars, the MI quadrant when it moved, a sample transcript."""
    spec, host, logger = loop.spec, loop.host, loop.logger
    t = spec.trainer
    if step % t.log_every == 0:
        logger.scalars(step, metrics)
    if _mi_values(metrics)[2] and host.history["quadrant"]:
        q = np.asarray(host.history["quadrant"])
        nb = max(1, min(len(q), spec.collapse.baseline_steps))
        logger.image(step, "collapse/quadrant", quadrant_figure(q, (q[:nb, 1].mean(), q[:nb, 2].mean()),
                                                                spec.collapse.regime_mi_ratio,
                                                                spec.collapse.regime_entropy_ratio))
    if t.transcript_every and step % t.transcript_every == 0:
        tokens, valid = loop.run.placement.fetch((traj.tokens, traj.valid_mask))  # a collective: every process
        logger.text(step, "transcripts/train", codec_lib.decode(loop.run.tokenizer, tokens[0][valid[0]]))


def _validate(loop: Loop, train_state, step: int, metrics: dict) -> str | None:
    """Validation on the fixed puzzles; returns a stop reason when ``trainer.stop_on_success`` is met."""
    threshold = loop.spec.trainer.stop_on_success
    val, puzzles = loop.evaluator.evaluate(policy_params(train_state), step, loop.transcripts)
    loop.logger.scalars(step, val)
    metrics.update(val)
    _record_validation(loop.host, step, val, puzzles)
    if threshold and val["val/success"] >= threshold:
        return f"validation success {val['val/success']:.3f} >= {threshold}"
    return None


def _record_validation(host: HostState, step: int, val: dict, puzzles: np.ndarray) -> None:
    """The validation curve, and each puzzle's success (what paired comparisons of runs need)."""
    host.history["val"].append([step, val["val/success"]])
    host.history.setdefault("val_puzzles", []).append([step, [float(x) for x in puzzles]])


def _early_stop_reason(spec: RunSpec, host: HostState, metrics: dict) -> str | None:
    """The last of the switched-on early-stop signals that fired this step (None when none did)."""
    t = spec.trainer
    reason = None
    if t.stop_on_empty_filter and host.early.consecutive_empty >= spec.filter.empty_stop_steps:
        reason = f"{host.early.consecutive_empty} consecutive empty batches after the SNR filter"
    if t.stop_on_reward_collapse and metrics["early_stop/reward_variance_collapse"]:
        reason = "reward-variance collapse"
    if t.stop_on_mi_collapse and metrics["early_stop/mi_collapse"]:
        reason = (f"MI collapse (MI below {t.mi_collapse_ratio} x its baseline for {t.mi_collapse_window} computations"
                  + (" while the return plateaus)" if t.mi_collapse_needs_plateau else ")"))
    return reason


def _progress_fields(metrics: dict) -> dict[str, str]:
    mi = _mi_values(metrics)[0]
    return {"success": f"{metrics['train/success']:.2f}", "reward": f"{metrics['train/return']:.2f}",
            "MI": "-" if mi is None else f"{mi:.3f}", "tok_s": f"{metrics['timing_s/tokens_per_s']:.0f}"}


def _finish(loop: Loop, step: int, stop_reason: str | None, write: bool = True) -> dict[str, Any]:
    """Summary (also ``summary.json``), the learning curve image and the console report (``write``:
    this process is the one that writes them; every process returns the summary)."""
    spec, clock = loop.spec, loop.clock
    workdir = Path(spec.workdir)
    summary, history = loop.host.summary, loop.host.history
    summary["steps"] = float(step)
    summary["seconds"] = time.time() - clock[0]
    # CPU time of this process (all threads): on a shared machine, wall time alone misleads.
    summary["cpu_seconds"] = time.process_time() - clock[1]
    if history["val"]:
        summary["val/success_final"] = history["val"][-1][1]
        summary["val/success_best"] = max(v for _, v in history["val"])
    summary.update(gain_over_warmup(history))
    if write:
        loop.logger.image(step, "curves/learning_curve", save_learning_curve(workdir / "learning_curve.png", history))
        (workdir / "summary.json").write_text(json.dumps({"summary": summary, "stop_reason": stop_reason,
                                                          "history": history}, indent=1))
        print(_console_summary(spec, summary, stop_reason, workdir))
    return {"summary": summary, "stop_reason": stop_reason, "history": history}


def gain_over_warmup(history: dict) -> dict:
    """What RL added: the last validation's success minus the one before RL (step 0, after the
    warm-up), puzzle by puzzle on the same fixed puzzles, with its standard error and the paired
    sign-flip p-value of the mean difference (``paired.sign_flip_p``). Empty without both."""
    puzzles = history.get("val_puzzles") or []
    before = next((v for step, v in puzzles if step == 0), None)
    if before is None or len(puzzles) < 2 or puzzles[-1][0] == 0 or len(puzzles[-1][1]) != len(before):
        return {}
    d = np.asarray(puzzles[-1][1], np.float64) - np.asarray(before, np.float64)
    diff, se = mean_se(d)
    return {"val/gain_over_warmup": diff, "val/gain_over_warmup_se": se, "val/gain_over_warmup_p": sign_flip_p(d),
            "val/gain_over_warmup_puzzles": float(d.size)}


def _warn_about_step(spec: RunSpec, step: int, metrics: dict, summary: dict, bar) -> None:
    """Console warnings for what the metrics only show: skipped updates, truncated episodes."""
    skipped = int(metrics.get("train/nonfinite_grad_skipped", 0))
    if skipped:
        total = int(metrics.get("train/nonfinite_grad_skipped_total", skipped))
        _console_warning(bar, f"warning: step {step}: {skipped} optimizer step(s) skipped for a non-finite "
                              f"gradient ({total} in this run); the weights were left as they were. If this "
                              "repeats, lower starpo.actor_lr / critic_lr or check the rewards "
                              "(train/nonfinite_grad_skipped in TensorBoard)")
    truncated = metrics.get("train/truncated", 0.0)
    if truncated > 0 and not summary.get("train/truncated_first_step"):  # once per run
        summary["train/truncated_first_step"] = float(step)
        _console_warning(bar, f"warning: step {step}: {truncated:.0%} of the episodes were cut short: their "
                              f"next turn would not fit rollout.max_seq_len={spec.rollout.max_seq_len} (system "
                              "prompt + every turn so far + one more user block and reply). Raise "
                              "rollout.max_seq_len; train/truncated in TensorBoard tracks the fraction")


def _console_warning(bar, msg: str) -> None:
    """Print ``msg`` above the progress bar (when there is one) rather than through it; with
    several processes only the main one prints."""
    if jax.process_index() != 0:
        return
    if bar is not None:
        bar.write(msg)
    else:
        print(msg)


def _console_summary(spec: RunSpec, summary: dict, stop_reason: str | None, workdir: Path) -> str:
    lines = [f"== {spec.env_name} / {spec.preset}: {int(summary.get('steps', 0))} steps in "
             f"{summary.get('seconds', 0.0):.0f} s wall, {summary.get('cpu_seconds', 0.0):.0f} s CPU"
             + (f" (stopped: {stop_reason})" if stop_reason else "")]
    for key, label in (("warmup/expert_success", "expert success in demonstrations"),
                       ("warmup/single_turn_steps", "warm-up first-turn steps run"),
                       ("warmup/reading_accuracy", "warm-up held-out board reading"),
                       ("warmup/final_loss", "warm-up final BC loss"),
                       ("val/success_before_rl", "validation success before RL"),
                       ("val/success_final", "validation success, final"),
                       ("val/success_best", "validation success, best"),
                       ("warmup/seconds", "warm-up seconds"),
                       ("train/success", "training success, last step")):
        if key in summary:
            value = f"{int(summary[key])}" if key.endswith(("_steps", "seconds")) else f"{summary[key]:.3f}"
            lines.append(f"   {label:<36} {value}")
    if "val/gain_over_warmup" in summary:
        se = summary["val/gain_over_warmup_se"]
        lines.append(f"   {'what RL added over the warm-up':<36} {summary['val/gain_over_warmup']:+.3f}"
                     + ("" if math.isnan(se) else f" +/- {se:.3f}")
                     + f" on {int(summary['val/gain_over_warmup_puzzles'])} puzzles (paired sign-flip "
                     f"p = {summary['val/gain_over_warmup_p']:.2g})")
    if summary.get("warmup/stopped_by_time"):
        lines.append("   the warm-up stopped at its share of the time limit (warmup.time_share)")
    lines.append(f"   logs: {workdir / 'tensorboard'}   checkpoints: {workdir / 'checkpoints'}")
    return "\n".join(lines)
