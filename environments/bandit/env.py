"""RAGEN's two-armed bandit with named arms: one prompt, one answer, one payout.

Each episode shows two arms named after occupations, a low-risk one (pays ``lo_arm_score``, 0.1)
and a high-risk one (pays ``hi_arm_hiscore`` = 1.0 with probability ``hi_arm_hiscore_prob`` = 0.25,
else ``hi_arm_loscore`` = 0.0). The high-risk arm has the higher mean (0.25 against 0.1), so
``success`` means choosing it; the names are the only hint. The pair is drawn uniformly from the
split's list and the two names are shown in random order.

Differences from RAGEN, on purpose:
  * the pair and the order come from the reset key only, so every env of a group (same key) sees the
    same prompt (RAGEN adds a per-instance counter to the seed, which breaks same-prompt groups);
  * actions are indices into ``action_names`` = every name of the split, so an answer maps to an
    action without per-episode tables. A name that is not one of the two shown arms (or an index
    out of range) is an invalid action: no reward, ``action_is_valid=False``, the arms stay the
    same (only the step counter advances) and the episode does not terminate — like RAGEN, which does not step the env on an
    unusable answer. With the default ``max_steps_in_episode=1`` that step truncates the episode
    (a failure); raise the cap to allow retries;
  * the instruction text is this project's own wording of RAGEN's prompt (two arms, names hint at
    the payout distribution, answer with ``<answer> name </answer>``).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from environments import render
from environments.core import EnvParams, EnvState, Environment
from environments.bandit import expert as bandit_expert

# (low-risk, high-risk) arm names per split; the splits share no name.
ARM_PAIRS = {
    "train": (
        ("Teacher", "Trader"), ("Nurse", "StartupFounder"), ("Librarian", "Investor"),
        ("Accountant", "StockBroker"), ("Engineer", "RealEstateAgent"), ("Pharmacist", "Musician"),
        ("Clerk", "Freelancer"), ("Technician", "Youtuber"), ("Planner", "Artist"),
        ("Postman", "Pilot"), ("Banker", "VentureCapitalist"), ("Gardener", "Cryptominer"),
    ),
    "test": (
        ("Receptionist", "Explorer"), ("Archivist", "Filmmaker"), ("Bookkeeper", "Consultant"),
        ("SocialWorker", "Photographer"), ("Mechanic", "GameDesigner"), ("Secretary", "Entrepreneur"),
        ("Cashier", "DataScientist"), ("CivilServant", "StartupAccelerator"),
    ),
}

# The instruction; {a} / {b} are the arms in the order shown. Split into fixed pieces and name
# slots so the device render is a fixed-length piece sequence.
PROMPT = (
    "You are playing a bandit game: pull one of two slot-machine arms and collect its reward.\n"
    "Rules:\n"
    "1. The two arms are named {a} and {b}.\n"
    "2. Each arm pays out from its own reward distribution, and its name hints at that distribution.\n"
    "3. Think about what each name suggests about how risky and how rewarding the arm is.\n"
    "4. Choose the arm you expect to give the higher reward on average, and answer with its name, "
    "either <answer> {a} </answer> or <answer> {b} </answer>.\n"
)


def _prompt_parts() -> tuple[list[str], list[str]]:
    """PROMPT -> (fixed text segments, slot names); len(segments) == len(slots) + 1."""
    segments, slots, rest = [], [], PROMPT
    while "{" in rest:
        head, tail = rest.split("{", 1)
        slot, rest = tail.split("}", 1)
        segments.append(head)
        slots.append(slot)
    segments.append(rest)
    return segments, slots


@chex.dataclass(frozen=True)
class BanditState(EnvState):
    pair: chex.Array      # int32 [] index into the split's pairs
    hi_first: chex.Array  # bool [] whether the high-risk arm is named first


@chex.dataclass(frozen=True)
class BanditParams(EnvParams):
    lo_arm_score: chex.Array         # float32 [] payout of the low-risk arm
    hi_arm_loscore: chex.Array       # float32 [] high-risk payout on a miss
    hi_arm_hiscore: chex.Array       # float32 [] high-risk payout on a hit
    hi_arm_hiscore_prob: chex.Array  # float32 [] probability of a hit


def check_params(params: BanditParams) -> BanditParams:
    """Raise ``ValueError`` on out-of-range concrete parameters (traced ones are skipped)."""
    prob, steps = params.hi_arm_hiscore_prob, params.max_steps_in_episode
    if not isinstance(prob, jax.core.Tracer) and not np.all((np.asarray(prob) >= 0) & (np.asarray(prob) <= 1)):
        raise ValueError(f"Bandit: hi_arm_hiscore_prob={np.asarray(prob)} is outside [0, 1]; pass a probability")
    if not isinstance(steps, jax.core.Tracer) and not np.all(np.asarray(steps) >= 1):
        raise ValueError(f"Bandit: max_steps_in_episode={np.asarray(steps)} must be >= 1")
    return params


class Bandit(Environment):
    """Single-turn two-armed bandit; ``split`` ("train" | "test") picks the arm-name pairs."""

    name = "bandit"
    observation_formats = ("text",)
    observation_format = "text"
    instruction = (
        "You are playing a bandit game: the state describes two arms, and you pull one of them. "
        "Answer with the name of the arm you choose, like <answer> ArmName </answer>.\n"
    )

    def __init__(self, split: str = "train", observation_format: str = "text"):
        if split not in ARM_PAIRS:
            raise ValueError(f"Bandit: unknown split {split!r}; choose one of {tuple(ARM_PAIRS)}")
        self.split = split
        self.observation_format = self.check_format(observation_format)
        self.pairs = ARM_PAIRS[split]
        # Action i names arm i: pair k has its low-risk arm at 2k and its high-risk arm at 2k + 1.
        self.action_names = tuple(name for pair in self.pairs for name in pair)
        segments, self._slots = _prompt_parts()
        self._table = render.PieceTable(segments + list(self.action_names))
        self._segment_ids = np.asarray(self._table.ids(segments), np.int32)
        self._name_ids = np.asarray(self._table.ids(list(self.action_names)), np.int32)

    # --- dynamics -------------------------------------------------------------------------
    def default_params(self, lo_arm_score: float = 0.1, hi_arm_loscore: float = 0.0,
                       hi_arm_hiscore: float = 1.0, hi_arm_hiscore_prob: float = 0.25,
                       max_steps_in_episode: int = 1) -> BanditParams:
        return check_params(BanditParams(
            lo_arm_score=jnp.float32(lo_arm_score), hi_arm_loscore=jnp.float32(hi_arm_loscore),
            hi_arm_hiscore=jnp.float32(hi_arm_hiscore), hi_arm_hiscore_prob=jnp.float32(hi_arm_hiscore_prob),
            max_steps_in_episode=jnp.int32(max_steps_in_episode),
        ))

    def reset_env(self, key: chex.PRNGKey, params: BanditParams):
        check_params(params)
        k_pair, k_order = jax.random.split(key)
        state = BanditState(
            time=jnp.int32(0),
            pair=jax.random.randint(k_pair, (), 0, len(self.pairs), dtype=jnp.int32),
            hi_first=jax.random.bernoulli(k_order),
        )
        return self.observation(state, params), state

    def shown_arms(self, state: BanditState) -> chex.Array:
        """int32 [2]: the action ids of the arms in the order the prompt names them."""
        lo, hi = 2 * state.pair, 2 * state.pair + 1
        return jnp.where(state.hi_first, jnp.stack([hi, lo]), jnp.stack([lo, hi])).astype(jnp.int32)

    def step_env(self, key, state: BanditState, action, params: BanditParams):
        action = jnp.asarray(action, jnp.int32)
        lo, hi = 2 * state.pair, 2 * state.pair + 1
        chose_hi, chose_lo = action == hi, action == lo
        valid = chose_hi | chose_lo
        hit = jax.random.uniform(key) < params.hi_arm_hiscore_prob
        hi_payout = jnp.where(hit, params.hi_arm_hiscore, params.hi_arm_loscore)
        reward = jnp.where(chose_hi, hi_payout, jnp.where(chose_lo, params.lo_arm_score, 0.0)).astype(jnp.float32)
        time = state.time + 1
        terminated = valid
        truncated = (time >= params.max_steps_in_episode) & ~terminated
        next_state = state.replace(time=time)
        info = {"action_is_valid": valid, "action_is_effective": valid, "success": chose_hi}
        return self.observation(next_state, params), next_state, reward, terminated, truncated, info

    def observation(self, state: BanditState, params=None) -> chex.Array:
        """int32 [1, 2]: action ids of the two arms in the order shown (pair and order in one)."""
        return self.shown_arms(state)[None, :]

    # --- text -----------------------------------------------------------------------------
    def render_pieces(self, state: BanditState, params=None, fmt: str | None = None):
        """The instruction as ``(pieces int32 [2 * slots + 1], n)``: segments interleaved with names."""
        self.check_format(fmt)
        names = jnp.asarray(self._name_ids)[self.shown_arms(state)]   # [2] piece ids of a, b
        slot_names = jnp.stack([names[0] if s == "a" else names[1] for s in self._slots])
        pieces = jnp.zeros((2 * len(self._slots) + 1,), jnp.int32)
        pieces = pieces.at[0::2].set(jnp.asarray(self._segment_ids)).at[1::2].set(slot_names)
        return pieces, jnp.int32(pieces.shape[0])

    def render_text(self, state: BanditState, fmt: str | None = None) -> str:
        """Host render: the instruction naming both arms in the order shown."""
        self.check_format(fmt)
        pair = self.pairs[int(np.asarray(state.pair))]
        a, b = (pair[1], pair[0]) if bool(np.asarray(state.hi_first)) else pair
        return PROMPT.format(a=a, b=b)

    def legend(self) -> str:
        """The bandit prompt has no symbols to explain."""
        return ""

    # --- the warm-up's expert ------------------------------------------------------------------
    def expert(self, state, params):
        return bandit_expert.plan(self, state, params)

    def random_answer(self, state, rng) -> str:
        """One of the two arms shown (every other name is an invalid action)."""
        return self.action_names[int(np.asarray(self.shown_arms(state))[int(rng.integers(2))])]
