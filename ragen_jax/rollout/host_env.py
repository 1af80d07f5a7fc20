"""Python (non-JAX) environments in the on-device loop, through ``jax.experimental.io_callback``.

Any object with ``reset(seed) -> text`` and ``step(action_text) -> (text, reward, done, info)``
(gym-style, text in and out) runs in the same jitted rollout as the JAX environments. The model,
parser and KV cache stay on device; only the environment step crosses to the host, once per action
slot for the whole batch, with fixed-size padded token outputs (the host tokenises observations).

Example — a custom environment::

    class GuessNumber:
        '''Guess a number in 1..4; the observation says "higher" or "lower".'''
        def reset(self, seed):
            self.target = 1 + seed % 4
            return "Guess a number between 1 and 4."
        def step(self, action):
            guess = int(action)
            done = guess == self.target
            hint = "Correct!" if done else ("Higher." if guess < self.target else "Lower.")
            return hint, float(done), done, {"success": done}

    env = HostEnv(GuessNumber, tokenizer, action_names=("1", "2", "3", "4"), batch_size=B,
                  instruction="Guess the hidden number. Answer like <answer>3</answer>.\\n")
    rollout = make_rollout(graphdef, env, env.default_params(), tokenizer, RolloutConfig(...))

Free-text actions (``action_names=None``): each answer part reaches ``step`` as the string the
model wrote (``search[who wrote Emma]``, ``The answer is: 12``), as the original passes language
environments their actions; the bytes travel to the host with the step call.

An env whose ``step`` mostly waits (a subprocess, a server) may set ``parallel_steps = N``: the
rows of a batch are then stepped N at a time in threads (each row has its own env instance).

An env may count events (``take_counters() -> dict``, zeroing its counts): ``HostEnv.take_counters``
sums the rows' and the trainer logs them as ``env/<name>`` each step.

An env may define ``expert() -> environments.core.Plan``: what an expert answers in the env's current
state (``answers`` and the ``reasoning`` leading to them), for the behaviour-cloning warm-up
(``HostEnv.expert_episode`` plays it on a spare instance); ``random_answer(rng) -> str`` adds
``warmup.action_noise``.

``info`` may carry ``success`` (default: ``done`` with positive reward), ``action_is_valid`` and
``action_is_effective`` (default True). One Python env instance serves each batch row; rows of the
same group receive the same seed. Observations longer than ``max_obs_tokens`` are an error (raise
the limit): silently cutting the state text would change what the model sees. So is a NaN or
infinite reward, named with the env, the row and the step.
"""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Mapping

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from environments.core import AgentFacing, EnvParams

# Errors of Python environments, newest last: an error raised inside ``io_callback`` reaches the
# caller wrapped in an XLA runtime error; the command line reports the original from here.
FAILURES: list[Exception] = []


@chex.dataclass(frozen=True)
class HostEnvState:
    obs_tokens: chex.Array  # int32 [max_obs_tokens] the current observation's tokens
    obs_n: chex.Array  # int32 [] its length
    time: chex.Array  # int32 [] steps taken


class HostEnv(AgentFacing):
    """Adapter: a batch of Python text environments with the interface the rollout loop uses
    (``environments.core.AgentFacing``): its batched ``reset_batch`` / ``step_batch`` /
    ``render_batch`` make one host call for all rows where an on-device env is ``vmap``-ped.
    """

    name = "host"
    observation_formats = ("text",)
    observation_format = "text"

    def __init__(
        self,
        make_env: Callable[[], Any],
        tokenizer,
        *,
        action_names: tuple[str, ...] | None,
        batch_size: int,
        max_obs_tokens: int = 256,
        instruction: str = "",
        max_action_bytes: int | None = None,
        step_timeout_s: float = 600.0,
    ):
        if action_names is not None and not action_names:
            raise ValueError("HostEnv: action_names is empty; pass the fixed action names, or None for free-text "
                             "actions (each answer part reaches step() as a string)")
        self.make_env = make_env
        self.tokenizer = tokenizer
        self.action_names = () if action_names is None else tuple(action_names)
        if action_names is None:
            # Free text: the parser hands every answer part over as bytes (``parser.TextActions``).
            self.parse_action = lambda part, n: ((part, n), n > 0)
            self.max_action_bytes = max_action_bytes
        self.batch_size = batch_size
        if not (isinstance(step_timeout_s, (int, float)) and step_timeout_s > 0):
            raise ValueError(f"HostEnv: step_timeout_s={step_timeout_s!r} must be a number of seconds > 0")
        self.step_timeout_s = float(step_timeout_s)
        self.max_obs_tokens = max_obs_tokens
        self.instruction = instruction
        self.envs = [make_env() for _ in range(batch_size)]  # more are made for larger batches (evaluation)
        self._expert_env = None  # the warm-up expert's own instance (``expert_episode``), made when first needed
        self.piece_table = "tokens"  # observations arrive as token ids: the codec's identity table
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    # ---- the warm-up's expert (host side) --------------------------------------------------
    @staticmethod
    def seeds_of(keys) -> np.ndarray:
        """The ``reset`` seed of each row of ``keys [B]``: what ``reset_batch`` hands the Python envs."""
        return np.asarray(jax.random.key_data(keys))[:, -1].astype(np.uint32)

    def expert_episode(self, seed: int, max_turns: int, max_answers_per_turn: int, max_answers: int,
                       rng: np.random.Generator | None = None, action_noise: float = 0.0):
        """The expert's replies over one episode from ``seed``: ``([(reasoning, answers)] per turn,
        success)``. Played on a spare instance of the Python env, which the expert re-plans from after
        every step (closed loop, as the on-device envs' experts), stepping each answer as the rollout
        does: at most ``max_answers_per_turn`` a turn and ``max_answers`` in all, until ``done``."""
        if self._expert_env is None:
            self._expert_env = self.make_env()
        env = self._expert_env
        if not callable(getattr(env, "expert", None)):
            raise ValueError(f"HostEnv {type(env).__name__} has no expert() for behaviour cloning: define one "
                             "(returning environments.core.Plan), or set warmup.steps=0 and warmup.single_turn_steps=0")
        env.reset(int(seed))
        turns, n_answers, success = [], 0, False
        for _ in range(max_turns):
            if n_answers >= max_answers:
                break
            plan = env.expert()
            answers = list(plan.answers[:max_answers_per_turn])
            if not answers or (action_noise and rng is not None and rng.random() < action_noise):
                random_answer = getattr(env, "random_answer", None)
                if not callable(random_answer):
                    raise ValueError(f"warmup.action_noise={action_noise} needs HostEnv {type(env).__name__}."
                                     "random_answer(rng); define it or set warmup.action_noise=0")
                answers = [random_answer(rng)]
            turns.append((plan.reasoning(answers), answers))
            done = False
            for answer in answers[: max_answers - n_answers]:
                _, _, done, info = env.step(answer)
                n_answers += 1
                if done:
                    success = bool((info or {}).get("success", False))
                    break
            if done:
                break
        return turns, success

    def check_format(self, fmt):
        fmt = self.observation_format if fmt is None else fmt
        if fmt != "text":
            raise ValueError(f"HostEnv observations are text; observation_format must be 'text', got {fmt!r}")
        return fmt

    def legend(self) -> str:
        return ""

    def default_params(self) -> EnvParams:
        return EnvParams(max_steps_in_episode=jnp.int32(1 << 30))

    # ---- host side -----------------------------------------------------------------------
    def _encode(self, text: str) -> tuple[np.ndarray, np.int32]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > self.max_obs_tokens:
            raise ValueError(
                f"HostEnv observation of {len(ids)} tokens exceeds max_obs_tokens={self.max_obs_tokens}; "
                "raise max_obs_tokens"
            )
        out = np.full((self.max_obs_tokens,), self.pad_id, np.int32)
        out[: len(ids)] = ids
        return out, np.int32(len(ids))

    def _host_reset(self, seeds):
        seeds = np.asarray(seeds)
        while len(self.envs) < len(seeds):
            self.envs.append(self.make_env())
        toks = np.zeros((len(seeds), self.max_obs_tokens), np.int32)
        n = np.zeros((len(seeds),), np.int32)
        self._steps = np.zeros((len(seeds),), np.int64)
        for i, s in enumerate(seeds):
            toks[i], n[i] = self._encode(self._checked_text(
                self._call(i, "reset", lambda: self.envs[i].reset(int(s))), i, "reset"))
        return toks, n

    def _name(self, i: int) -> str:
        return type(self.envs[i]).__name__

    def take_counters(self) -> dict[str, float]:
        """The rows' event counters since the last call, summed (an env that keeps counts defines
        ``take_counters() -> dict``: the code sandbox's time-outs and failures); the trainer logs
        them as ``env/<name>`` each step."""
        total: dict[str, float] = {}
        for env in self.envs:
            take = getattr(env, "take_counters", None)
            if callable(take):
                for name, value in take().items():
                    total[name] = total.get(name, 0.0) + float(value)
        return total

    def _call(self, i: int, what: str, fn):
        """Run the Python env's reset/step, at most ``step_timeout_s`` seconds; its exception (or the
        time-out) is re-raised naming the env, row and step — raised inside ``io_callback`` it would
        otherwise surface as an anonymous XLA error — and kept in ``host_env.FAILURES`` for the
        command line's one-line report."""
        step = "reset" if what == "reset" else f"step {int(self._steps[i]) + 1}"
        box: dict = {}

        def run():
            try:
                box["out"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = e

        # A daemon thread: a call that never returns is abandoned (Python cannot stop it), not waited for.
        worker = threading.Thread(target=run, name=f"HostEnv-{what}-{i}", daemon=True)
        worker.start()
        worker.join(self.step_timeout_s)
        if worker.is_alive():
            error = TimeoutError(f"HostEnv {self._name(i)} did not return from {what}() within {self.step_timeout_s:g} s "
                                 f"at {step} of row {i}; fix the environment or raise env.step_timeout_s")
            FAILURES.append(error)
            raise error
        if "error" in box:
            e = box["error"]
            error = RuntimeError(f"HostEnv {self._name(i)} raised {type(e).__name__} at {step} of row {i}: {e}")
            FAILURES.append(error)
            raise error from e
        return box["out"]

    def _step_rows(self, rows: list[int], texts: dict) -> dict:
        """Each row's ``step`` output; rows at once (threads) when the env sets ``parallel_steps``
        (an env whose step waits on a subprocess or a server: the code sandbox, a retrieval server)."""
        width = int(getattr(self.envs[0], "parallel_steps", 1) or 1) if self.envs else 1
        if width <= 1 or len(rows) <= 1:
            return {i: self._call(i, "step", lambda i=i: self.envs[i].step(texts[i])) for i in rows}
        with concurrent.futures.ThreadPoolExecutor(min(width, len(rows)), thread_name_prefix="HostEnv-step") as pool:
            futures = {i: pool.submit(self._call, i, "step", lambda i=i: self.envs[i].step(texts[i])) for i in rows}
            return {i: f.result() for i, f in futures.items()}

    def _checked_text(self, text, i: int, what: str) -> str:
        if not isinstance(text, str):
            raise TypeError(f"HostEnv {self._name(i)}.{what}() at step {int(self._steps[i])} of row {i} returned "
                            f"{type(text).__name__} as the observation; it must return text (str)")
        return text

    def _action_text(self, actions, i: int) -> str:
        if self.action_names:
            return self.action_names[int(actions[i])]
        part, n = actions
        return bytes(np.asarray(part[i][: int(n[i])], np.uint8)).decode("utf-8", errors="replace")

    def _host_step(self, actions, do):
        actions = jax.tree.map(np.asarray, actions)
        do = np.asarray(do)
        b = len(do)
        toks = np.zeros((b, self.max_obs_tokens), np.int32)
        n = np.zeros((b,), np.int32)
        reward = np.zeros((b,), np.float32)
        flags = np.zeros((4, b), bool)  # done, success, valid, effective
        rows = [i for i in range(b) if do[i]]
        texts = {i: self._action_text(actions, i) for i in rows}
        outs = self._step_rows(rows, texts)
        for i in rows:
            action, out = texts[i], outs[i]
            if not (isinstance(out, tuple) and len(out) == 4):
                raise TypeError(f"HostEnv {self._name(i)}.step() at step {int(self._steps[i]) + 1} of row {i} returned "
                                f"{type(out).__name__}; it must return (text, reward, done, info)")
            text, r, done, info = out
            self._steps[i] += 1
            self._checked_text(text, i, "step")
            try:
                r = float(r)
            except (TypeError, ValueError):
                raise TypeError(f"HostEnv {self._name(i)}.step() at step {int(self._steps[i])} of row {i} returned "
                                f"reward {r!r}; it must be a number") from None
            if not np.isfinite(r):
                # Shown to the model as "Reward: 0.0" / the clip limit and summed into the returns,
                # a NaN or inf would corrupt the turn text and every advantage of the batch.
                raise ValueError(f"HostEnv {type(self.envs[i]).__name__} returned a non-finite reward {r!r} at "
                                 f"step {int(self._steps[i])} of row {i} (action {action!r}); its step() must "
                                 "return a finite float")
            info = {} if info is None else info
            if not isinstance(info, Mapping):
                raise TypeError(f"HostEnv {self._name(i)}.step() at step {int(self._steps[i])} of row {i} returned info "
                                f"of type {type(info).__name__}; it must be a dict (or None)")
            toks[i], n[i] = self._encode(text)
            reward[i] = r
            flags[:, i] = (
                bool(done), bool(info.get("success", bool(done) and r > 0)),
                bool(info.get("action_is_valid", True)), bool(info.get("action_is_effective", True)),
            )
        return toks, n, reward, flags

    # ---- device side (batched) -------------------------------------------------------------
    def reset_batch(self, keys, params=None):
        b = keys.shape[0]
        seeds = jax.random.key_data(keys)[:, -1].astype(jnp.uint32)
        shapes = (jax.ShapeDtypeStruct((b, self.max_obs_tokens), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
        toks, n = io_callback(self._host_reset, shapes, seeds)
        state = HostEnvState(obs_tokens=toks, obs_n=n, time=jnp.zeros((b,), jnp.int32))
        return toks, state

    def step_batch(self, keys, state: HostEnvState, actions, params, do):
        """Step the rows with ``do``; the others keep their state. Returns
        ``(state, reward, terminated, truncated, info)`` with ``[B]`` leaves."""
        b = do.shape[0]
        shapes = (
            jax.ShapeDtypeStruct((b, self.max_obs_tokens), jnp.int32),
            jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b,), jnp.float32),
            jax.ShapeDtypeStruct((4, b), jnp.bool_),
        )
        if self.action_names:
            actions = jnp.asarray(actions, jnp.int32)
        toks, n, reward, flags = io_callback(self._host_step, shapes, actions, do)
        new = HostEnvState(
            obs_tokens=jnp.where(do[:, None], toks, state.obs_tokens),
            obs_n=jnp.where(do, n, state.obs_n),
            time=state.time + do.astype(jnp.int32),
        )
        info = {"success": flags[1], "action_is_valid": flags[2], "action_is_effective": flags[3]}
        return new, reward, flags[0], jnp.zeros((b,), bool), info

    def render_batch(self, state: HostEnvState, params=None, fmt=None):
        return state.obs_tokens, state.obs_n

    # Single-row views, for shape inspection (``jax.eval_shape``) by the rollout builder.
    def reset(self, key, params=None):
        toks, state = self.reset_batch(key[None], params)
        return toks[0], jax.tree.map(lambda x: x[0], state)

    def render_pieces(self, state: HostEnvState, params=None, fmt=None):
        return state.obs_tokens, state.obs_n
