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

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragen_jax.training.checkpoint import CheckpointMismatch, Checkpointer
from ragen_jax.training.configuration import RunSpec
from ragen_jax.training.logging import Logger, quadrant_figure, to_host_scalars
from ragen_jax.training.metrics import EarlyStop, rollout_metrics

# Update-step metric names (ragen_jax.starpo) the loop reads for early stopping and the progress bar.
MI_KEY = "collapse_first_turn_sample/mi_estimate"
COND_ENT_KEY = "collapse_first_turn_sample/conditional_entropy_est"
REGIME_KEY = "collapse_first_turn_sample/regime"


class StopTraining(Exception):
    """Raised by a step callback to end the run early (the checkpoint of that step is kept)."""


def _policy_params(train_state):
    return train_state.params


def _mi_values(metrics: dict) -> tuple[float | None, float | None, bool]:
    """(MI, H(Z|X), computed-this-step) from the update metrics."""
    computed = bool(metrics.get("collapse/computed", 0.0))
    mi = metrics.get(MI_KEY)
    ce = metrics.get(COND_ENT_KEY)
    if not computed:
        return None, None, False
    return mi, ce, True


def _save_curve(path: Path, history: dict) -> None:
    """Learning curve: training success per step and validation success (with the warm-up mark)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    tr = np.asarray(history.get("train", []), dtype=np.float64).reshape(-1, 2)
    va = np.asarray(history.get("val", []), dtype=np.float64).reshape(-1, 2)
    if len(tr):
        ax.plot(tr[:, 0], tr[:, 1], lw=0.8, alpha=0.35, color="C0", label="train success (one batch)")
        w = min(10, len(tr))
        if w > 1:  # one batch is noisy: show the trend over the last w steps
            smooth = np.convolve(tr[:, 1], np.ones(w) / w, mode="valid")
            ax.plot(tr[w - 1:, 0], smooth, lw=1.5, color="C0", label=f"train success ({w}-step mean)")
    if len(va):
        ax.plot(va[:, 0], va[:, 1], "o-", lw=2, color="C1", label="validation success (fixed puzzles)")
    if history.get("warmup_val") is not None:
        ax.axhline(history["warmup_val"], color="grey", ls="--", lw=1, label="after warm-up only")
    ax.set_xlabel("RL step")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(history.get("title", "StarPO training"))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


@dataclasses.dataclass
class Setup:
    """The compiled pieces of a run (built once by ``setup``)."""

    tokenizer: Any
    model_cfg: Any
    env: Any
    env_params: Any
    graphdefs: Any
    train_state: Any
    rollout: Any
    update: Callable


def setup(spec: RunSpec) -> Setup:
    """Model, env, train state (policy, optional critic), rollout and update step for ``spec``."""
    from ragen_jax.models import Critic, ValueHead
    from ragen_jax.rollout.agent import make_rollout
    from ragen_jax.starpo.update import init_train_state, make_update_step
    from ragen_jax.training.build import build_env, build_model

    cfg = spec.config
    tokenizer, model_cfg, model = build_model(spec)
    env, env_params = build_env(spec)
    mode = spec.starpo.critic_mode
    critic = None
    if mode == "shared":
        critic = ValueHead(model_cfg, rngs=nnx.Rngs(cfg.seed + 2))
    elif mode == "separate":
        critic = Critic(model_cfg, rngs=nnx.Rngs(cfg.seed + 2))
        if spec.preset != "tiny":
            # The critic starts from the same pretrained checkpoint as the policy (spec §5.5).
            nnx.update(critic.trunk, nnx.state(model, nnx.Param))
    graphdefs, train_state = init_train_state(model, spec.starpo, key=jax.random.key(cfg.seed + 1), critic=critic)
    # The update donates its input state: every leaf must own its buffer (init may share one zero).
    train_state = _own_buffers(train_state)
    rollout = make_rollout(graphdefs.policy, env, env_params, tokenizer, spec.rollout)
    # Every rollout row opens with the same system prompt: the update runs it once per batch.
    # Limited context: log-probs are recomputed per turn, on the window each reply was sampled in.
    update = make_update_step(graphdefs, spec.starpo, spec.filter, spec.collapse,
                              group_size=spec.rollout.group_size,
                              shared_prefix_len=len(rollout.codec.preamble_ids),
                              per_turn_rows=rollout.per_turn_rows)
    return Setup(tokenizer, model_cfg, env, env_params, graphdefs, train_state, rollout, update)


def _own_buffers(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree)


def _drop_uncomputed(metrics: dict) -> dict:
    """MI-proxy metrics are zeros on steps where they were not computed: do not log those."""
    if metrics.get("collapse/computed", 0.0):
        return metrics
    return {k: v for k, v in metrics.items()
            if not k.startswith(("collapse_first_turn_sample/", "collapse_trajectory_sample/"))}


def train(spec: RunSpec, step_callback: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
    """Run (or resume) training as configured; returns the final summary metrics.

    ``step_callback(step, metrics)`` runs after each step; raising ``StopTraining`` from it saves a
    checkpoint of that step and ends the run (tests use it to interrupt and resume).
    """
    from ragen_jax.training.evaluate import Evaluator
    from ragen_jax.training.warmup import run_warmup

    from ragen_jax.training.workdir import explain_mismatch, prepare_training_workdir, trim_records

    cfg = spec.config
    t_cfg = cfg.trainer
    workdir = Path(cfg.workdir)
    resume, notes = prepare_training_workdir(cfg)  # refuses to mix runs; writes config.json
    for note in notes:
        print(f"note: {note}")
    t_start, cpu_start = time.time(), time.process_time()

    run = setup(spec)
    tokenizer, rollout, update, train_state = run.tokenizer, run.rollout, run.update, run.train_state
    group_size = spec.rollout.group_size
    evaluator = None
    if t_cfg.eval_every or t_cfg.eval_before_train:
        evaluator = Evaluator(run.graphdefs.policy, run.env, run.env_params, tokenizer, spec.rollout, cfg.eval,
                              chunk_rows=spec.rollout.batch_size)

    logger = Logger(workdir / "tensorboard")
    ckpt = Checkpointer(workdir / "checkpoints", keep=t_cfg.keep_checkpoints)
    early = EarlyStop(baseline_steps=t_cfg.reward_collapse_baseline_steps, window=t_cfg.reward_collapse_window,
                      ratio=t_cfg.reward_collapse_ratio, mi_ratio=t_cfg.mi_collapse_ratio,
                      mi_window=t_cfg.mi_collapse_window, mi_baseline=spec.collapse.baseline_steps)
    history: dict[str, Any] = {"train": [], "val": [], "quadrant": [], "warmup_val": None,
                               "title": f"{spec.env_name} / {spec.preset}"}
    start_step = 0
    summary: dict[str, float] = {}

    def host_state(step: int) -> dict:
        return {"step": step, "early_stop": early.state_dict(), "history": history, "summary": summary}

    transcripts = workdir / "eval" / "transcripts.jsonl" if cfg.eval.write_transcripts else None
    if resume:
        try:
            train_state, meta, start_step, skipped = ckpt.restore_latest_intact(train_state)
        except CheckpointMismatch as e:
            raise CheckpointMismatch(f"{e}. {explain_mismatch(cfg)}") from None
        for bad, reason in skipped:
            print(f"warning: checkpoint {ckpt.directory}/{bad} is damaged and was skipped "
                  f"(moved to {ckpt.directory}.damaged/): {reason}")
        train_state = _own_buffers(train_state)
        early = EarlyStop.from_state_dict(meta["early_stop"])
        history = meta["history"]
        summary = meta.get("summary", {})
        print(f"resumed from {ckpt.directory}/{start_step}")
    if transcripts is not None:  # records of steps after the checkpoint are written again, once
        trim_records(transcripts, start_step if resume else -1)
    if not resume:
        # Warm-up (behaviour cloning), then the "after warm-up" validation on the fixed puzzles.
        if cfg.warmup.steps > 0 or cfg.warmup.single_turn_steps > 0:
            wparams, wsum = run_warmup(rollout, _policy_params(train_state), cfg.warmup,
                                       log_fn=logger.scalars, progress=t_cfg.progress_bar)
            train_state = train_state.replace(params=wparams)
            if train_state.ref_params is not None:  # the KL reference is the warmed-up policy
                train_state = train_state.replace(ref_params=jax.tree.map(jnp.copy, wparams))
            logger.scalars(0, wsum)
            summary.update(wsum)
        if evaluator is not None and t_cfg.eval_before_train:
            vm = evaluator(_policy_params(train_state), 0, transcripts)
            logger.scalars(0, vm)
            history["val"].append([0, vm["val/success"]])
            history["warmup_val"] = vm["val/success"]
            summary["val/success_before_rl"] = vm["val/success"]
        ckpt.save(0, train_state, host_state(0))

    base_key = jax.random.key(cfg.seed)
    steps = range(start_step + 1, t_cfg.total_steps + 1)
    bar = None
    if t_cfg.progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(steps, desc=f"StarPO {spec.env_name}", initial=start_step, total=t_cfg.total_steps)
        steps = bar
    stop_reason = None
    step = start_step
    for step in steps:
        t0 = time.time()
        traj = rollout(_policy_params(train_state), jax.random.fold_in(base_key, step))
        rm = jax.device_get(rollout_metrics(traj, group_size))
        t1 = time.time()
        train_state, um = update(train_state, traj)
        um = _drop_uncomputed(to_host_scalars(jax.device_get(um)))
        t2 = time.time()
        _warn_nonfinite(step, um, bar)
        if rm["truncated"] > 0 and not summary.get("train/truncated_first_step"):
            summary["train/truncated_first_step"] = float(step)
            _console_warning(bar, f"warning: step {step}: {rm['truncated']:.0%} of the episodes were cut short: "
                                  f"their next turn would not fit rollout.max_seq_len={spec.rollout.max_seq_len} "
                                  "(system prompt + every turn so far + one more user block and reply). Raise "
                                  "rollout.max_seq_len; train/truncated in TensorBoard tracks the fraction")
        metrics = {f"train/{k}": float(v) for k, v in rm.items()}
        metrics.update(um)
        metrics["timing_s/rollout"] = t1 - t0
        metrics["timing_s/update"] = t2 - t1
        metrics["timing_s/step"] = t2 - t0
        metrics["timing_s/tokens_per_s"] = float(rm["sampled_tokens"]) / max(t1 - t0, 1e-9)

        mi, ce, computed = _mi_values(um)
        empty = bool(um.get("rollout/empty_after_filter", 0.0))
        metrics.update(early.update(empty=empty, reward_std=float(rm["in_group_reward_std"]),
                                    episode_return=float(rm["return"]), mi=mi))
        history["train"].append([step, float(rm["success"])])
        if computed and ce is not None:
            history["quadrant"].append([step, float(mi), float(ce)])

        if step % t_cfg.log_every == 0:
            logger.scalars(step, metrics)
        if computed and history["quadrant"]:
            q = np.asarray(history["quadrant"])
            nb = max(1, min(len(q), spec.collapse.baseline_steps))
            logger.image(step, "collapse/quadrant", quadrant_figure(q, (q[:nb, 1].mean(), q[:nb, 2].mean())))
        if t_cfg.transcript_every and step % t_cfg.transcript_every == 0:
            row = traj.tokens[0][traj.valid_mask[0]]
            from ragen_jax.rollout import codec as codec_lib

            logger.text(step, "transcripts/train", codec_lib.decode(tokenizer, np.asarray(row)))

        # Out of time: this step is the last, and it gets the final validation.
        out_of_time = bool(t_cfg.time_limit_minutes) and time.time() - t_start >= 60.0 * t_cfg.time_limit_minutes
        if out_of_time:
            stop_reason = f"time limit of {t_cfg.time_limit_minutes:g} min reached"
        if evaluator is not None and t_cfg.eval_every and (step % t_cfg.eval_every == 0 or step == t_cfg.total_steps
                                                           or out_of_time):
            vm = evaluator(_policy_params(train_state), step, transcripts)
            logger.scalars(step, vm)
            metrics.update(vm)
            history["val"].append([step, vm["val/success"]])
            if t_cfg.stop_on_success and vm["val/success"] >= t_cfg.stop_on_success:
                stop_reason = f"validation success {vm['val/success']:.3f} >= {t_cfg.stop_on_success}"

        if t_cfg.stop_on_empty_filter and early.consecutive_empty >= spec.filter.empty_stop_steps:
            stop_reason = f"{early.consecutive_empty} consecutive empty batches after the SNR filter"
        if t_cfg.stop_on_reward_collapse and metrics["early_stop/reward_variance_collapse"]:
            stop_reason = "reward-variance collapse"
        if t_cfg.stop_on_mi_collapse and metrics["early_stop/mi_collapse"]:
            stop_reason = "MI collapse (MI below baseline while reward plateaus)"

        summary.update({k: metrics[k] for k in ("train/success", "train/return") if k in metrics})
        if step_callback is not None:
            try:
                step_callback(step, metrics)
            except StopTraining:
                stop_reason = "interrupted by callback"
        # A stopped run always saves its last step, so a resume continues exactly where it ended.
        if step % t_cfg.save_every == 0 or step == t_cfg.total_steps or stop_reason:
            ckpt.save(step, train_state, host_state(step))
        if bar is not None:
            bar.set_postfix(success=f"{rm['success']:.2f}", reward=f"{rm['return']:.2f}",
                            MI="-" if mi is None else f"{mi:.3f}",
                            tok_s=f"{metrics['timing_s/tokens_per_s']:.0f}")
        if stop_reason:
            break
    if bar is not None:
        bar.close()
    logger.flush()
    logger.close()
    ckpt.close()

    summary["steps"] = float(step)
    summary["seconds"] = time.time() - t_start
    # CPU time of this process (all threads): on a shared machine, wall time alone misleads.
    summary["cpu_seconds"] = time.process_time() - cpu_start
    if history["val"]:
        summary["val/success_final"] = history["val"][-1][1]
        summary["val/success_best"] = max(v for _, v in history["val"])
    _save_curve(workdir / "learning_curve.png", history)
    (workdir / "summary.json").write_text(json.dumps({"summary": summary, "stop_reason": stop_reason,
                                                      "history": history}, indent=1))
    print(_console_summary(spec, summary, stop_reason, workdir))
    return {"summary": summary, "stop_reason": stop_reason, "history": history}


def _warn_nonfinite(step: int, metrics: dict, bar) -> None:
    """Say so on the console when the update skipped optimizer steps for a non-finite gradient."""
    skipped = int(metrics.get("train/nonfinite_grad_skipped", 0))
    if not skipped:
        return
    total = int(metrics.get("train/nonfinite_grad_skipped_total", skipped))
    _console_warning(bar, f"warning: step {step}: {skipped} optimizer step(s) skipped for a non-finite gradient "
                          f"({total} in this run); the weights were left as they were. If this repeats, lower "
                          "starpo.actor_lr / critic_lr or check the rewards (train/nonfinite_grad_skipped in "
                          "TensorBoard)")


def _console_warning(bar, msg: str) -> None:
    """Print ``msg`` above the progress bar (when there is one) rather than through it."""
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
                       ("train/success", "training success, last step")):
        if key in summary:
            value = f"{int(summary[key])}" if key.endswith("_steps") else f"{summary[key]:.3f}"
            lines.append(f"   {label:<36} {value}")
    lines.append(f"   logs: {workdir / 'tensorboard'}   checkpoints: {workdir / 'checkpoints'}")
    return "\n".join(lines)
