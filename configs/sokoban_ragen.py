"""Sokoban 6×6 with one box (RAGEN's SimpleSokoban) with RAGEN's training defaults:
8 groups × 16 episodes, 5 turns of up to 400 tokens, GAE with a critic — the settings for real
models on accelerators (``configs/sokoban.py`` is the one that learns on a 2-core CPU).

    python -m ragen_jax.launch --config configs/sokoban_ragen.py --config.model.preset=qwen2.5-0.5b \
        --config.model.path=/models/Qwen2.5-0.5B-Instruct
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/sokoban_ragen"
    c.env.name = "sokoban"
    c.env.dim_room = (6, 6)
    c.env.num_boxes = 1
    c.env.observation_format = "grid"
    return c
