"""Theorem proving in Lean 4, one tactic per turn, checked by a Kimina Lean server (RAGEN's ``lean``).

    python -m ragen_jax.launch --config configs/lean.py --config.env.data_path=/data/minif2f.jsonl \\
        --config.env.server_url=http://127.0.0.1:8000 --config.model.preset=qwen2.5-0.5b --config.model.path=...

Needs a running Kimina Lean server (Lean, Mathlib; see its README) and a JSONL file of theorems
(``formal_statement`` ending in ``:= by``; ``environments/code/lean.py``). The original's rewards:
−0.1 a step, +1 / −1 for an accepted / rejected tactic, +10 for a complete proof, −1 when Lean times
out, −2 at the step cap (``env.max_steps``; the rollout's turn budget usually ends an episode first).
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/lean"
    c.env = base.ConfigDict(dict(name="lean", server_url="http://127.0.0.1:8000", request_timeout_s=60.0,
                                 max_retries=3, max_steps=20, max_obs_tokens=1024, step_timeout_s=300.0))
    c.env.data_path = base.config_dict.placeholder(str)
    c.env.api_key_env = base.config_dict.placeholder(str)
    c.rollout.update(dict(num_groups=4, group_size=4, max_turns=8, max_actions_per_turn=1, max_actions_per_traj=8,
                          max_new_tokens=128, max_seq_len=4096, max_words=100))
    c.starpo.adv_estimator = "grpo"
    c.starpo.mini_batch_size = 8
    c.eval.num_episodes = 32
    return c
