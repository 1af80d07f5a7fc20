"""Sokoban 6×6 with one box (RAGEN's SimpleSokoban) on a 2-core CPU: the main job's recipe, the
tiny preset, a behaviour-cloning warm-up on BFS solutions, then StarPO. No downloads.

    python -m ragen_jax.launch --config configs/sokoban.py
    python -m ragen_jax.compare --config configs/sokoban.py \\
        --variants off:filter.value=1.0+filter.include_zero=true,top-p:filter.value=0.9 --seeds 2

Everything but the env and the episode shape is ``configs/frozen_lake.py``'s (whose docstring and
``docs/experiments.md`` explain each choice): a 64-wide model with ``rope_theta=100`` and 8 heads of
width 8 reads the cells off the board; Sokoban is Markov, so each turn shows the system prompt and
the current board only (one-turn window); the warm-up's first-turn phase ends once the model names
the player's, the box's and the target's cells on 95% of held-out boards, then it imitates whole
expert episodes; GRPO advantages, SNR filter top-p 0.9. Generated 6×6 one-box levels need 1-10
moves (median 4), so 5 turns of up to 2 actions fit every BFS solution; replies are longer (three
cells) and so is the transcript. The time limit is 28 minutes (a 30-minute run with start-up and
the final validation). Results: ``docs/experiments.md``.

Real models on accelerators: ``configs/sokoban_ragen.py`` (RAGEN's rollout shape and PPO defaults).
"""
from configs import base, frozen_lake


def get_config():
    c = frozen_lake.get_config()
    c.workdir = "runs/sokoban"
    c.env = base.ConfigDict(dict(name="sokoban", dim_room=(6, 6), num_boxes=1, observation_format="grid"))
    c.rollout.max_turns = 5
    c.rollout.max_actions_per_traj = 10
    c.rollout.max_new_tokens = 48
    c.rollout.max_seq_len = 1024
    c.collapse.max_reasoning_tokens = 48
    c.trainer.time_limit_minutes = 28.0
    return c
