"""Template collapse on purpose: the main job's model and warm-up, with the settings under which its
first-turn reasoning drifted into an input-independent template.

    python -m ragen_jax.launch --config configs/frozen_lake_collapse.py
    tensorboard --logdir runs/frozen_lake_collapse   # collapse/*, early_stop/mi_collapse, collapse/quadrant

Two changes from ``configs/frozen_lake.py`` do it. The whole conversation is the context
(``rollout.context_mode="full"``): in later turns the model has to find the latest of several boards,
and StarPO's reward never checks that the reasoning names the right cells — a reasoning that
restates the *first* board, or a habitual phrase, earns the same reward whenever the move happens
to be right. And 4 start states × 8 samples per step (instead of 8 × 4) at a constant learning rate:
fewer, noisier groups per update. Under these settings the MI proxy I(X;Z) on first-turn reasoning
fell from 0.80 to 0.39 within ~100 StarPO steps while the conditional entropy H(Z|X) stayed at 0.05:
the replies stayed confident and varied-looking, but carried half the information about their
board. Entropy alone does not see that; the MI proxy and the quadrant (``collapse.regime_*``) do,
and ``early_stop/mi_collapse`` raises the alert (``trainer.stop_on_mi_collapse=True`` stops the run
on it). The filter is left on (top-p 0.9), as in the main job.

MI is computed every 5 steps on 8 first-turn reasonings, each scored under every prompt of the batch.
"""
from configs import frozen_lake


def get_config():
    c = frozen_lake.get_config()
    c.workdir = "runs/frozen_lake_collapse"
    c.rollout.context_mode = "full"
    c.rollout.num_groups = 4
    c.rollout.group_size = 8
    c.starpo.lr_schedule = "constant"
    c.trainer.total_steps = 200
    c.trainer.time_limit_minutes = 0.0
    c.trainer.eval_every = 25
    return c
