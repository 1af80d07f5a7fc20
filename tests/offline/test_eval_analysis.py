"""The eval-transcript failure analysis on hand-made FrozenLake transcripts (hand-worked answers)."""
import json

import pytest

from ragen_jax.offline import eval_analysis

SYSTEM = "<|im_start|>system\nYou are solving the FrozenLake puzzle.\n<|im_end|>\n"
# Player (0, 0), goal (1, 3), a hole at (0, 1): shortest safe path Down, Right, Right, Right.
BOARD = ["PO__", "___G", "____", "O___"]
AFTER_DOWN_RIGHT = ["_O__", "_P_G", "____", "O___"]


def transcript(*turns):
    text = SYSTEM
    for t, (board, reply) in enumerate(turns):
        text += (f"<|im_start|>user\nTurn {t + 1}:\nState:\n" + "\n".join(board) +
                 "\nYou have 6 actions left.\n<|im_end|>\n<|im_start|>assistant\n" + reply + "<|im_end|>\n")
    return text


def reply(player, goal, actions):
    cells = f"The player is at ({player[0]}, {player[1]}) and the goal at ({goal[0]}, {goal[1]})"
    return f"<think>{cells}; moving on.</think><answer>{' || '.join(actions)}</answer>"


RECORDS = [
    # solved in two turns, every move a shortest-path move: not a failure
    dict(step=5, success=True, transcript=transcript((BOARD, reply((0, 0), (1, 3), ["Down", "Right"])),
                                                    (AFTER_DOWN_RIGHT, reply((1, 1), (1, 3), ["Right", "Right"])))),
    # Right from (0, 0) is the hole
    dict(step=5, success=False, transcript=transcript((BOARD, reply((0, 0), (1, 3), ["Right"])))),
    # wrong player cell named, the moves themselves fine; then the actions ran out
    dict(step=5, success=False, transcript=transcript((BOARD, reply((2, 0), (1, 3), ["Down", "Right"])))),
    # no answer block
    dict(step=5, success=False, transcript=transcript((BOARD, "<think>hmm</think>"))),
    # Up from row 0 stays put: not nearer
    dict(step=5, success=False, transcript=transcript((BOARD, reply((0, 0), (1, 3), ["Up", "Down"])))),
    # shortest moves only, budget spent
    dict(step=5, success=False, transcript=transcript((BOARD, reply((0, 0), (1, 3), ["Down", "Right"])))),
    # an answer word that is not an action
    dict(step=5, success=False, transcript=transcript((BOARD, reply((0, 0), (1, 3), ["Jump"])))),
    # an earlier evaluation, ignored by default
    dict(step=1, success=False, transcript=transcript((BOARD, reply((0, 0), (1, 3), ["Right"])))),
]


def test_first_wrong_thing_per_failed_episode(tmp_path):
    path = tmp_path / "transcripts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out = eval_analysis.main([str(path)])
    assert out["episodes"] == 7 and out["failures"] == 6
    assert out["first_wrong"] == {"malformed": 1, "wrong cells": 1, "invalid": 1, "into a hole": 1,
                                  "not nearer": 1, "budget": 1}
    # turns: 2 + 1 × 6; cells right in all but the wrong-cells and the malformed turn
    assert out["turns"] == 8
    assert out["turns_naming_both_cells"] == pytest.approx(6 / 8)
    # moves checked: 4 (solved) + 1 (hole) + 2 (wrong cells) + 1 (Up) + 2 (budget) = 10, of which
    # the hole and the Up are not shortest-path moves ("Jump" is not a move)
    assert out["moves"] == 10
    assert out["shortest_path_moves"] == pytest.approx(8 / 10)
    assert eval_analysis.main([str(path), "--step", "1"])["first_wrong"]["into a hole"] == 1


def test_a_transcript_without_a_grid_is_a_clear_error():
    with pytest.raises(ValueError, match="grid"):
        eval_analysis.turns_of(SYSTEM + "<|im_start|>user\nState:\nPlayer: (0, 0)\n<|im_end|>\n"
                                        "<|im_start|>assistant\n<think>x</think>")


def test_attempt_spread_counts_never_sometimes_always_solved_puzzles():
    """Hand-worked: puzzle 0 solved 2 of 2, puzzle 1 once of 2, puzzle 2 never, puzzle 3 once of 2:
    mean success (1 + 0.5 + 0 + 0.5) / 4 = 0.5; sharpened, every puzzle but 2 always: 3 / 4."""
    outcomes = {0: [True, True], 1: [False, True], 2: [False, False], 3: [True, False]}
    records = [dict(step=0, puzzle=p, attempt=a, success=s) for p, v in outcomes.items() for a, s in enumerate(v)]
    assert eval_analysis.attempt_spread(records) == {
        "puzzles": 4, "attempts": 2, "never": 1, "sometimes": 2, "always": 1, "success": 0.5,
        "sharpening_bound": 0.75}
    # One attempt per puzzle says nothing about the spread.
    assert eval_analysis.attempt_spread([dict(r, attempt=0) for r in records if r["attempt"] == 0]) is None


def test_cli_reports_the_attempt_spread_of_another_environment(tmp_path, capsys):
    """Transcripts without FrozenLake boards (here: none at all) still get their attempt spread."""
    path = tmp_path / "t.jsonl"
    rows = [dict(step=3, puzzle=p, attempt=a, success=p == 0 or a == 0, transcript="<|im_start|>assistant\nx")
            for p in range(2) for a in range(2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = eval_analysis.main([str(path)])
    assert result["attempt_spread"]["sometimes"] == 1 and result["attempt_spread"]["always"] == 1
    assert "not run" in result["failure_analysis"]


def test_spread_transitions_pair_two_evaluations_of_the_same_puzzles(tmp_path):
    """Hand-worked, 2 attempts each. Before: p0 never, p1 sometimes, p2 sometimes, p3 always.
    After: p0 sometimes (new behaviour), p1 always (sharpened), p2 never (lost), p3 always.
    Class means: never 0 -> 0.5; sometimes (p1, p2) 0.5 -> (1 + 0) / 2 = 0.5; always 1 -> 1."""
    def records(step, outcomes):
        return [dict(step=step, puzzle=p, attempt=a, success=s, transcript="x")
                for p, v in outcomes.items() for a, s in enumerate(v)]
    before = records(0, {0: [False, False], 1: [True, False], 2: [False, True], 3: [True, True]})
    after = records(200, {0: [False, True], 1: [True, True], 2: [False, False], 3: [True, True]})
    out = eval_analysis.spread_transitions(before, after)
    assert out["moved"] == {"never": {"never": 0, "sometimes": 1, "always": 0},
                            "sometimes": {"never": 1, "sometimes": 0, "always": 1},
                            "always": {"never": 0, "sometimes": 0, "always": 1}}
    assert out["success"] == {"never": {"puzzles": 1, "before": 0.0, "after": 0.5},
                              "sometimes": {"puzzles": 2, "before": 0.5, "after": 0.5},
                              "always": {"puzzles": 1, "before": 1.0, "after": 1.0}}
    # Through the CLI (--before takes the earlier file's last evaluation).
    a, b = tmp_path / "after.jsonl", tmp_path / "before.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in after))
    b.write_text("".join(json.dumps(r) + "\n" for r in before))
    assert eval_analysis.main([str(a), "--before", str(b)])["spread_transitions"] == out
    # Different puzzles cannot be paired: a clear error naming the counts.
    with pytest.raises(ValueError, match="different puzzles"):
        eval_analysis.spread_transitions(before, [r for r in after if r["puzzle"] != 3])


# Sokoban boards with hand-worked fewest-action solutions (RAGEN's symbols).
SOKOBAN_SIX = ["######", "#P___#", "#_X__#", "#___O#", "#____#", "######"]  # Right, Down (push), Left, Down,
# Right (push), Right (push): the box must go down once and right twice, the player behind it each time.
SOKOBAN_ONE = ["#####", "#PXO#", "#####"]  # one push
SOKOBAN_STUCK = ["#####", "#XP_#", "#O__#", "#####"]  # the box is in a corner: unsolvable


def test_sokoban_shortest_solution_length_of_hand_worked_boards():
    from environments.sokoban.expert import parse_grid, shortest_solution_length

    assert shortest_solution_length(SOKOBAN_SIX) == 6
    assert shortest_solution_length(SOKOBAN_ONE) == 1
    assert shortest_solution_length(["#####", "#P_√#", "#####"]) == 0
    assert shortest_solution_length(SOKOBAN_STUCK) is None
    fixed, state = parse_grid(["####", "#S√#", "####"])  # player on a target, box on a target
    assert fixed.tolist() == [[0, 0, 0, 0], [0, 2, 2, 0], [0, 0, 0, 0]]
    assert state.tolist() == [[0, 0, 0, 0], [0, 6, 3, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match=r"symbols \['\?'\]"):
        parse_grid(["#?#"])


def test_parse_grid_reads_back_the_envs_render():
    """The env's host render of generated levels, read back, is the level (codes, targets)."""
    import jax
    import numpy as np

    from environments.sokoban.env import Sokoban
    from environments.sokoban.expert import parse_grid

    env = Sokoban(dim_room=(6, 6), num_boxes=1)
    params = env.default_params()
    for seed in range(4):
        _, state = env.reset_env(jax.random.PRNGKey(seed), params)
        fixed, grid = parse_grid(env.render_text(state, "grid").split("\n"))
        np.testing.assert_array_equal(fixed, np.asarray(state.room_fixed))
        np.testing.assert_array_equal(grid, np.asarray(state.grid))


def test_success_by_solution_length_groups_puzzles_by_their_first_board(tmp_path):
    """Hand-worked: p0 and p1 are one-push levels, p2 needs six actions; 2 attempts each.
    Now: p0 2/2, p1 1/2 -> length 1 at (1 + 0.5) / 2 = 0.75; p2 0/2 -> 0. Before: p0 1/2, p1 0/2
    -> 0.25; p2 1/2 -> 0.5."""
    def sokoban_transcript(board):
        return ("<|im_start|>system\nYou are solving the Sokoban puzzle.\n<|im_end|>\n<|im_start|>user\n"
                "Turn 1:\nState:\n" + "\n".join(board) + "\nYou have 10 actions left.\n<|im_end|>\n"
                "<|im_start|>assistant\n<answer>Right</answer><|im_end|>\n")
    boards = {0: SOKOBAN_ONE, 1: SOKOBAN_ONE, 2: SOKOBAN_SIX}

    def records(step, outcomes):
        return [dict(step=step, puzzle=p, attempt=a, success=s, transcript=sokoban_transcript(boards[p]))
                for p, v in outcomes.items() for a, s in enumerate(v)]
    now = records(400, {0: [True, True], 1: [True, False], 2: [False, False]})
    before = records(0, {0: [True, False], 1: [False, False], 2: [True, False]})
    out = eval_analysis.success_by_solution_length(now, "sokoban", before)
    assert out == {1: {"puzzles": 2, "success": 0.75, "before": 0.25}, 6: {"puzzles": 1, "success": 0.0, "before": 0.5}}
    # FrozenLake: the shortest safe path from the first board (BOARD: 4 moves).
    fl = [dict(step=5, puzzle=0, attempt=0, success=True, transcript=RECORDS[0]["transcript"])]
    assert eval_analysis.success_by_solution_length(fl, "frozen_lake") == {4: {"puzzles": 1, "success": 1.0}}
    # Through the CLI, with the earlier evaluation picked out of the same file by --before_step.
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in before + now))
    result = eval_analysis.main([str(path), "--before", str(path), "--before_step", "0", "--by_length", "sokoban"])
    assert result["step"] == 400 and result["by_solution_length"] == out
    # One attempt per puzzle (no attempt spread) and boards that are not FrozenLake's: still analysed.
    single = tmp_path / "single.jsonl"
    single.write_text("".join(json.dumps(r) + "\n" for r in now if r["attempt"] == 0))
    result = eval_analysis.main([str(single), "--by_length", "sokoban"])
    assert result["by_solution_length"] == {1: {"puzzles": 2, "success": 1.0}, 6: {"puzzles": 1, "success": 0.0}}
    assert "not run" in result["failure_analysis"]
    with pytest.raises(ValueError, match="other puzzles"):
        eval_analysis.success_by_solution_length(now, "sokoban", [r for r in before if r["puzzle"] != 2])
    with pytest.raises(ValueError, match="known for"):
        eval_analysis.success_by_solution_length(now, "bandit")
