"""Side by side with Tunix (``google-tunix``): decode, the GRPO update and multi-turn rollouts, same weights.

    pip install -e ".[bench]"                      # google-tunix 0.1.7 among the peers
    python benchmarks/vs_tunix.py                  # tiny Qwen2 shape on CPU; the 0.5B shape on a GPU
    python benchmarks/vs_tunix.py --shape 0.5b --out benchmarks/results_vs_tunix.md

One process, one random Qwen2 checkpoint: a seeded ``transformers.Qwen2ForCausalLM`` (attention biases,
untied head) is written to a temporary directory with ``save_pretrained`` next to the repository's tiny
ChatML tokenizer, and each side loads it with its own safetensors loader (ours:
``ragen_jax.models.loading.load_hf``; Tunix: ``tunix.models.qwen2.params.create_model_from_safe_tensors``).
Compilation is excluded (warm-up calls first); every time is the best of ``--repeats``.

* **Decode**: greedy tokens/s at each ``--batches`` size on the same text prompts. Tunix: its ``Sampler``
  called as a user calls it (strings in, left-padded to ``--prompt-len``, detokenised out). Ours: the
  jitted prefill + ``generate`` loop on the same token ids. The generated tokens must be identical.
* **Update**: one GRPO step on the same batch (prompt + completion rows, group-normalised advantages,
  token-mean, clip 0.2, no KL, no entropy term, global-norm clip 1, AdamW). Tunix: the actor train step
  its GRPO learner runs (``tunix.rl.trainer.Trainer`` with ``algo_core.grpo_loss_fn``, its advantages
  from ``algo_core.compute_advantages``). Ours: ``make_update_step`` on the same rows as a one-turn
  ``Trajectory``, as the trainer builds it: one pass (the old log-probs are the loss pass's own,
  ``update.is_single_pass``, as Tunix with ``num_iterations=1``) and the LM head at the completion
  tokens only (``starpo.logprobs_at='loss_tokens'`` with the completion length as the reply budget).
  Loss, gradient norm and entropy must agree.
* **Multi-turn rollout**: FrozenLake (deterministic moves), 5 turns, ``--episodes`` episodes in groups of
  4, ``--turn-tokens`` new tokens per turn, greedy, full conversation history. Ours: ``make_rollout``,
  the whole episode loop on device. Tunix: its agentic loop — ``TrajectoryCollectEngine.collect_multiple``
  over (``ModelAgent``, environment) pairs, the environment a ``BaseTaskEnv`` that plays the same boards
  and writes the same messages (our prompt functions, plain Python), ``QwenChatTemplateParser`` for the
  chat text and ``VanillaRollout`` (its ``Sampler``) for each model call. The first prompt of every
  episode must be the same text on both sides. Reported: env-turns/s and sampled tokens/s.
* **The limit**: the fp32 matmul peak of this machine (best of a large ``jnp.dot``), and decode / update
  as a fraction of it: model FLOPs per token (2 x matmul parameters + attention over the context; x3 for
  the update's forward + backward) x tokens/s / peak.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import sys
import tempfile
import time
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TOKENIZER_DIR = os.path.join(ROOT, "ragen_jax", "assets", "tiny_tokenizer")

# Qwen2 shapes: (hidden, intermediate, layers, heads, kv heads). Vocabulary = the tokenizer's.
SHAPES = {
    "tiny": (256, 768, 4, 4, 2),
    "small": (512, 1536, 8, 8, 2),
    "0.5b": (896, 4864, 24, 14, 2),  # Qwen2.5-0.5B without its 152k vocabulary
}
GROUP_SIZE = 4


def best_of(fn, repeats: int, warmups: int = 1):
    import jax

    for _ in range(warmups):
        out = jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best, out


# ---------------------------------------------------------------------------------------------------
# The shared checkpoint and both models


def write_checkpoint(directory: str, shape: str) -> dict:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    hidden, inter, layers, heads, kv = SHAPES[shape]
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192, rope_theta=10000.0,
        tie_word_embeddings=False, initializer_range=0.1)
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)


def tunix_model(directory: str, hf: dict, dtype: str = "float32"):
    """Tunix's Qwen2 from the checkpoint; ``dtype`` its compute and parameter dtype (its two knobs)."""
    import jax.numpy as jnp
    from tunix.models.qwen2 import model as tunix_qwen2
    from tunix.models.qwen2 import params as tunix_params

    rope = hf.get("rope_parameters", {}).get("rope_theta", hf.get("rope_theta"))
    cfg = tunix_qwen2.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"],
        head_dim=hf["hidden_size"] // hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(rope), norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"],
        dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype))
    return cfg, tunix_params.create_model_from_safe_tensors(directory, cfg, dtype=jnp.dtype(dtype))


def tunix_sampler(model, cfg, tokenizer, cache_size: int):
    from tunix.generate import sampler as tunix_sampler_lib

    return tunix_sampler_lib.Sampler(model, tokenizer, tunix_sampler_lib.CacheConfig(
        cache_size=cache_size, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))


def forward_flops_per_token(hf: dict, context: float) -> float:
    """2 x matmul parameters (attention projections, MLP, LM head) + 4 x layers x context x q-width."""
    d, f, n = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    hd = d // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f
    return 2.0 * (n * per_layer + d * hf["vocab_size"]) + 4.0 * n * context * q


def matmul_peak(n: int, repeats: int) -> float:
    """fp32 FLOP/s of a jitted [n, n] @ [n, n]."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    seconds, _ = best_of(lambda: dot(a, b), repeats)
    return 2.0 * n ** 3 / seconds


# ---------------------------------------------------------------------------------------------------
# Decode


def word_prompts(batch: int, seed: int) -> list[str]:
    import numpy as np

    words = ("the lake is frozen and the goal lies past two holes so step left then down and keep off "
             "the ice where it is thin while the player waits for a safe path home").split()
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, int(rng.integers(8, 13)))) for _ in range(batch)]


def bench_decode(args, directory, ours, tunix, tok) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ragen_jax.models.kv_cache import init_cache
    from ragen_jax.models.sampler import SamplingConfig, generate, prefill

    cfg, graphdef, params = ours
    tcfg, tmodel = tunix
    n_new = args.new_tokens
    sampler = tunix_sampler(tmodel, tcfg, tok, cache_size=args.prompt_len + n_new)

    def run(params, tokens, lengths):
        batch, width = tokens.shape
        cache = init_cache(cfg, batch, width + n_new)
        start = jnp.zeros(batch, jnp.int32)
        logits, cache = prefill((graphdef, params), cache, tokens, start, lengths)
        return generate((graphdef, params), cache, logits, lengths, jnp.ones(batch, bool),
                        jax.random.split(jax.random.key(0), batch), SamplingConfig.greedy(),
                        jnp.array([-1], jnp.int32), jnp.zeros((0, 0), jnp.int32), n_new).tokens

    run = jax.jit(run)
    rows = []
    for batch in args.batch_list:
        texts = word_prompts(batch, seed=batch)
        ids = [sampler.tokenize(t) for t in texts]
        if max(len(i) for i in ids) > args.prompt_len:
            raise SystemExit(f"--prompt-len {args.prompt_len} is shorter than a prompt ({max(map(len, ids))} tokens)")
        tokens = np.zeros((batch, max(len(i) for i in ids)), np.int32)
        for b, i in enumerate(ids):
            tokens[b, :len(i)] = i
        lengths = jnp.asarray([len(i) for i in ids], jnp.int32)
        tokens = jnp.asarray(tokens)

        def call_tunix():
            return sampler(texts, max_generation_steps=n_new, max_prompt_length=args.prompt_len, temperature=0.0,
                           eos_tokens=[-1]).tokens  # -1: never stop early, as ours

        t_ours, out_ours = best_of(lambda: run(params, tokens, lengths), args.repeats)
        t_tunix, out_tunix = best_of(call_tunix, args.repeats)
        out_ours = np.asarray(out_ours)
        differ = [b for b in range(batch) if not np.array_equal(out_ours[b], np.asarray(out_tunix[b]))]
        # In bfloat16 the two sides round different intermediates, so rows may part without either
        # being wrong: only float32 rows are adjudicated against the transformers model.
        departures = ([adjudicate(directory, ids[b], out_ours[b], np.asarray(out_tunix[b])) for b in differ]
                      if args.dtype == "float32" else [])
        n = batch * n_new
        rows.append(dict(batch=batch, ours_tps=n / t_ours, tunix_tps=n / t_tunix, identical=1 - len(differ) / batch,
                         tunix_departures=departures, context=args.prompt_len + n_new / 2))
        note = "" if not differ else (f"; {len(differ)} rows differ" + (
            f", each where Tunix's token is not the transformers argmax (ours is): {departures}"
            if args.dtype == "float32" else " (bfloat16 on both sides: not adjudicated)"))
        print(f"decode  batch {batch:3d}: ours {n / t_ours:9.1f} tok/s   Tunix Sampler {n / t_tunix:9.1f} tok/s   "
              f"ratio {t_tunix / t_ours:5.2f}x   identical greedy tokens in {1 - len(differ) / batch:.0%} of rows{note}",
              flush=True)
    return rows


def adjudicate(directory: str, prompt, ours, theirs) -> dict:
    """Where two greedy rows part, which token is the argmax of the transformers (PyTorch) model on the
    common prefix. Returns ``{position, gap}`` (the reference logit of ours minus Tunix's) when ours is
    the argmax; exits otherwise: a difference of ours is an error, not a benchmark figure."""
    import numpy as np
    try:
        import torch
    except ImportError:
        raise SystemExit("greedy tokens differ between the two sides; install torch==2.13.0 (the test extra) "
                         "to check them against the transformers model")
    model = _reference_model(directory)
    k = int(np.argmax(ours != theirs))
    prefix = torch.as_tensor(np.concatenate([prompt, ours[:k]]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(prefix).logits[0, -1].double().numpy()
    if int(np.argmax(logits)) != int(ours[k]):
        raise SystemExit(f"greedy tokens differ at position {k}: ours {ours[k]}, Tunix {theirs[k]}, transformers "
                         f"argmax {int(np.argmax(logits))}")
    return dict(position=k, gap=round(float(logits[ours[k]] - logits[theirs[k]]), 4))


_REFERENCE = {}


def _reference_model(directory: str):
    import torch
    import transformers

    if directory not in _REFERENCE:
        _REFERENCE[directory] = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return _REFERENCE[directory]


# ---------------------------------------------------------------------------------------------------
# The GRPO update


def update_batch(batch: int, prompt_len: int, completion_len: int, vocab: int, pad: int, eos: int, seed: int = 0):
    """Left-padded prompts [B, P], right-padded completions [B, C] with masks, rewards [B] (NumPy).

    Token ids are drawn from 3 upwards, past the special ids (pad, eos): a stray eos inside a row would be
    cut by one side's masks and not the other's."""
    import numpy as np

    if max(pad, eos) >= 3:
        raise ValueError(f"expected the special ids below 3, got pad {pad}, eos {eos}")

    rng = np.random.default_rng(seed)
    plen = rng.integers(prompt_len // 2, prompt_len + 1, batch)
    clen = rng.integers(completion_len // 2, completion_len + 1, batch)
    prompt = np.full((batch, prompt_len), pad, np.int32)
    for b in range(batch):
        prompt[b, prompt_len - plen[b]:] = rng.integers(3, vocab, plen[b])
    comp = rng.integers(3, vocab, (batch, completion_len)).astype(np.int32)
    cmask = (np.arange(completion_len)[None] < clen[:, None]).astype(np.int32)
    comp = np.where(cmask > 0, comp, pad).astype(np.int32)
    rewards = rng.random(batch).astype(np.float32)
    return prompt, plen, comp, clen, cmask, rewards


def one_turn_trajectory(prompt, plen, comp, clen, rewards, pad: int, group_size: int):
    """The same rows as our ``Trajectory``: prompt then completion, right-padded; reward on the last token."""
    import jax.numpy as jnp
    import numpy as np

    from ragen_jax.rollout.trajectory import Trajectory

    batch, p = prompt.shape
    width = p + comp.shape[1]
    tokens = np.full((batch, width), pad, np.int32)
    valid = np.zeros((batch, width), bool)
    sampled = np.zeros((batch, width), bool)
    token_rewards = np.zeros((batch, width), np.float32)
    last = np.zeros(batch, np.int32)
    for b in range(batch):
        n = plen[b] + clen[b]
        tokens[b, :plen[b]] = prompt[b, p - plen[b]:]
        tokens[b, plen[b]:n] = comp[b, :clen[b]]
        valid[b, :n], sampled[b, plen[b]:n] = True, True
        token_rewards[b, n - 1], last[b] = rewards[b], n - 1
    ends = jnp.asarray(plen[:, None], jnp.int32)
    return Trajectory(
        tokens=jnp.asarray(tokens), valid_mask=jnp.asarray(valid), loss_mask=jnp.asarray(sampled),
        sampler_logprobs=jnp.zeros((batch, width), jnp.float32),
        turn_ids=jnp.asarray(np.where(valid, 0, -1), jnp.int32), token_rewards=jnp.asarray(token_rewards),
        turn_rewards=jnp.asarray(rewards[:, None]), turn_format_penalty=jnp.zeros((batch, 1), jnp.float32),
        turn_reasoning_reward=jnp.zeros((batch, 1), jnp.float32),
        turn_mask=jnp.ones((batch, 1), bool), turn_last_token=jnp.asarray(last[:, None]),
        prompt_end=ends, reasoning_start=ends, reasoning_end=ends,
        group_ids=jnp.asarray(np.arange(batch) // group_size, jnp.int32), episode_return=jnp.asarray(rewards),
        success=jnp.zeros(batch, bool), num_turns=jnp.ones(batch, jnp.int32), num_actions=jnp.ones(batch, jnp.int32),
        valid_action_rate=jnp.ones(batch, jnp.float32), effective_action_rate=jnp.ones(batch, jnp.float32),
        response_length=jnp.asarray(clen, jnp.int32))


def bench_update(args, hf, directory, tok) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from tunix.rl import algo_core
    from tunix.rl import trainer as tunix_trainer
    from tunix.rl.grpo import grpo_learner
    from tunix.sft import peft_trainer

    from ragen_jax.models.loading import load_hf
    from ragen_jax.config import CollapseConfig, FilterConfig, StarPOConfig
    from ragen_jax.starpo.update import init_train_state, make_update_step

    batch, lr = args.update_batch, 1e-4
    pad, eos = tok.pad_token_id, tok.eos_token_id
    prompt, plen, comp, clen, cmask, rewards = update_batch(batch, args.update_prompt_len, args.update_completion_len,
                                                            hf["vocab_size"], pad, eos)

    # Tunix: the actor train step of its GRPO learner (num_iterations=1, beta=0: no old / reference pass).
    _, tmodel = tunix_model(directory, hf)
    algo = grpo_learner.GRPOConfig(num_generations=GROUP_SIZE, num_iterations=1, beta=0.0, epsilon=0.2,
                                   loss_agg_mode="token-mean")
    algo.temperature = 1.0
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01))
    trainer = tunix_trainer.Trainer(tmodel, optimizer, peft_trainer.TrainingConfig(eval_every_n_steps=10 ** 9),
                                    custom_checkpoint_metadata_fn=dict)
    trainer.with_loss_fn(lambda model, train_example, algo_config: algo_core.grpo_loss_fn(
        model, train_example, algo_config=algo_config, pad_id=pad, eos_id=eos), has_aux=True)
    trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
    train_step, _ = trainer.jit_train_and_eval_step()
    example = grpo_learner.TrainExample(
        prompt_ids=jnp.asarray(prompt), prompt_mask=jnp.asarray(prompt != pad, jnp.int32),
        completion_ids=jnp.asarray(comp), completion_mask=jnp.asarray(cmask),
        advantages=jnp.asarray(algo_core.compute_advantages(rewards, GROUP_SIZE)),
        ref_per_token_logps=None, old_per_token_logps=None)
    first = jax.block_until_ready(train_step(example))  # the loss of the checkpoint's parameters
    # The second call compiles again (the optimizer state it donated comes back re-laid-out): two warm-ups.
    t_tunix, _ = best_of(lambda: train_step(example), args.repeats, warmups=1)
    t_loss, t_aux, t_norm = float(first[0]), first[1], float(first[2])

    # Ours: the StarPO update with the same settings.
    _, policy = load_hf(directory)
    cfg = StarPOConfig(adv_estimator="grpo", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=1e9, entropy_coeff=0.0,
                       loss_agg_mode="token-mean", mini_batch_size=batch, grad_clip=1.0, actor_lr=lr, weight_decay=0.01,
                       critic="none", logprob_temperature=1.0)
    graphdefs, state = init_train_state(policy, cfg, key=jax.random.key(0))
    update = make_update_step(graphdefs, cfg, FilterConfig(), CollapseConfig(first_turn_enabled=False,
                                                                              trajectory_enabled=False),
                              group_size=GROUP_SIZE, donate=False, reply_tokens=args.update_completion_len)
    traj = one_turn_trajectory(prompt, plen, comp, clen, rewards, pad, GROUP_SIZE)
    t_ours, (_, metrics) = best_of(lambda: update(state, traj), args.repeats)
    o_loss, o_norm, o_ent = (float(metrics[k]) for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"))
    t_ent = float(t_aux["entropy"])
    tol = 1e-4
    agree = {name: abs(a - b) / max(abs(b), 1e-3) for name, a, b in
             (("loss", o_loss, t_loss), ("grad norm", o_norm, t_norm), ("entropy", o_ent, t_ent))}
    bad = {k: v for k, v in agree.items() if v > tol}
    if bad:
        raise SystemExit(f"update: ours and Tunix disagree beyond {tol:g} (relative): {bad}; "
                         f"ours loss {o_loss} grad norm {o_norm} entropy {o_ent}, Tunix {t_loss} {t_norm} {t_ent}")
    tokens = int(plen.sum() + clen.sum())
    print(f"update  {batch} rows, {tokens} tokens: ours {t_ours * 1e3:8.1f} ms   Tunix train step {t_tunix * 1e3:8.1f} ms   "
          f"ratio {t_tunix / t_ours:5.2f}x   loss {o_loss:.6f} / {t_loss:.6f}, grad norm {o_norm:.5f} / {t_norm:.5f}, "
          f"entropy {o_ent:.5f} / {t_ent:.5f}", flush=True)
    return dict(rows=batch, tokens=tokens, ours_s=t_ours, tunix_s=t_tunix, loss=(o_loss, t_loss),
                grad_norm=(o_norm, t_norm), entropy=(o_ent, t_ent), max_rel_diff=max(agree.values()),
                context=(args.update_prompt_len + args.update_completion_len) / 2)


# ---------------------------------------------------------------------------------------------------
# Multi-turn FrozenLake: our on-device rollout vs Tunix's agentic loop


MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}


def make_tunix_frozen_lake(rollout_cfg, env_name: str = "frozen_lake"):
    """A Tunix ``BaseTaskEnv`` playing FrozenLake boards given as text, with our prompt functions."""
    from tunix.rl.agentic.environments import base_environment

    from ragen_jax.rollout import prompts

    c = rollout_cfg

    class FrozenLakeTask(base_environment.BaseTaskEnv):
        def __init__(self, task, **kwargs):
            super().__init__(task=task, max_steps=c.max_turns, **kwargs)
            rows = task["board"].split("\n")
            self.size = len(rows)
            self.cells = {(r, k): ch for r, row in enumerate(rows) for k, ch in enumerate(row)}
            self.pos = next(p for p, ch in self.cells.items() if ch == "P")
            self.cells[self.pos] = "_"
            self.actions_left = c.max_actions_per_traj

        def board(self) -> str:
            def cell(p):
                under = self.cells[p]
                if p != self.pos:
                    return under
                return {"O": "X", "G": "√"}.get(under, "P")
            return "\n".join("".join(cell((r, k)) for k in range(self.size)) for r in range(self.size))

        def turn(self, warning: bool) -> str:
            return prompts.turn_block(self.step_count + 1, self.board(), self.actions_left, warning=warning,
                                      enable_think=c.enable_think, max_words=c.max_words)

        def _initial_observation(self):
            return self.turn(warning=False)

        def _step_impl(self, action):
            text = getattr(action, "action", action)
            match = re.search(r"<answer>(.*?)</answer>", text, re.S)
            names = [a.strip().lower() for a in match.group(1).split("||")] if match else []
            moves = [MOVES[a] for a in names[:c.max_actions_per_turn] if a in MOVES][:self.actions_left]
            reward, done = 0.0, False
            for dr, dc in moves:
                self.pos = (min(max(self.pos[0] + dr, 0), self.size - 1), min(max(self.pos[1] + dc, 0), self.size - 1))
                self.actions_left -= 1
                if self.cells[self.pos] in "GO":
                    reward, done = float(self.cells[self.pos] == "G"), True
                    break
            done = done or self.actions_left <= 0
            observation = prompts.reward_message(reward if moves else None) + self.turn(warning=not moves)
            return base_environment.EnvStepResult(observation=observation, reward=reward if moves else c.format_penalty,
                                                  done=done, info={"success": reward > 0})

    return FrozenLakeTask


def bench_rollout(args, hf, ours, tunix, tok) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tunix.rl.agentic.agents import model_agent
    from tunix.rl.agentic.parser.chat_template_parser import parser as chat_parser_lib
    from tunix.rl.agentic.trajectory import trajectory_collect_engine
    from tunix.rl.rollout import base_rollout, vanilla_rollout

    import environments
    from ragen_jax.config import RolloutConfig
    from ragen_jax.rollout import make_rollout

    cfg, graphdef, params = ours
    tcfg, tmodel = tunix
    env = environments.make("frozen_lake", is_slippery=False)
    base = RolloutConfig(num_groups=args.episodes // GROUP_SIZE, group_size=GROUP_SIZE, max_turns=args.turns,
                         max_new_tokens=args.turn_tokens, temperature=0.0, context_mode="full", max_seq_len=8192)
    probe = make_rollout(graphdef, env, env.default_params(), tok, base)
    need = len(probe.codec.preamble_ids) + args.turns * (probe.codec.chunk_len + args.turn_tokens) + probe.codec.end_len
    rc = RolloutConfig(**{**base.__dict__, "max_seq_len": int(-(-need // 128) * 128),
                          "max_obs_tokens": probe.max_obs_tokens})
    rollout = make_rollout(graphdef, env, env.default_params(), tok, rc)
    t_ours, traj = best_of(lambda: rollout(params, jax.random.key(0)), args.repeats)
    ours_turns = int(jnp.sum(traj.num_turns))
    ours_tokens = int(jnp.sum(traj.response_length))

    # The same episodes for Tunix: system prompt and first boards read back from our transcripts.
    lengths = np.asarray(traj.lengths)
    texts = [tok.decode(np.asarray(traj.tokens[b])[:lengths[b]]) for b in range(traj.batch_size)]
    system = re.match(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", texts[0], re.S).group(1)
    boards = [re.search(r"Turn 1:\nState:\n(.*?)\nYou have", t, re.S).group(1) for t in texts]
    parser = chat_parser_lib.QwenChatTemplateParser(tok)
    env_cls = make_tunix_frozen_lake(rc)
    for b in range(traj.batch_size):  # the first prompt is the same text on both sides
        first = parser.parse([{"role": "system", "content": system},
                              {"role": "user", "content": env_cls({"board": boards[b]}).reset()[0]}],
                             add_generation_prompt=True, is_first_msg=True)
        if not texts[b].startswith(first):
            raise SystemExit(f"rollout: episode {b}'s first prompt differs between the two sides:\n{first!r}")

    context = -(-(int(lengths.max()) + 1) // 256) * 256
    sampler_rollout = vanilla_rollout.VanillaRollout(tmodel, tok, base_rollout.CacheConfig(
        cache_size=context + args.turn_tokens, num_layers=tcfg.num_layers, num_kv_heads=tcfg.num_kv_heads,
        head_dim=tcfg.head_dim))
    config = base_rollout.RolloutConfig(max_tokens_to_generate=args.turn_tokens, max_prompt_length=None,
                                        temperature=0.0, eos_tokens=[-1])  # full turns, as ours

    sampled = []

    def model_call(messages, env=None, max_generation_steps=None):  # AgenticRLLearner._model_call's path
        prompt = parser.parse(messages=messages, add_generation_prompt=True, is_first_msg=True)
        out = sampler_rollout.generate([prompt], config)
        sampled.append(len(out.tokens[0]))
        return out

    def run_tunix():
        sampled.clear()
        pairs = [(model_agent.ModelAgent(system_prompt=system), env_cls({"board": boards[b]}))
                 for b in range(traj.batch_size)]

        async def collect():
            return [t async for t in trajectory_collect_engine.TrajectoryCollectEngine.collect_multiple(
                pairs, model_call=model_call, timeout=3600.0, mode="Trajectory", overlong_filter=False)]
        return asyncio.run(collect())

    t_tunix, results = best_of(run_tunix, args.repeats)
    tunix_turns = sum(len(t.steps) for _, t in results)
    tunix_tokens = sum(sampled)  # of the last (timed) collection
    print(f"rollout {traj.batch_size} episodes x {args.turns} turns: ours {t_ours:7.2f} s ({ours_turns / t_ours:8.1f} "
          f"env-turns/s, {ours_tokens / t_ours:8.1f} sampled tok/s)   Tunix agentic loop {t_tunix:7.2f} s "
          f"({tunix_turns / t_tunix:8.1f} env-turns/s, {tunix_tokens / t_tunix:8.1f} sampled tok/s)   "
          f"ratio {(ours_turns / t_ours) / (tunix_turns / t_tunix):5.2f}x (env-turns/s)", flush=True)
    return dict(episodes=traj.batch_size, ours_s=t_ours, tunix_s=t_tunix, ours_turns=ours_turns,
                tunix_turns=tunix_turns, ours_tokens=ours_tokens, tunix_tokens=tunix_tokens)


# ---------------------------------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 0.5b on a GPU, tiny otherwise")
    p.add_argument("--phases", default="decode,update,rollout", help="comma list of: decode, update, rollout")
    p.add_argument("--batches", default="16,64")
    p.add_argument("--prompt-len", type=int, default=32, help="decode: prompts are left-padded to this many tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="decode: new tokens per row")
    p.add_argument("--update-batch", type=int, default=32)
    p.add_argument("--update-prompt-len", type=int, default=128)
    p.add_argument("--update-completion-len", type=int, default=128)
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--turn-tokens", type=int, default=32, help="rollout: new tokens per turn")
    p.add_argument("--matmul", type=int, default=2048, help="size n of the [n, n] @ [n, n] peak measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="decode only: bfloat16 = Tunix with dtype and param_dtype bfloat16 (its knobs), ours with "
                        "param_dtype and matmul_dtype bfloat16 (bfloat16 matmul operands, float32 results)")
    p.add_argument("--out", help="write the results (markdown) to this file")
    args = p.parse_args(argv)
    args.batch_list = [int(b) for b in args.batches.split(",")]
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = set(phases) - {"decode", "update", "rollout"}
    if unknown:
        raise SystemExit(f"unknown --phases {sorted(unknown)}; choose from decode, update, rollout")
    if args.dtype != "float32" and phases != ["decode"]:
        raise SystemExit("--dtype bfloat16 applies to the decode phase only: pass --phases decode")
    if args.episodes % GROUP_SIZE:
        raise SystemExit(f"--episodes must be a multiple of the group size {GROUP_SIZE}")
    try:
        import tunix  # noqa: F401
    except ImportError:
        raise SystemExit('Tunix is not installed: pip install -e ".[bench]" (google-tunix==0.1.7)')

    import jax
    import transformers
    from flax import nnx

    from ragen_jax.models.loading import load_hf

    shape = args.shape or ("0.5b" if jax.default_backend() == "gpu" else "tiny")
    peak = matmul_peak(args.matmul, args.repeats)
    print(f"{jax.default_backend()}, {os.cpu_count()} CPUs; fp32 matmul peak ({args.matmul}^3): {peak / 1e9:.1f} GFLOP/s",
          flush=True)
    results = dict(peak=peak, shape=shape)
    with tempfile.TemporaryDirectory() as directory:
        hf = write_checkpoint(directory, shape)
        tok = transformers.AutoTokenizer.from_pretrained(directory)
        mixed = dict(param_dtype="bfloat16", matmul_dtype="bfloat16") if args.dtype == "bfloat16" else {}
        cfg, model = load_hf(directory, **mixed)
        graphdef, params = nnx.split(model)
        ours = (cfg, graphdef, params)
        tunix = tunix_model(directory, hf, args.dtype)
        if "decode" in phases:
            results["decode"] = bench_decode(args, directory, ours, tunix, tok)
        if "update" in phases:
            results["update"] = bench_update(args, hf, directory, tok)
        if "rollout" in phases:
            results["rollout"] = bench_rollout(args, hf, ours, tunix, tok)

    lines = report(args, argv, hf, results)
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.out}")


def decode_check(row: dict) -> str:
    if not row["tunix_departures"]:
        return "identical tokens" if row["identical"] == 1 else f"identical in {row['identical']:.0%} of rows (bfloat16)"
    where = ", ".join(f"{d['position']} (gap {d['gap']:.2f})" for d in row["tunix_departures"])
    return (f"identical in {row['identical']:.0%} of rows; in the others Tunix leaves the transformers argmax "
            f"(ours keeps it) at new token {where}")


def report(args, argv, hf, results) -> list[str]:
    import jax

    precision = ("fp32" if args.dtype == "float32" else "bfloat16 (Tunix: dtype and param_dtype bfloat16; ours: "
                 "bfloat16 weights and matmul operands, float32 results)")

    peak = results["peak"]
    versions = ", ".join(f"{name} {metadata.version(name)}" for name in ("jax", "flax", "google-tunix", "transformers"))
    d, n = hf["hidden_size"], hf["num_hidden_layers"]
    lines = [
        "# ragen_jax vs Tunix: decode, GRPO update, multi-turn rollout",
        "",
        f"Command: `python benchmarks/vs_tunix.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, backend {jax.default_backend()}, load average at "
        f"the end {os.getloadavg()[0]:.1f}; {versions}.  ",
        f"Model: random Qwen2 ({results['shape']}: d{d}, {n} layers, {hf['num_attention_heads']} heads / "
        f"{hf['num_key_value_heads']} kv heads, MLP {hf['intermediate_size']}, vocab {hf['vocab_size']}), {precision}, one "
        f"safetensors checkpoint loaded by each side. Best of {args.repeats} after compilation. fp32 matmul peak "
        f"{peak / 1e9:.1f} GFLOP/s; \"of peak\" = model FLOPs per token x tokens/s / peak.",
        "",
        "| phase | setting | ours | Tunix | ours / Tunix | ours of peak | Tunix of peak | check |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results.get("decode", []):
        f = forward_flops_per_token(hf, r["context"])
        lines.append(f"| decode (greedy) | batch {r['batch']}, {args.prompt_len}-token prompts, {args.new_tokens} new | "
                     f"{r['ours_tps']:.0f} tok/s | {r['tunix_tps']:.0f} tok/s | {r['ours_tps'] / r['tunix_tps']:.2f}x | "
                     f"{f * r['ours_tps'] / peak:.1%} | {f * r['tunix_tps'] / peak:.1%} | {decode_check(r)} |")
    if "update" in results:
        u = results["update"]
        f = 3 * forward_flops_per_token(hf, u["context"])
        ours_tps, tunix_tps = u["tokens"] / u["ours_s"], u["tokens"] / u["tunix_s"]
        lines.append(f"| GRPO update step | {u['rows']} rows, {u['tokens']} tokens | {u['ours_s'] * 1e3:.0f} ms "
                     f"({ours_tps:.0f} tok/s) | {u['tunix_s'] * 1e3:.0f} ms ({tunix_tps:.0f} tok/s) | "
                     f"{u['tunix_s'] / u['ours_s']:.2f}x | {f * ours_tps / peak:.1%} | {f * tunix_tps / peak:.1%} | "
                     f"loss, grad norm, entropy within {u['max_rel_diff']:.0e} |")
    if "rollout" in results:
        r = results["rollout"]
        ours_tps, tunix_tps = r["ours_turns"] / r["ours_s"], r["tunix_turns"] / r["tunix_s"]
        lines.append(f"| multi-turn rollout | FrozenLake, {r['episodes']} episodes x {args.turns} turns, "
                     f"{args.turn_tokens} tokens/turn | {ours_tps:.1f} env-turns/s ({r['ours_tokens'] / r['ours_s']:.0f} "
                     f"tok/s) | {tunix_tps:.1f} env-turns/s ({r['tunix_tokens'] / r['tunix_s']:.0f} tok/s) | "
                     f"{ours_tps / tunix_tps:.2f}x | | | same first prompts |")
    return lines


if __name__ == "__main__":
    main()
