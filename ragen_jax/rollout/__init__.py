"""On-device multi-turn agent rollout: prompts, chat framing, codec, parser, the loop, host envs.

    rollout = make_rollout(graphdef, env, env_params, tokenizer, rollout_config)   # ragen_jax.config.RolloutConfig
    trajectory = rollout(params, jax.random.fold_in(key, step))
    rows = turn_rows(trajectory, *rollout.per_turn_rows)   # limited context: one row per turn

Episode metrics of a batch: ``ragen_jax.training.metrics.rollout_metrics``.
"""
from ragen_jax.rollout.carry import ForcedReplies
from ragen_jax.rollout.context import CONTEXT_MODES
from ragen_jax.rollout.loop import Rollout, make_rollout, validation_keys
from ragen_jax.rollout.prompts import build_system_text
from ragen_jax.rollout.chat import ChatFraming, chat_framing
from ragen_jax.rollout.host_env import HostEnv
from ragen_jax.rollout.trajectory import Trajectory
from ragen_jax.rollout.turn_rows import TurnRows, turn_rows

__all__ = [
    "CONTEXT_MODES", "ChatFraming", "ForcedReplies", "HostEnv", "Rollout", "Trajectory",
    "TurnRows", "build_system_text", "chat_framing", "make_rollout", "turn_rows",
    "validation_keys",
]
