"""Search-R1-style question answering through a tool: the BM25 ``search`` tool over the shipped
corpus, called in the Qwen/Hermes format, then finish[answer] (``ragen_jax/tools/env.py``).

    python -m ragen_jax.launch --config configs/search_tools.py
    python -m ragen_jax.launch --config configs/search_tools.py --config.model.preset=smollm2_135m

Each turn the answer holds tool calls, ``<tool_call>{"name": "search", "arguments": {"query": ...}}
</tool_call>``, or the final answer; the tool's output comes back as the next observation in
``<tool_response>`` tags (environment text, never in the loss). Reward: exact match, partial credit
for token F1 above 0.3 (as ``search_qa``). Questions and corpus are generated (fictional people and
towns, one- and two-hop), so it runs offline.
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/search_tools"
    c.env = base.ConfigDict(dict(name="tool_search", split="train", max_obs_tokens=1024, top_k=2, max_result_chars=600,
                                 max_turns=3, max_tool_calls=2))
    c.rollout.update(dict(num_groups=4, group_size=4, max_turns=3, max_actions_per_turn=1, max_actions_per_traj=3,
                          max_new_tokens=128, context_mode="limited", context_window=2, max_seq_len=4096,
                          max_words=80))
    c.starpo.adv_estimator = "grpo"
    c.starpo.mini_batch_size = 8
    c.eval.num_episodes = 32
    return c
