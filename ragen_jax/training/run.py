"""Run assembly: from a resolved ``RunSpec`` to the compiled pieces of a run — the mesh, the model
and environment, the train state laid out on the mesh, the rollout and the update programs. The
trainer (``trainer.py``) and the evaluator (``evaluate.py``) both start from ``setup``."""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable

import jax
from flax import nnx

from ragen_jax.config import ConfigError, RunSpec
from ragen_jax.models import Critic, ValueHead
from ragen_jax.models.lora import merge_lora
from ragen_jax.placement import Placement
from ragen_jax.rollout.host_env import HostEnv
from ragen_jax.rollout.loop import make_rollout
from ragen_jax.starpo.gradient_analysis import make_gradient_analysis
from ragen_jax.starpo.update import init_train_state, make_update_step
from ragen_jax.training.build import build_env, build_model

if TYPE_CHECKING:  # annotations only
    from transformers import PreTrainedTokenizerBase

    from environments.core import EnvParams, Environment
    from ragen_jax.models import ModelConfig
    from ragen_jax.rollout.loop import Rollout
    from ragen_jax.starpo.update import Graphdefs, TrainState


@dataclasses.dataclass
class Setup:
    """The compiled pieces of a run (built once by ``setup``)."""

    tokenizer: PreTrainedTokenizerBase
    model_cfg: ModelConfig
    env: Environment | HostEnv
    env_params: EnvParams | None  # validation's and the warm-up's (``config.env``); None for a host env
    graphdefs: Graphdefs
    train_state: TrainState
    rollout: Rollout  # the StarPO training rollout, on ``train_env_params``
    update: Callable[..., tuple[TrainState, dict]]  # make_update_step's compiled StarPOUpdate
    placement: Placement  # the mesh every array lives on
    state_shardings: Any  # the train state's layout on that mesh, a TrainState of shardings (checkpoints restore into it)
    # The training rollouts' params (``config.train_env`` over ``config.env``; ``env_params`` when unset)
    # and the rollout of ``env_params`` the warm-up draws its demonstrations from (``rollout`` when unset).
    train_env_params: EnvParams | None = None
    warmup_rollout: Rollout | None = None
    # update_on_rows(W): the update with limited-context turn rows W wide (built once per W)
    update_on_rows: Callable[[int], Callable] | None = None
    # gradient_analysis(train_state, trajectory) -> metrics (trainer.gradient_analysis_every)
    gradient_analysis: Callable | None = None
    # The training rollout on the devices of ``mesh.rollout_devices`` (None: colocated, ``rollout``).
    rollout_on_own_devices: Rollout | None = None


def _split_devices(spec: RunSpec) -> tuple[list, list]:
    """``(update devices, rollout devices)``: the last ``mesh.rollout_devices`` run the rollout alone."""
    devices, k = jax.devices(), int(spec.mesh.rollout_devices)
    if not k:
        return devices, []
    if k >= len(devices):
        raise ConfigError(f"mesh.rollout_devices={k} leaves none of the {len(devices)} devices to the update; "
                          "give the rollout fewer (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
                          "makes N devices)")
    update, rollout = devices[: len(devices) - k], devices[len(devices) - k:]
    if jax.process_count() > 1:  # the two sides on disjoint processes, their arrays sent across (placement.send)
        mixed = {d.process_index for d in update} & {d.process_index for d in rollout}
        if mixed or len(update) != len(rollout):
            raise ConfigError(
                f"mesh.rollout_devices={k} over {jax.process_count()} processes of {jax.local_device_count()} devices "
                f"each: in a multi-process run the rollout takes the last processes whole and as many devices as the "
                f"update keeps (half of the {len(devices)}), so set mesh.rollout_devices={len(devices) // 2}"
                + ("" if jax.process_count() % 2 == 0 else " with an even number of processes"))
    return update, rollout


def make_placement(spec: RunSpec):
    """The run's mesh (``config.mesh``) over the devices of every process (less the rollout's own,
    ``mesh.rollout_devices``)."""
    m = spec.mesh
    try:
        placement = Placement.from_shape(int(m.data), int(m.fsdp), int(m.tensor), devices=_split_devices(spec)[0])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    batch, divisor = spec.rollout.batch_size, placement.batch_divisor
    if batch % divisor:
        raise ConfigError(f"rollout.num_groups × rollout.group_size = {batch} trajectories cannot be split over "
                          f"mesh.data × mesh.fsdp = {divisor} devices; make the batch a multiple of {divisor} "
                          "or move devices to mesh.tensor")
    return placement


def rollout_placement(spec: RunSpec) -> Placement | None:
    """The rollout's own mesh (data parallel over ``mesh.rollout_devices``), None when colocated."""
    devices = _split_devices(spec)[1]
    if not devices:
        return None
    placement = Placement.from_shape(-1, 1, 1, devices=devices)
    if spec.rollout.batch_size % placement.batch_divisor:
        raise ConfigError(f"rollout.num_groups × rollout.group_size = {spec.rollout.batch_size} trajectories cannot "
                          f"be split over mesh.rollout_devices = {len(devices)} devices; make the batch a multiple")
    return placement


def _check_env_fits_processes(env, placement) -> None:
    """A host environment (Python in the loop) keeps its episodes in one Python process."""
    if isinstance(env, HostEnv) and placement.num_processes > 1:
        raise ConfigError(f"{type(env).__name__} is a host environment: its episodes live in one Python process, "
                          f"and this run has {placement.num_processes}. Run it in one process (without "
                          "--distributed; several local devices are fine), or use an on-device environment")


def setup(spec: RunSpec, placement=None) -> Setup:
    """Model, env, train state (policy, optional critic), rollout and update step for ``spec``,
    laid out on ``placement`` (default: the mesh of ``config.mesh``)."""
    placement = placement or make_placement(spec)
    tokenizer, model_cfg, model = build_model(spec, placement)
    env, env_params = build_env(spec, tokenizer)
    train_env_params = env.default_params(**spec.train_env_param_kwargs) if spec.train_env_param_kwargs else env_params
    _check_env_fits_processes(env, placement)
    mode = spec.starpo.critic_mode
    critic = None
    # The critic is a plain model (fully trained) even when the policy carries LoRA adapters.
    critic_cfg = model_cfg.replace(lora_rank=0)
    if mode == "shared":
        critic = ValueHead(critic_cfg, rngs=nnx.Rngs(spec.seed + 2))
    elif mode == "separate" and spec.preset == "tiny":
        critic = Critic(critic_cfg, rngs=nnx.Rngs(spec.seed + 2))
    elif mode == "separate":
        # Created in its shards, then started from the same pretrained checkpoint as the policy.
        critic = placement.create(lambda rngs: Critic(critic_cfg, rngs=rngs), seed=spec.seed + 2)
        critic.init_trunk_from(merge_lora(model))
    # Every leaf owns its buffer (init_train_state copies them): the update donates its input state.
    graphdefs, train_state = init_train_state(model, spec.starpo, key=jax.random.key(spec.seed + 1), critic=critic)
    for params in (train_state.params, train_state.critic_params):  # a parameter no rule places is an error
        placement.state_shardings(params, strict=True)
    state_shardings = placement.state_shardings(train_state)
    train_state = placement.put(train_state, state_shardings)
    try:
        rollout = make_rollout(graphdefs.policy, env, train_env_params, tokenizer, spec.rollout, placement=placement)
        warmup_rollout = rollout
        if train_env_params is not env_params:  # the warm-up imitates on validation's distribution
            warmup_rollout = make_rollout(graphdefs.policy, env, env_params, tokenizer, spec.rollout, placement=placement)
    except ValueError as e:  # a context too short for this tokenizer's prompt: the config's to fix

        raise ConfigError(str(e).replace("RolloutConfig.", "rollout.")) from None
    # Every rollout row opens with the same system prompt: the update runs it once per batch.
    # Limited context: log-probs are recomputed per turn, on the window each reply was sampled in.
    def update_on_rows(width: int | None):
        per_turn = rollout.per_turn_rows
        if per_turn is not None and width is not None:
            per_turn = (per_turn[0], width)
        return make_update_step(graphdefs, spec.starpo, spec.filter, spec.collapse,
                                group_size=spec.rollout.group_size,
                                shared_prefix_len=len(rollout.codec.preamble_ids),
                                per_turn_rows=per_turn, placement=placement, state_shardings=state_shardings,
                                reply_tokens=spec.rollout.max_new_tokens)

    analysis = None
    if spec.trainer.gradient_analysis_every:
        analysis = make_gradient_analysis(graphdefs, spec.starpo, spec.filter, group_size=spec.rollout.group_size,
                                          bucketing=spec.trainer.gradient_analysis_buckets,
                                          num_buckets=spec.trainer.gradient_analysis_num_buckets,
                                          shared_prefix_len=len(rollout.codec.preamble_ids),
                                          per_turn_rows=rollout.per_turn_rows, placement=placement)
    own = rollout_placement(spec)
    if own is not None and placement.num_processes > 1:  # on disjoint processes: each fetches through the other
        own.peer, placement.peer = placement.mesh.devices, own.mesh.devices
    rollout_on_own_devices = None if own is None else make_rollout(graphdefs.policy, env, train_env_params, tokenizer,
                                                                   spec.rollout, placement=own)
    return Setup(tokenizer, model_cfg, env, env_params, graphdefs, train_state, rollout, update_on_rows(None),
                 placement, state_shardings, train_env_params, warmup_rollout,
                 functools.lru_cache(maxsize=None)(update_on_rows), analysis, rollout_on_own_devices)
