"""StarPO: advantages, losses, the SNR filter, collapse diagnostics (MI proxy) and the jitted update step.

    from ragen_jax.config import StarPOConfig, FilterConfig, CollapseConfig   # config.starpo, .filter, .collapse
    from ragen_jax.starpo import init_train_state, make_update_step

    graphdefs, state = init_train_state(policy, starpo_cfg, key=key, critic=critic)
    update = make_update_step(graphdefs, starpo_cfg, filter_cfg, collapse_cfg, group_size=16)
    state, metrics = update(state, trajectory)
"""
from ragen_jax.starpo.update import Graphdefs, TrainState, init_train_state, make_loss_fn, make_update_step

__all__ = ["Graphdefs", "TrainState", "init_train_state",
           "make_loss_fn", "make_update_step"]
