"""The StarPO step's sections: ``config.starpo``, ``config.filter`` and ``config.collapse``.

Field names are the ml-collections keys of each section. Build them with ``from_dict`` (e.g.
``StarPOConfig.from_dict(cfg.starpo)``): an unknown key fails with the key and the allowed fields,
and every algorithm name is checked against the registry that implements it, so the error lists
the values that actually exist. Defaults are the original's; the SNR filter is off by
default (top-p 1.0, keep every group).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ragen_jax.config.checks import Section, check, check_int, check_number
from ragen_jax.starpo import advantages, losses, snr_filter

CRITIC_MODES = ("auto", "none", "shared", "separate")
LR_SCHEDULES = ("constant", "cosine")
LOGPROBS_AT = ("loss_tokens", "every_position")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class StarPOConfig(Section):
    """The update step: advantages, PPO loss, optimisation.

    Advantages: ``adv_estimator`` (registry ``ADVANTAGE_ESTIMATORS``: gae, bilevel_gae, grpo, drgrpo);
      ``norm_adv_by_std=False`` with ``grpo`` is Dr. GRPO (the original's ``norm_adv_by_std_in_grpo``;
      it only affects ``grpo``);
      ``whiten`` None = the estimator's default (GAE family whitened, GRPO family not);
      ``reward_norm`` / ``reward_norm_grouping`` normalise episode scores before the estimator, and
      the (normalised) episode score is credited at the last sampled token (the original's default);
      ``use_turn_scores=True`` instead keeps each turn's reward at that turn's last token (format
      penalties included), which needs ``reward_norm='identity'``;
      ``length_weighting``: GRPO length weight.
    Loss: ``policy_loss`` (registry ``POLICY_LOSSES``), PPO clip ``clip_ratio_low/high`` and dual clip
      ``clip_ratio_c``; ``entropy_coeff``; KL as a loss term (``use_kl_loss``, ``kl_coef``, ``kl_type``;
      ``kl_coef`` weighs it only while ``use_kl_loss`` is on)
      and/or in the reward (``kl_in_reward``, fixed coefficient ``kl_in_reward_coef``);
      ``loss_agg_mode`` (registry ``LOSS_AGGREGATIONS``), exact across micro-batches.
    Batching: ``ppo_epochs`` passes over the batch; per epoch the batch is cut into mini-batches of
      ``mini_batch_size`` trajectories, or into ``num_mini_batches`` (set at most one; neither = 32
      trajectories); each optimizer step accumulates gradients over micro-batches of
      ``micro_batch_size`` trajectories (None = the whole mini-batch at once). Micro-batching changes
      memory, never the result. ``shuffle`` permutes rows each epoch (the original does not).
    Optimisation: AdamW (``actor_lr``, ``critic_lr``, ``weight_decay``, ``adam_b1/b2/eps``) with a
      linear warm-up over ``warmup_steps`` optimizer steps, then ``lr_schedule`` = constant | cosine
      (decay to ``min_lr_ratio`` × lr over ``lr_decay_steps`` optimizer steps, as verl's cosine
      warm-up style), global-norm clipping at ``grad_clip``.
    Critic: ``critic`` = auto (a separate critic when the estimator needs one, else none) | none |
      shared (a value head on the policy's hidden states; the value loss does not reach the trunk) |
      separate (its own Decoder + value head); ``cliprange_value`` clips the value update.
    ``logprob_chunk_size``: positions per chunk when computing log-softmax over the vocabulary, so
      ``[B, L, V]`` logits are never materialised at once.
    ``seq_len_multiple``: 0 = the update sees rows of the rollout's full width (``rollout.max_seq_len``);
      N > 0 = the trainer first cuts the batch's padding past its longest row, keeping a multiple of
      N positions, and in limited context cuts the per-turn rows (``rollout.cache_len`` wide) to the
      widest turn window the same way (same result, less work when replies are short against a
      loose static bound; one compiled update per distinct width, so keep N coarse). Not with
      a ``*-token-sum-norm`` ``loss_agg_mode``, whose constant normaliser is the row width.
    GiGPO: ``gigpo_step_weight`` (w), ``gigpo_gamma`` (the turn returns' discount), ``gigpo_norm``
      (mean | std) — see ``advantages.gigpo``; ``gigpo_enable_similarity`` / ``gigpo_similarity_thresh``:
      verl-agent's grouping of similar observations (``advantages.cluster_similar_observations``). Policy-loss settings: ``clip_cov_*``, ``kl_cov_ratio``,
      ``ppo_kl_coef``, ``rollout_is*`` / ``rollout_rs*``, ``decoupled_weight_cap`` (see ``losses``); a sequence-level loss
      (gspo, geo_mean) aggregates ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says.
    DAPO: ``overlong_buffer_len`` > 0 shapes each turn's reward by its reply length (soft overlong
      punishment against ``overlong_max_len``, default ``rollout.max_new_tokens``);
      ``overlong_filter`` keeps episodes that were cut off (a reply without a stop, or the
      transcript full) out of the update.
    ``logprob_temperature``: the policy, reference and ratio are scored as ``softmax(logits / T)``
      (verl's convention), so the PPO ratio compares against the distribution the rollout sampled
      from; None = the rollout's ``temperature`` (resolved by the trainer's configuration), 1 for a
      caller that builds the update alone.
    ``logprobs_at``: where the update computes log-probs and entropies. ``loss_tokens`` (default):
      only at the tokens the loss reads (the replies; at most ``rollout.max_new_tokens`` per turn),
      the LM head run on those positions alone — the same values there at a fraction of the head's
      cost; positions the loss does not read hold 0. ``every_position``: every position of every
      row, as RAGEN and verl do. A deviation in cost only; the trainer passes the reply budget
      (``make_update_step(reply_tokens=...)``), without which every position is scored.
    ``keep_frozen_residual``: with ``model.lora_top_layers`` the scoring pass keeps each row's residual
      stream after the frozen layers ([rows, L, D] activations held through the update) and the loss
      pass starts from it: the same numbers (frozen weights do not move within an update) without a
      second forward through the frozen layers. Off: the loss pass runs the whole model again.
    """

    KEY = "starpo"

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    high_level_gamma: float = 0.95
    norm_adv_by_std: bool = True
    whiten: Optional[bool] = None
    reward_norm: str = "identity"
    reward_norm_grouping: str = "state"
    use_turn_scores: bool = False
    length_weighting: bool = False
    policy_loss: str = "ppo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.001
    use_kl_loss: bool = False
    kl_coef: float = 0.0
    kl_type: str = "kl"
    kl_in_reward: bool = False
    kl_in_reward_coef: float = 0.0
    loss_agg_mode: str = "token-mean"
    ppo_epochs: int = 1
    mini_batch_size: Optional[int] = None
    num_mini_batches: Optional[int] = None
    micro_batch_size: Optional[int] = None
    shuffle: bool = False
    grad_clip: float = 1.0
    actor_lr: float = 1e-6
    critic_lr: float = 1e-5
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    lr_decay_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    critic: str = "auto"
    cliprange_value: float = 0.5
    logprob_chunk_size: int = 256
    logprob_temperature: Optional[float] = None
    logprobs_at: str = "loss_tokens"
    keep_frozen_residual: bool = True
    seq_len_multiple: int = 0
    # GiGPO (adv_estimator='gigpo'): weight of the step term, discount of the turn returns, and the
    # normalisation of both terms: 'mean' (the reference's mean_norm) or 'std' (mean_std_norm).
    gigpo_step_weight: float = 1.0
    gigpo_gamma: float = 0.95
    gigpo_norm: str = "mean"
    # verl-agent's similarity-based step grouping: turns whose observations match with a difflib ratio
    # >= gigpo_similarity_thresh share an anchor group (off: identical observations only).
    gigpo_enable_similarity: bool = False
    gigpo_similarity_thresh: float = 0.95
    # Clip-Cov / KL-Cov (policy_loss='clip_cov' / 'kl_cov'), verl's defaults.
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1  # verl's PolicyLossConfig default (its KL-Cov recipe sets 1.0)
    # policy_loss='rollout_correction' (verl's): importance weights (token | sequence | none), rejection
    # (token | sequence | geometric | none), the veto of sequences with a token whose ratio is below
    # rollout_token_veto_threshold (0 = off) and the weights' batch normalisation.
    rollout_is: str = "token"
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str = "none"
    rollout_rs_threshold: float = 2.0
    rollout_rs_threshold_lower: float = 0.5
    rollout_token_veto_threshold: float = 0.0
    # policy_loss='decoupled_ppo' (AReaL's): tokens whose weight pi_prox / pi_behav exceeds the cap
    # contribute nothing (0 = no cap).
    decoupled_weight_cap: float = 0.0
    # DAPO's overlong reward shaping (0 = off): replies longer than overlong_max_len - overlong_buffer_len
    # tokens lose up to overlong_penalty_factor, linearly over the buffer; overlong_max_len None =
    # rollout.max_new_tokens. overlong_filter: episodes cut by max_seq_len or max_new_tokens do not train.
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    overlong_max_len: Optional[int] = None
    overlong_filter: bool = False

    DEFAULT_MINI_BATCH_SIZE = 32


    def __post_init__(self):
        s = "starpo"
        advantages.ADVANTAGE_ESTIMATORS.validate(self.adv_estimator)
        advantages.REWARD_NORMALIZATIONS.validate(self.reward_norm)
        advantages.REWARD_GROUPINGS.validate(self.reward_norm_grouping)
        losses.POLICY_LOSSES.validate(self.policy_loss)
        losses.KL_ESTIMATORS.validate(self.kl_type)
        losses.LOSS_AGGREGATIONS.validate(self.loss_agg_mode)
        for name in ("gamma", "lam", "high_level_gamma"):
            value = getattr(self, name)
            check(
                isinstance(value, (int, float)) and 0.0 <= value <= 1.0,
                f"{s}.{name} must be in [0, 1], got {value!r}.",
            )
        for name in ("clip_ratio_low", "clip_ratio_high", "entropy_coeff", "kl_coef", "kl_in_reward_coef",
                     "weight_decay", "cliprange_value"):
            check_number(s, name, getattr(self, name))
        check_number(s, "clip_ratio_c", self.clip_ratio_c, 1.0, strict=True)
        for name in ("grad_clip", "actor_lr", "critic_lr", "adam_eps"):
            check_number(s, name, getattr(self, name), 0.0, strict=True)
        for name in ("adam_b1", "adam_b2"):
            value = getattr(self, name)
            check(isinstance(value, float) and 0.0 <= value < 1.0, f"{s}.{name} must be in [0, 1), got {value!r}.")
        check_int(s, "ppo_epochs", self.ppo_epochs, 1)
        check_int(s, "warmup_steps", self.warmup_steps, 0)
        check(self.lr_schedule in LR_SCHEDULES,
               f"{s}.lr_schedule={self.lr_schedule!r}; allowed: {', '.join(LR_SCHEDULES)}.")
        check_int(s, "lr_decay_steps", self.lr_decay_steps, 0)
        check(self.lr_schedule != "cosine" or self.lr_decay_steps >= 1,
               f"{s}.lr_schedule='cosine' needs {s}.lr_decay_steps >= 1 (the optimizer steps to decay over; "
               "a StarPO step takes one per kept mini-batch and PPO epoch).")
        check(isinstance(self.min_lr_ratio, (int, float)) and 0.0 <= self.min_lr_ratio <= 1.0,
               f"{s}.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}.")
        check_int(s, "logprob_chunk_size", self.logprob_chunk_size, 1)
        check(self.logprobs_at in LOGPROBS_AT,
              f"{s}.logprobs_at={self.logprobs_at!r}; allowed: {', '.join(LOGPROBS_AT)}.")
        check_int(s, "seq_len_multiple", self.seq_len_multiple, 0)
        self._check_credit_assignment(s)
        check(
            not (self.seq_len_multiple and self.loss_agg_mode.endswith("-token-sum-norm")),
            f"{s}.seq_len_multiple={self.seq_len_multiple} would change the row width that "
            f"{s}.loss_agg_mode={self.loss_agg_mode!r} divides by; set {s}.seq_len_multiple=0 or "
            "use another loss_agg_mode.",
        )
        if self.logprob_temperature is not None:
            check_number(s, "logprob_temperature", self.logprob_temperature, 0.0, strict=True)
        for name in ("mini_batch_size", "num_mini_batches", "micro_batch_size"):
            if getattr(self, name) is not None:
                check_int(s, name, getattr(self, name), 1)
        check(
            self.mini_batch_size is None or self.num_mini_batches is None,
            f"{s}.mini_batch_size={self.mini_batch_size} and {s}.num_mini_batches={self.num_mini_batches} "
            "are both set; set one of them (the other follows from the batch size).",
        )
        check(self.whiten is None or isinstance(self.whiten, bool), f"{s}.whiten must be None, True or False.")
        check(self.critic in CRITIC_MODES, f"{s}.critic={self.critic!r}; allowed: {', '.join(CRITIC_MODES)}.")
        uses_critic = advantages.ADVANTAGE_ESTIMATORS.get(self.estimator).uses_critic
        check(
            not (uses_critic and self.critic == "none"),
            f"{s}.adv_estimator={self.adv_estimator!r} needs a critic but {s}.critic='none'; "
            "use critic='auto', 'shared' or 'separate', or a critic-free estimator (grpo, drgrpo).",
        )
        check(
            uses_critic or self.critic in ("auto", "none"),
            f"{s}.adv_estimator={self.adv_estimator!r} does not use a critic, so {s}.critic={self.critic!r} "
            "would train one for nothing; set critic='auto' or 'none'.",
        )
        check(
            not self.use_turn_scores or self.reward_norm == "identity",
            f"{s}.use_turn_scores=True keeps per-turn rewards, which episode-score normalisation "
            f"cannot rescale; set {s}.reward_norm='identity' or use_turn_scores=False.",
        )


    def _check_credit_assignment(self, s: str) -> None:
        """The settings of GiGPO, the verl policy losses and DAPO's overlong handling."""

        check(self.gigpo_norm in advantages.GIGPO_NORMS,
              f"{s}.gigpo_norm={self.gigpo_norm!r}; allowed: {', '.join(advantages.GIGPO_NORMS)}.")
        check_number(s, "gigpo_step_weight", self.gigpo_step_weight)
        check(isinstance(self.gigpo_gamma, (int, float)) and 0.0 <= self.gigpo_gamma <= 1.0,
               f"{s}.gigpo_gamma must be in [0, 1], got {self.gigpo_gamma!r}.")
        check(isinstance(self.gigpo_enable_similarity, bool), f"{s}.gigpo_enable_similarity must be True or False.")
        check(not self.gigpo_enable_similarity or (isinstance(self.gigpo_similarity_thresh, (int, float))
                                                   and 0.0 < self.gigpo_similarity_thresh < 1.0),
              f"{s}.gigpo_similarity_thresh must be in (0, 1) with gigpo_enable_similarity (as verl-agent asserts), "
              f"got {self.gigpo_similarity_thresh!r}.")
        for name in ("clip_cov_ratio", "kl_cov_ratio", "rollout_is_threshold", "rollout_rs_threshold"):
            check_number(s, name, getattr(self, name), 0.0, strict=True)
        for name in ("clip_cov_lb", "clip_cov_ub", "ppo_kl_coef", "rollout_rs_threshold_lower",
                     "rollout_token_veto_threshold", "overlong_penalty_factor", "decoupled_weight_cap"):
            check_number(s, name, getattr(self, name))
        for name, levels in (("rollout_is", losses.ROLLOUT_IS_LEVELS), ("rollout_rs", losses.ROLLOUT_RS_LEVELS)):
            check(getattr(self, name) in levels, f"{s}.{name}={getattr(self, name)!r}; allowed: {', '.join(levels)}.")
        check(isinstance(self.rollout_is_batch_normalize, bool), f"{s}.rollout_is_batch_normalize must be True or False.")
        check_int(s, "overlong_buffer_len", self.overlong_buffer_len, 0)
        if self.overlong_max_len is not None:
            check_int(s, "overlong_max_len", self.overlong_max_len, 1)
            check(self.overlong_buffer_len <= self.overlong_max_len,
                   f"{s}.overlong_buffer_len={self.overlong_buffer_len} exceeds {s}.overlong_max_len="
                   f"{self.overlong_max_len}; the buffer is the last part of the allowed length.")
        check(isinstance(self.overlong_filter, bool), f"{s}.overlong_filter must be True or False.")

    @property
    def estimator(self) -> str:
        """The registry name actually run (its entry's ``resolve``: ``grpo`` without std scaling is Dr. GRPO)."""
        return advantages.resolved_estimator(self)

    @property
    def actor_loss_agg_mode(self) -> str:
        """The aggregation of the actor objective: ``loss_agg_mode``, or a sequence-level loss's own."""
        return losses.loss_aggregation(self.policy_loss, self.loss_agg_mode)

    @property
    def policy_loss_hparams(self) -> dict:
        """Every policy loss's settings; each registered loss reads the ones it uses."""
        names = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub",
                 "kl_cov_ratio", "ppo_kl_coef", "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize",
                 "rollout_rs", "rollout_rs_threshold", "rollout_rs_threshold_lower", "rollout_token_veto_threshold",
                 "decoupled_weight_cap")
        return {name: getattr(self, name) for name in names}

    @property
    def scoring_temperature(self) -> float:
        """The temperature log-probs are scored at (``logprob_temperature``, 1 when unset)."""
        return 1.0 if self.logprob_temperature is None else float(self.logprob_temperature)

    @property
    def critic_mode(self) -> str:
        """none | shared | separate, with ``auto`` resolved from the estimator."""
        if self.critic != "auto":
            return self.critic
        return "separate" if advantages.ADVANTAGE_ESTIMATORS.get(self.estimator).uses_critic else "none"

    @property
    def uses_reference(self) -> bool:
        """Reference log-probs are needed (a KL term in the loss or in the reward)."""
        return self.use_kl_loss or self.kl_in_reward

    def mini_batch_layout(self, batch_size: int) -> tuple[int, int]:
        """(num_mini_batches, mini_batch_size) for a batch of ``batch_size`` trajectories."""
        if self.num_mini_batches is not None:
            num = self.num_mini_batches
            check(
                batch_size % num == 0,
                f"starpo.num_mini_batches={num} does not divide the batch of {batch_size} trajectories; "
                f"allowed num_mini_batches values: {_divisors(batch_size)}.",
            )
            return num, batch_size // num
        size = min(self.mini_batch_size or self.DEFAULT_MINI_BATCH_SIZE, batch_size)
        check(
            batch_size % size == 0,
            f"starpo.mini_batch_size={size} does not divide the batch of {batch_size} trajectories; "
            f"allowed mini_batch_size values: {_divisors(batch_size)} (or set num_mini_batches).",
        )
        return batch_size // size, size

    def micro_batch_layout(self, mini_batch_size: int) -> tuple[int, int]:
        """(num_micro_batches, micro_batch_size) inside one mini-batch."""
        size = min(self.micro_batch_size or mini_batch_size, mini_batch_size)
        check(
            mini_batch_size % size == 0,
            f"starpo.micro_batch_size={size} does not divide the mini-batch of {mini_batch_size} trajectories; "
            f"allowed micro_batch_size values: {_divisors(mini_batch_size)}.",
        )
        return mini_batch_size // size, size


@dataclasses.dataclass(frozen=True)
class FilterConfig(Section):
    """The SNR filter over groups. Defaults keep every group (top-p 1.0, include_zero).

    ``strategy`` (top_p | top_k | top_k_abs | min_p, registry ``FILTER_STRATEGIES``), ``value`` its
    parameter, ``filter_type`` largest (keep high scores) | smallest, ``include_zero`` keep groups whose
    score is 0, ``top_p_mode`` linear | softmax, ``eps`` the selection slack, ``metric`` the per-group
    score (registry ``GROUP_SCORES``; reward_variance is the group's reward std), ``loss_scaling``
    none | linear | sqrt (scale advantages by the kept ratio), ``empty_stop_steps``: this many
    consecutive updates with nothing left after filtering raise the early-stop signal.
    ``dynamic_sampling_rounds`` (DAPO's dynamic sampling; 0 = off): after the rollout, up to this many
    more rollout rounds refill the batch with groups whose rewards differ, until it holds
    ``rollout.num_groups`` of them (uninformative groups fill what is still missing).
    ``start_replay_fraction`` (unsolved-start replay, a form of Prioritized Level Replay; 0 = off): up to
    this share of each step's groups replay start states that an earlier group did not solve in every
    episode, oldest first; a start is replayed at most ``start_replay_max_uses`` times, and the queue
    keeps the newest ``start_replay_capacity`` (``starpo.start_replay``).
    """

    KEY = "filter"

    strategy: str = "top_p"
    value: float = 1.0
    filter_type: str = "largest"
    include_zero: bool = True
    top_p_mode: str = "linear"
    eps: float = 0.01
    metric: str = "reward_variance"
    loss_scaling: str = "none"
    empty_stop_steps: int = 5
    dynamic_sampling_rounds: int = 0
    start_replay_fraction: float = 0.0
    start_replay_max_uses: int = 2
    start_replay_capacity: int = 256

    def __post_init__(self):
        s = "filter"
        snr_filter.FILTER_STRATEGIES.validate(self.strategy)
        snr_filter.FILTER_TYPES.validate(self.filter_type)
        snr_filter.TOP_P_MODES.validate(self.top_p_mode)
        snr_filter.GROUP_SCORES.validate(self.metric)
        snr_filter.LOSS_SCALINGS.validate(self.loss_scaling)
        check_number(s, "value", self.value)
        check_number(s, "eps", self.eps)
        check(isinstance(self.include_zero, bool), f"{s}.include_zero must be True or False.")
        check_int(s, "empty_stop_steps", self.empty_stop_steps, 1)
        check_int(s, "dynamic_sampling_rounds", self.dynamic_sampling_rounds, 0)
        check_number(s, "start_replay_fraction", self.start_replay_fraction, 0.0, 1.0,
                     what=" (the share of each step's groups that replay unsolved starts; 0 = off)")
        check_int(s, "start_replay_max_uses", self.start_replay_max_uses, 1)
        check_int(s, "start_replay_capacity", self.start_replay_capacity, 1)
        # Settings that would keep no group at all, so every update would be skipped in silence.
        problem = snr_filter.value_problem(self.strategy, self.value)
        check(not problem, f"{s}.value={self.value!r} with {s}.strategy={self.strategy!r} {problem}.")


@dataclasses.dataclass(frozen=True)
class CollapseConfig(Section):
    """Collapse diagnostics, the MI proxy.

    Computed inside the update at global step 1 and every ``compute_freq`` steps on the pre-filter
    batch: ``first_turn_enabled`` / ``trajectory_enabled`` select the two pair samples, each of
    ``num_samples`` reasoning spans. Z-scores divide by ``marginal_std + std_eps`` and by its EMA
    (``ema`` decay). ``micro_batch_size`` [x|z] sequences are scored per forward pass;
    ``max_reasoning_tokens`` bounds Z (None = the trajectory length, which a run's ``resolve`` turns
    into ``rollout.max_new_tokens``: a reasoning never outgrows its reply; longer spans are truncated
    and counted). Regimes are classified against the mean of the first ``baseline_steps`` computations:
    MI is low below ``regime_mi_ratio`` × baseline, H(Z|X) below ``regime_entropy_ratio`` × baseline.
    ``prefix_cache``: encode each prompt once into a KV cache shared by every reasoning scored under
    it (same numbers, far less compute when prompts are long); False scores every [x|z] sequence whole.
    """

    KEY = "collapse"

    compute_freq: int = 5
    num_samples: int = 64
    first_turn_enabled: bool = True
    trajectory_enabled: bool = True
    ema: float = 0.9
    std_eps: float = 1e-3
    baseline_steps: int = 3
    micro_batch_size: int = 128
    max_reasoning_tokens: Optional[int] = None
    regime_mi_ratio: float = 0.5
    regime_entropy_ratio: float = 0.5
    prefix_cache: bool = True


    def __post_init__(self):
        s = "collapse"
        check_int(s, "compute_freq", self.compute_freq, 1)
        check_int(s, "num_samples", self.num_samples, 2)
        check_int(s, "baseline_steps", self.baseline_steps, 1)
        check_int(s, "micro_batch_size", self.micro_batch_size, 1)
        if self.max_reasoning_tokens is not None:
            check_int(s, "max_reasoning_tokens", self.max_reasoning_tokens, 1)
        check(
            isinstance(self.ema, (int, float)) and 0.0 <= self.ema < 1.0,
            f"{s}.ema must be in [0, 1), got {self.ema!r}.",
        )
        check_number(s, "std_eps", self.std_eps, 0.0, strict=True)
        for name in ("regime_mi_ratio", "regime_entropy_ratio"):
            value = getattr(self, name)
            check(
                isinstance(value, (int, float)) and 0.0 < value <= 1.0,
                f"{s}.{name} must be in (0, 1], got {value!r}.",
            )
        for name in ("first_turn_enabled", "trajectory_enabled", "prefix_cache"):
            check(isinstance(getattr(self, name), bool), f"{s}.{name} must be True or False.")
