"""Search-R1-style question answering through a tool: the BM25 ``search`` tool over the shipped
corpus, called in the Qwen/Hermes format, then finish[answer] (``ragen_jax/tools/env.py``).

    python -m ragen_jax.launch --config configs/search_tools.py      # tiny preset: warm-up, 40 StarPO steps
    python -m ragen_jax.launch --config configs/search_tools_smollm2.py  # SmolLM2-135M with LoRA

Each turn the answer holds tool calls, ``<tool_call>{"name": "search", "arguments": {"query": ...}}
</tool_call>``, or the final answer; the tool's output comes back as the next observation in
``<tool_response>`` tags (environment text, never in the loss). Reward: exact match, partial credit
for token F1 above 0.3 (as ``search_qa``). Questions and corpus are generated (fictional people and
towns, one- and two-hop), so it runs offline. Results on the tiny preset (0.028 exact match on the
36 held-out questions after the warm-up, 0.000 after StarPO): ``docs/results/tools_tiny``.
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/search_tools"
    c.env = base.ConfigDict(dict(name="tool_search", split="train", max_obs_tokens=1024, top_k=2, max_result_chars=600,
                                 max_turns=3, max_tool_calls=2))
    # 2,048 tokens hold the system prompt, three replies and two tool responses of two 600-character
    # passages (the tiny tokenizer spends ~2 characters a token); at 4,096 the update's attention over
    # whole transcripts peaked above 15 GB.
    c.rollout.update(dict(num_groups=4, group_size=4, max_turns=3, max_actions_per_turn=1, max_actions_per_traj=3,
                          max_new_tokens=128, context_mode="limited", context_window=2, max_seq_len=2048,
                          max_words=80))
    c.starpo.adv_estimator = "grpo"
    c.starpo.mini_batch_size = 8
    c.starpo.micro_batch_size = 4
    c.starpo.seq_len_multiple = 64  # the update runs on the longest transcript of the batch, not the budget
    c.filter.dynamic_sampling_rounds = 0  # one rollout a step: the tool's episodes are the slow part

    # Zero-shot the tiny model never writes a tool call: a warm-up clones the task's expert
    # (ToolSearchQA.expert) on whole conversations first.
    c.warmup.steps = 300
    c.warmup.batch_size = 16
    c.warmup.lr = 3e-3
    c.warmup.num_states = 576  # every train question four times over (a row's question is its seed mod 144)
    c.warmup.time_share = 0.0

    c.trainer.total_steps = 40
    c.trainer.eval_every = 20
    c.trainer.save_every = 20
    c.trainer.time_limit_minutes = 0.0
    c.eval.num_episodes = 32
    return c
