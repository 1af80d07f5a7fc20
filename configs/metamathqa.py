"""Math QA in the MetaMathQA format (RAGEN's ``MetamathQA`` tag), a Python env in the on-device loop.

    python -m ragen_jax.launch --config configs/metamathqa.py
    python -m ragen_jax.launch --config configs/metamathqa.py --config.env.data_path=/data/MetaMathQA-395K.json

By default the shipped arithmetic word problems (no download). Up to three tries; a correct
answer on try k earns 1/2**k.
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/metamathqa"
    c.env = base.ConfigDict(dict(name="MetamathQA", max_obs_tokens=256))
    c.env.data_path = base.config_dict.placeholder(str)
    c.rollout.update(dict(num_groups=8, group_size=4, max_turns=3, max_actions_per_turn=1, max_actions_per_traj=3,
                          max_new_tokens=96, max_seq_len=1536, max_words=60))
    c.starpo.adv_estimator = "grpo"
    c.starpo.mini_batch_size = 16
    c.eval.num_episodes = 64
    return c
