"""Sokoban 6×6 with one box (RAGEN's SimpleSokoban), RAGEN's training defaults (spec §0, §5.6).

    python -m ragen_jax.launch --config configs/sokoban.py
    python -m ragen_jax.launch --config configs/sokoban.py --config.env.observation_format=grid_coord
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/sokoban"
    c.env.name = "sokoban"
    c.env.dim_room = (6, 6)
    c.env.num_boxes = 1
    c.env.observation_format = "grid"
    return c
