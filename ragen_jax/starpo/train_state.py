"""What the trainer, the evaluator and checkpoints need to know about a ``TrainState``
(``starpo.update``) beyond its fields: a LoRA run's state keeps the trained adapters in ``params``
and the frozen pretrained base in ``policy_rest``; the rollout needs both, a checkpoint only the first."""
from __future__ import annotations

from flax import nnx

from ragen_jax.models.lora import has_lora


def policy_params(train_state):
    """The policy's whole state for the rollout and the evaluator: with LoRA the trained adapters
    and the frozen base together (``TrainState.params`` holds the adapters only)."""
    if is_lora(train_state):
        return nnx.merge_state(train_state.params, train_state.policy_rest)
    return train_state.params


def is_lora(train_state) -> bool:
    return has_lora(train_state.params)


def saved_part(train_state):
    """What a checkpoint holds: everything but a LoRA model's frozen base (``policy_rest``), which is
    the pretrained checkpoint itself and is read again from ``model.path`` on resume — checkpoints
    of a LoRA run hold the adapters (and their optimizer state) only."""
    if not is_lora(train_state):
        return train_state
    return train_state.with_policy_rest(None)


def with_base(saved, fresh):
    """A restored ``saved_part`` completed with the base of ``fresh`` (this run's initial state)."""
    if not is_lora(fresh):
        return saved
    return saved.with_policy_rest(fresh.policy_rest)


def frozen_base(train_state):
    """A LoRA run's frozen pretrained base (``policy_rest``), else None."""
    return train_state.policy_rest if is_lora(train_state) else None
