"""BFS experts on hand-worked levels whose optimal lengths were counted by hand."""
import numpy as np
import pytest

from environments.frozen_lake.expert import frozen_lake_shortest_path
from environments.sokoban.expert import solve_sokoban
from tests.environments.reference_sokoban import ReferenceSokoban

UP, DOWN, LEFT, RIGHT = range(4)
SOKO_CODES = {"#": 0, "_": 1, "O": 2, "√": 3, "X": 4, "P": 5, "S": 6}


def parse(rows):
    """Text room -> (room_fixed, room_state) in gym-sokoban codes."""
    state = np.array([[SOKO_CODES[ch] for ch in row] for row in rows])
    fixed = np.where(state == 0, 0, 1)
    fixed[(state == 2) | (state == 3) | (state == 6)] = 2
    state = np.where(state == 6, 5, state)
    return fixed, state


def replay_solves(fixed, state, actions):
    ref = ReferenceSokoban(fixed, state)
    terminated = False
    for a in actions:
        _, terminated, _, _ = ref.step(a)
    return terminated


@pytest.mark.parametrize(
    "rows,length",
    [
        # RAGEN example: Left, Up, Up.
        (["######", "#O####", "#__###", "#X_###", "#_P_##", "######"], 3),
        # Corridor: step, then two pushes.
        (["#######", "#P_X_O#", "#######"], 3),
        # Walk around the box (4 moves) to push it down once.
        (["######", "#____#", "#_X__#", "#_O_P#", "######"], 5),
        # Two boxes: push the top one home (3), walk round to the east of the other (3), push twice.
        (["#######", "#O_X_P#", "#O_X__#", "#######"], 8),
    ],
)
def test_solve_sokoban_optimal_lengths(rows, length):
    fixed, state = parse(rows)
    sol = solve_sokoban(fixed, state)
    assert sol is not None and len(sol) == length
    assert replay_solves(fixed, state, sol)


def test_solve_sokoban_exact_sequences_and_edge_cases():
    fixed, state = parse(["######", "#O####", "#__###", "#X_###", "#_P_##", "######"])
    assert solve_sokoban(fixed, state) == [LEFT, UP, UP]
    fixed, state = parse(["#######", "#P_X_O#", "#######"])
    assert solve_sokoban(fixed, state) == [RIGHT, RIGHT, RIGHT]
    # A box in a corner that is not a target can never move: unsolvable.
    fixed, state = parse(["#####", "#X__#", "#_PO#", "#####"])
    assert solve_sokoban(fixed, state) is None
    # Already solved; also the JAX env's code 6 (player on target) is accepted.
    fixed, state = parse(["#####", "#√P_#", "#####"])
    assert solve_sokoban(fixed, state) == []
    # The player starts on the box's target (the JAX env stores that as code 6): the box goes
    # round and back, 7 actions either way (Up then Left, or Left then Up).
    fixed, state = parse(["#####", "#S__#", "#_X_#", "#___#", "#####"])
    state6 = state.copy()
    state6[1, 1] = 6
    for st in (state, state6):
        sol = solve_sokoban(fixed, st)
        assert len(sol) == 7 and replay_solves(fixed, state, sol)
    fixed, state = parse(["#####", "#OX_#", "#_O_#", "#_P_#", "#####"])
    with pytest.raises(ValueError, match="1 boxes but 2 targets"):
        solve_sokoban(fixed, state)
    with pytest.raises(ValueError, match="exactly one player"):
        solve_sokoban(np.ones((3, 3)), np.ones((3, 3)))


FL_MOVES = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}  # Left, Down, Right, Up


def walk(desc, start, actions):
    r, c = start
    for a in actions:
        dr, dc = FL_MOVES[a]
        r, c = min(max(r + dr, 0), len(desc) - 1), min(max(c + dc, 0), len(desc[0]) - 1)
        assert desc[r][c] != "H", "path enters a hole"
    return r, c


def test_frozen_lake_shortest_path():
    desc = ["SFFF", "FHFH", "FFFH", "HFFG"]  # Gymnasium's 4x4 map
    path = frozen_lake_shortest_path(desc, (0, 0), (3, 3))
    assert len(path) == 6 and walk(desc, (0, 0), path) == (3, 3)
    # Action order Left, Down, Right, Up.
    assert frozen_lake_shortest_path(["SFG"], (0, 0), (0, 2)) == [2, 2]
    assert frozen_lake_shortest_path(["GFS"], (0, 2), (0, 0)) == [0, 0]
    assert frozen_lake_shortest_path(["S", "F", "G"], (0, 0), (2, 0)) == [1, 1]
    assert frozen_lake_shortest_path(["G", "F", "S"], (2, 0), (0, 0)) == [3, 3]
    # Detour round a hole: 4 actions instead of 2.
    assert len(frozen_lake_shortest_path(["SHG", "FFF"], (0, 0), (0, 2))) == 4
    assert frozen_lake_shortest_path(["SH", "HG"], (0, 0), (1, 1)) is None
    assert frozen_lake_shortest_path(desc, (2, 2), (2, 2)) == []


def test_frozen_lake_map_forms_agree():
    desc = ["SFFF", "FHFH", "FFFH", "HFFG"]
    holes = np.array([[ch == "H" for ch in row] for row in desc])
    codes = np.where(holes, 2, 1)  # FrozenLake render codes: 2 hole, 1 frozen
    forms = [desc, [r.encode() for r in desc], np.array([list(r) for r in desc]), holes, codes]
    paths = [frozen_lake_shortest_path(f, (0, 0), (3, 3)) for f in forms]
    assert all(p == paths[0] for p in paths)
    with pytest.raises(ValueError, match="outside"):
        frozen_lake_shortest_path(desc, (4, 0), (3, 3))
