"""Template collapse on purpose: the main job with a 5x learning rate and no SNR filter.

    python -m ragen_jax.launch --config configs/frozen_lake_collapse.py
    tensorboard --logdir runs/frozen_lake_collapse   # collapse/*, early_stop/mi_collapse, collapse/quadrant

Three changes from ``configs/frozen_lake.py``: ``starpo.actor_lr=2.5e-3`` at a constant rate (the
main job: 5e-4 with a cosine decay), the SNR filter off (every group trains, zero-variance ones too),
and the MI proxy every 2 steps with validation every 10. Measured (one seed, 120 StarPO steps, 3.5
min after a cached warm-up; ``docs/experiments.md``, ``docs/collapse_template_frozen_lake.png``):
first-turn I(X;Z) falls from 0.97 to 0.2-0.3 while H(Z|X) rises from 0.07 to 0.2-0.3, and from step
70 on every computation is classified ``template_collapse`` (low MI, higher H(Z|X): varied reasoning
that no longer depends on the board). Validation falls with it, 0.64 -> 0.19 at step 60, then
recovers to 0.47. It is not the textbook sequence: H(Z|X) rises rather than staying flat, and
validation falls from step 10 while MI is still high; the alert (``early_stop/mi_collapse``, MI
below 0.7x the baseline for 3 computations) fires at step 38. Seeds 1 and 2 fall less (MI to
0.5-0.7 of the baseline, mostly "diverse"); with the SNR filter on, validation falls faster (0.21
against 0.48 at the end over 3 seeds). With ``actor_lr=1.5e-3`` nothing collapses (MI 0.5-0.9,
validation 0.71); with 5e-3 the policy breaks at once (training success 0.62 -> 0.03 in 4 steps,
then MI 0 and H(Z|X) 0: one fixed reply, low-entropy collapse).
"""
from configs import frozen_lake


def get_config():
    c = frozen_lake.get_config()
    c.warmup.time_share = 0.0  # no time limit here
    c.workdir = "runs/frozen_lake_collapse"
    # The expert text and reply lengths this config's collapse was measured with.
    c.env.expert_reasoning = "after_move"
    c.rollout.max_new_tokens = 40
    c.rollout.max_seq_len = 544
    c.collapse.max_reasoning_tokens = 40
    c.starpo.actor_lr = 2.5e-3
    c.starpo.lr_schedule = "constant"
    c.filter.value = 1.0
    c.filter.include_zero = True
    c.collapse.compute_freq = 2
    c.trainer.total_steps = 120
    c.trainer.time_limit_minutes = 0.0
    c.trainer.eval_every = 10
    c.trainer.save_every = 60
    return c
