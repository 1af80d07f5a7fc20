"""Search QA (RAGEN's ``SearchQA`` tag): search[...] a local corpus with BM25, then finish[...].

    python -m ragen_jax.launch --config configs/search_qa.py
    python -m environments.text.retrieval_server --port 8000 &   # optional: retrieval over HTTP, like the original
    python -m ragen_jax.launch --config configs/search_qa.py --config.env.retrieval_url=http://127.0.0.1:8000
    python -m ragen_jax.launch --config configs/search_qa.py --config.env.name=SearchQAMock

The shipped corpus and questions are generated (fictional people and towns, one- and two-hop
questions); point ``corpus_path`` / ``questions_path`` at your own JSONL files.
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/search_qa"
    c.env = base.ConfigDict(dict(name="SearchQA", max_obs_tokens=1024, max_search_results=3))
    c.rollout.update(dict(num_groups=4, group_size=4, max_turns=3, max_actions_per_turn=1, max_actions_per_traj=3,
                          max_new_tokens=64, context_mode="limited", context_window=2, max_seq_len=4096,
                          max_words=60))
    c.starpo.adv_estimator = "grpo"
    c.starpo.mini_batch_size = 8
    c.eval.num_episodes = 32
    return c
