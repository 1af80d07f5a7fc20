"""Sudoku (RAGEN's ``SimpleSudoku`` tag: 9×9, 40% of the cells blank, feedback after every move).

    python -m ragen_jax.launch --config configs/sudoku.py
    python -m ragen_jax.launch --config configs/sudoku.py --config.env.name=MediumSudoku

Answers are free text (``place 5 at row 2 col 3`` or ``2,3,5``) read on device by the env's own
parser. The board text is long (~600 tokens with the feedback): the context holds the current turn
only. The warm-up imitates the backtracking solver, filling the fewest-candidate cells first.
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/sudoku"
    c.env = base.ConfigDict(dict(name="SimpleSudoku"))
    c.rollout.update(dict(num_groups=4, group_size=4, max_turns=5, max_actions_per_turn=2, max_actions_per_traj=20,
                          max_new_tokens=128, context_mode="limited", context_window=1, max_seq_len=8192,
                          max_words=50))
    c.starpo.adv_estimator = "grpo"
    c.starpo.mini_batch_size = 8
    c.warmup.update(dict(single_turn_steps=200, steps=50, batch_size=4, num_states=128))
    c.eval.num_episodes = 32
    return c
