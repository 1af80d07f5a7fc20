"""An attempt at template collapse on purpose: the main job's model and warm-up, with the settings
under which an earlier version's first-turn reasoning drifted into an input-independent template.

    python -m ragen_jax.launch --config configs/frozen_lake_collapse.py
    tensorboard --logdir runs/frozen_lake_collapse   # collapse/*, early_stop/mi_collapse, collapse/quadrant

Two changes from ``configs/frozen_lake.py``: the whole conversation is the context
(``rollout.context_mode="full"``: in later turns the model has to find the latest of several
boards, and the reward never checks that the reasoning names the right cells), and 4 start states ×
8 samples per step at a constant learning rate (fewer, noisier groups per update). Under these
settings an earlier version measured I(X;Z) on first-turn reasoning falling from 0.80 to 0.39 within
~100 StarPO steps at a flat H(Z|X) of 0.05. **With the current code it does not collapse**: MI
0.77 at step 1, then 0.40-0.74 (no trend) through step 200, H(Z|X) 0.005-0.17, retrieval accuracy
mostly 1.0, validation 0.56 -> 0.72 (``docs/experiments.md``). Since that measurement the MI proxy
scores only replies that parse and log-probs at the sampling temperature, and this warm-up's
first phase ran to its cap. A configuration that reliably collapses is still to be found; the
planted-collapse tests (``tests/starpo/``) pin the estimator itself (copying: MI ~ log N; a
prompt-blind template: ~0).
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
