"""Evaluation on fixed validation puzzles: success, pass@k, JSONL transcripts.

The validation set is ``eval.num_episodes`` env reset keys from ``validation_keys(n, seed)`` —
the same puzzles at every evaluation and in every run with the same ``eval.validation_seed``.
Each puzzle is attempted ``eval.pass_k`` times at ``eval.temperature`` (0 = greedy): ``success``
is the mean over all attempts, ``pass@k`` the fraction of puzzles solved at least once.

Each episode is written twice: ``eval/transcripts_*.jsonl`` (the transcript text and its outcome)
and ``eval/messages_*.jsonl``, the same conversation as OpenAI chat messages (``{"messages":
[{"role": "system", ...}, {"role": "user", ...}, {"role": "assistant", ...}, ...]}`` with the
outcome beside it) — what RAGEN's evaluation exports, readable by any chat tool.

``model.provider`` other than ``local`` evaluates a model behind a chat API (``rollout.remote``):
the same validation puzzles, prompts, parser and metrics, plus the API's usage (``api/*``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragen_jax.config import ConfigError
from ragen_jax.models.lora import export_hf
from ragen_jax.rollout import codec as codec_lib
from ragen_jax.rollout.chat import split_conversation
from ragen_jax.rollout.loop import make_rollout, validation_keys
from ragen_jax.rollout.remote import ChatClient
from ragen_jax.starpo.train_state import policy_params
from ragen_jax.training.build import build_env, build_tokenizer
from ragen_jax.training.checkpoint import Checkpointer, NoIntactCheckpoint, restore_train_state
from ragen_jax.training.metrics import describes_state_rates
from ragen_jax.training.run import setup
from ragen_jax.training.workdir import WorkdirLock, check_eval_workdir


class Evaluator:
    """Compiled validation rollouts for one model architecture / env / tokenizer.

    The validation batch is cut into chunks of the training batch size (``chunk_rows`` rows), so
    evaluating 512 puzzles never needs more memory than a training rollout.
    """

    def __init__(self, graphdef, env, env_params, tokenizer, rollout_cfg, eval_cfg, chunk_rows: int,
                 placement=None, remote: ChatClient | None = None):
        self.eval_cfg = eval_cfg
        self.placement = placement
        self.tokenizer = tokenizer
        k = int(eval_cfg.pass_k)
        n = int(eval_cfg.num_episodes)
        groups_per_chunk = max(1, min(n, chunk_rows // k))
        self.num_chunks = -(-n // groups_per_chunk)
        self.groups_per_chunk = groups_per_chunk
        cfg = dataclasses.replace(rollout_cfg, num_groups=groups_per_chunk, group_size=k,
                                  temperature=float(eval_cfg.temperature))
        self.rollout = make_rollout(graphdef, env, env_params, tokenizer, cfg, placement=placement, remote=remote)
        keys = validation_keys(self.num_chunks * groups_per_chunk, int(eval_cfg.validation_seed))
        self.env_keys = jnp.repeat(keys, k, axis=0)  # [chunks * G * k]
        self.num_episodes = n

    def __call__(self, params, step: int, jsonl_path: str | os.PathLike | None = None,
                 messages_path: str | os.PathLike | None = None) -> dict[str, float]:
        """Run every validation puzzle; returns ``val/*`` metrics and optionally writes transcripts
        (``jsonl_path``) and the OpenAI-message export (``messages_path``)."""
        return self.evaluate(params, step, jsonl_path, messages_path)[0]

    def evaluate(self, params, step: int, jsonl_path: str | os.PathLike | None = None,
                 messages_path: str | os.PathLike | None = None) -> tuple[dict[str, float], np.ndarray]:
        """``(val/* metrics, per-puzzle success [num_episodes])``: each puzzle's success averaged over
        its ``pass_k`` attempts — the same puzzles in every run, so two runs (or two steps) compare
        puzzle by puzzle (``ragen_jax.compare``'s paired tests)."""
        t0 = time.time()
        k = int(self.eval_cfg.pass_k)
        rows = self.groups_per_chunk * k
        fields = ("success", "episode_return", "num_turns", "valid_action_rate", "effective_action_rate",
                  "response_length", "truncated")
        columns = {f: [] for f in fields}
        records, failed, describes = [], [], []
        remote = self.rollout.remote
        for c in range(self.num_chunks):
            keys = self.env_keys[c * rows:(c + 1) * rows]
            traj = self.rollout.run(params, keys, jax.random.fold_in(jax.random.key(int(self.eval_cfg.validation_seed)), c))
            # Every process takes part in the gather; only one is given a jsonl_path to write.
            traj = self.placement.fetch(traj) if self.placement is not None else jax.device_get(traj)
            for f in fields:
                columns[f].append(getattr(traj, f))
            if traj.turn_describes_state is not None:
                describes.append((np.asarray(traj.turn_describes_state), np.asarray(traj.turn_mask)))
            errors = dict(remote.errors) if remote is not None else {}
            failed.append(np.asarray([b in errors for b in range(rows)]))
            if jsonl_path is not None or messages_path is not None:
                records.extend(self._records(traj, step, first_puzzle=c * self.groups_per_chunk, errors=errors,
                                             messages=messages_path is not None))
        n = self.num_episodes * k  # drop the padding puzzles of the last chunk
        col = {f: np.concatenate(v)[:n] for f, v in columns.items()}
        s = col["success"].astype(np.float64)
        metrics = {
            "val/success": float(s.mean()),
            f"val/pass_at_{k}": float(s.reshape(-1, k).max(axis=1).mean()),
            "val/return": float(col["episode_return"].mean()),
            "val/num_turns": float(col["num_turns"].mean()),
            "val/valid_action_rate": float(col["valid_action_rate"].mean()),
            "val/effective_action_rate": float(col["effective_action_rate"].mean()),
            "val/response_length": float(col["response_length"].mean()),
            "val/truncated": float(col["truncated"].mean()),
            "timing_s/eval": time.time() - t0,
        }
        if describes:
            rates = describes_state_rates(*(np.concatenate(x)[:n] for x in zip(*describes)))
            metrics.update({f"val/{k}": float(v) for k, v in rates.items()})
        if remote is not None:
            metrics["api/failed_episodes"] = float(np.concatenate(failed)[:n].sum())
        # The transcripts file holds the text, the messages file the same episodes as chat messages.
        for path, drop in ((jsonl_path, "messages"), (messages_path, "transcript")):
            if path is not None:
                write_records(path, records[:n], drop=drop)
        return metrics, s.reshape(-1, k).mean(axis=1)

    def _records(self, traj, step: int, first_puzzle: int, errors: dict[int, str], messages: bool) -> list[dict]:
        """One record per episode; ``messages``: also the conversation as chat messages."""
        k = int(self.eval_cfg.pass_k)
        out = []
        for b in range(traj.tokens.shape[0]):
            ids = traj.tokens[b][traj.valid_mask[b]]
            nt = int(traj.num_turns[b])
            text = codec_lib.decode(self.tokenizer, ids)
            record = {
                "step": int(step),
                "puzzle": first_puzzle + b // k,
                "attempt": b % k,
                "success": bool(traj.success[b]),
                "return": float(traj.episode_return[b]),
                "num_turns": nt,
                "num_actions": int(traj.num_actions[b]),
                "turn_rewards": [float(x) for x in traj.turn_rewards[b][:nt]],
                "transcript": text,
            }
            if messages:
                chat, opening = split_conversation(self.rollout.framing, text)
                if opening:  # a rollout always closes its last reply; kept rather than dropped if not
                    chat.append({"role": "assistant", "content": opening})
                record["messages"] = chat
            if b in errors:
                record["api_error"] = errors[b]
            out.append(record)
        return out


def write_records(path, records: list[dict], drop: str) -> None:
    """Append ``records`` (without their ``drop`` field) to the JSONL file ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({k: v for k, v in r.items() if k != drop}, ensure_ascii=False) + "\n")


def run_eval(spec) -> dict[str, float]:
    """``mode=eval``: restore the latest (or ``eval.checkpoint_step``) checkpoint and evaluate it.

    Without a checkpoint in ``workdir/checkpoints`` the preset's initial model is evaluated (e.g. a
    pretrained Qwen2.5 checkpoint before any RL).
    """
    with WorkdirLock(spec.workdir):  # the evaluation writes its records there: no run alongside
        return _run_eval(spec)


def _run_eval(spec) -> dict[str, float]:
    """``run_eval``'s body, under the workdir's lock."""
    if spec.model.remote:
        return _run_remote_eval(spec)
    for note in check_eval_workdir(spec):  # refuses another env's or model's config
        print(f"note: {note}")

    run = setup(spec)
    params = policy_params(run.train_state)
    ckpt_dir = Path(spec.workdir) / "checkpoints"
    step = 0
    ckpt = Checkpointer(ckpt_dir, keep=spec.trainer.keep_checkpoints) if ckpt_dir.exists() else None
    if ckpt is not None and ckpt.latest_step() is not None:
        params, step = checkpointed_policy(spec.config, run, ckpt, spec.eval.checkpoint_step)
        print(f"evaluating checkpoint step {step} from {ckpt_dir}")
    else:
        print(f"no checkpoint in {ckpt_dir}: evaluating the initial model of preset {spec.preset!r}")
    if ckpt is not None:
        ckpt.close()
    ev = Evaluator(run.graphdefs.policy, run.env, run.env_params, run.tokenizer, spec.rollout, spec.eval,
                   spec.eval.chunk_rows or spec.rollout.batch_size, placement=run.placement)
    main = run.placement.is_main  # with several processes, one writes and prints
    paths = _output_paths(spec, f"step{step}") if main else (None, None)
    metrics = ev(params, step, *paths)
    if main:
        _report(metrics, paths)
    return metrics


def _output_paths(spec, tag: str):
    """``(transcripts, messages)`` JSONL paths under ``workdir/eval`` (old files of the same name removed)."""
    if not spec.eval.write_transcripts:
        return None, None
    out = Path(spec.workdir) / "eval"
    paths = out / f"transcripts_{tag}.jsonl", out / f"messages_{tag}.jsonl"
    for p in paths:
        if p.exists():
            p.unlink()
    return paths


def _report(metrics: dict, paths) -> None:
    width = max(len(k) for k in metrics)
    for k, v in metrics.items():
        print(f"{k:<{width}}  {v:.0f}" if k.startswith("api/") else f"{k:<{width}}  {v:.4f}")
    if paths[0] is not None:
        print(f"transcripts: {paths[0]}\nmessages:    {paths[1]}")


def _run_remote_eval(spec) -> dict[str, float]:
    """``mode=eval`` with ``model.provider`` a chat API: the validation puzzles through the API; the
    summary adds its usage (``api/*``) and is also written to ``workdir/eval/summary_<model>.json``."""
    m = spec.model
    tokenizer = build_tokenizer(spec)
    env, env_params = build_env(spec, tokenizer)
    print(f"evaluating {m.name!r} at {m.api_base_url} ({m.provider} API; transcripts counted in preset "
          f"{spec.preset!r}'s tokens)", flush=True)
    try:
        # A tool environment's schemas go to the API as its ``tools`` (``build_env`` sets them).
        client = ChatClient(m, progress=spec.trainer.progress_bar, tools=getattr(env, "tool_schemas", None))
    except ValueError as e:  # the key's variable is unset: the config's (or the shell's) to fix
        raise ConfigError(str(e)) from None
    try:
        ev = Evaluator(None, env, env_params, tokenizer, spec.rollout, spec.eval,
                       spec.eval.chunk_rows or spec.rollout.batch_size,
                       remote=client)
        tag = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in m.name)
        paths = _output_paths(spec, tag)
        metrics = ev(None, 0, *paths)
    finally:
        client.close()
    u = client.usage
    metrics.update({"api/requests": float(u["requests"]), "api/http_attempts": float(u["attempts"]),
                    "api/failed_requests": float(u["failed_requests"]),
                    "api/prompt_tokens": float(u["prompt_tokens"]),
                    "api/completion_tokens": float(u["completion_tokens"]),
                    "api/cut_replies": float(u["cut_replies"])})
    summary = Path(spec.workdir) / "eval" / f"summary_{tag}.json"
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(json.dumps({"model": m.name, "base_url": client.base_url, "provider": m.provider,
                                   "metrics": metrics}, indent=2))
    _report(metrics, paths)
    print(f"summary:     {summary}")
    return metrics


def checkpointed_policy(cfg, run, ckpt, step=None):
    """``(policy state, step)`` of checkpoint ``step`` (None: the newest intact one, damaged ones
    named and left in place) restored into ``run``'s layout (``checkpoint.restore_train_state``)."""
    try:
        restored = restore_train_state(ckpt, run.train_state, cfg, step, set_aside=False)
    except NoIntactCheckpoint as e:
        if step is None:
            raise
        raise NoIntactCheckpoint(f"eval.checkpoint_step={step}: {e} (leave eval.checkpoint_step unset for the "
                                 "newest)") from None
    for bad, reason in restored.skipped:
        print(f"warning: checkpoint {ckpt.directory}/{bad} is damaged and was skipped: {reason}")
    return policy_params(restored.train_state), restored.step


def run_export(spec) -> str:
    """``config.mode=export``: the policy of the latest checkpoint (adapters merged into the base)
    as an HF checkpoint in ``<workdir>/export`` (``model.safetensors`` + ``config.json``), which
    ``model.path`` — and transformers — load like any other; the tokenizer files are not copied."""
    run = setup(spec)
    ckpt_dir = Path(spec.workdir) / "checkpoints"
    if not ckpt_dir.exists():
        raise NoIntactCheckpoint(f"{ckpt_dir} does not exist: nothing to export (train first, or set "
                                 "config.workdir to a run's directory)")
    ckpt = Checkpointer(ckpt_dir, keep=spec.trainer.keep_checkpoints)
    if not ckpt.all_steps():
        ckpt.close()
        raise NoIntactCheckpoint(f"{ckpt_dir} holds no checkpoint: nothing to export (train this run first, or "
                                 "set config.workdir to the directory of a run that has saved one)")
    params, step = checkpointed_policy(spec.config, run, ckpt)
    ckpt.close()
    model = nnx.merge(run.graphdefs.policy, jax.device_get(params))
    out = export_hf(model, Path(spec.workdir) / "export")
    print(f"exported checkpoint step {step} to {out}")
    return str(out)
