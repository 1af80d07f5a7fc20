"""TextWorld: small text adventures generated locally by TextWorld, one command per turn.

    python -m ragen_jax.launch --config configs/textworld.py
    python -m ragen_jax.launch --config configs/textworld.py --config.env.quest_length=3 --config.env.num_games=32

Games are compiled once into ``~/.cache/ragen_jax/textworld`` (~3 s each).
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/textworld"
    c.env = base.ConfigDict(dict(name="textworld", num_games=8, nb_rooms=2, nb_objects=4, quest_length=2,
                                 max_obs_tokens=1536))
    c.rollout.update(dict(num_groups=4, group_size=4, max_turns=4, max_actions_per_turn=1, max_actions_per_traj=4,
                          max_new_tokens=48, context_mode="limited", context_window=1, max_seq_len=8192,
                          max_words=40))
    c.starpo.adv_estimator = "grpo"
    c.starpo.mini_batch_size = 8
    c.eval.num_episodes = 16
    return c
