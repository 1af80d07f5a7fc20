"""2048 (RAGEN's ``game_2048`` tag): one move per turn, merge rewards on the log scale.

    python -m ragen_jax.launch --config configs/game_2048.py

The original lets an episode run 700 moves (``max_actions_per_traj``) with a 8,192-token budget; on
a CPU a run sees the opening: 10 turns of one move each, the context limited to the current turn
(2048 is Markov: the board and the score are all there is). A short behaviour-cloning warm-up on
the expectimax expert (``environments.game_2048.expert.best_2048_move``) gives StarPO valid moves to start
from; ``env.use_log_reward=False`` switches to the raw merge sum.
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/game_2048"
    c.env = base.ConfigDict(dict(name="game_2048", two_prob=0.9, use_log_reward=True))
    c.rollout.update(dict(num_groups=8, group_size=4, max_turns=10, max_actions_per_turn=1, max_actions_per_traj=10,
                          max_new_tokens=96, context_mode="limited", context_window=1, max_seq_len=1536,
                          max_words=30))
    c.starpo.adv_estimator = "grpo"
    c.starpo.mini_batch_size = 16
    c.warmup.update(dict(single_turn_steps=200, steps=100, batch_size=8, num_states=256))
    c.eval.num_episodes = 64
    return c
