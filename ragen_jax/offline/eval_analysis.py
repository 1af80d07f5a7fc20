"""The eval transcripts analysed: where FrozenLake episodes fail, how often and how hard each puzzle is.

    python -m ragen_jax.offline.eval_analysis runs/frozen_lake/eval/transcripts.jsonl [--step N]

For every failed episode, the first wrong thing in it, turn by turn and action by action:

  * ``malformed``    the reply has no ``<answer>`` block, or its reasoning names no cells
                     (``The player is at (r, c) and the goal at (r, c)``, the warm-up's wording);
  * ``wrong cells``  the reasoning names a wrong player or goal cell;
  * ``invalid``      an answer word that is not an action;
  * ``into a hole``  a move onto a hole;
  * ``not nearer``   a move that does not shorten the shortest safe path to the goal;
  * ``budget``       every move was a shortest-path move, but the actions ran out.

Also, over all turns of all episodes: the share of turns whose reasoning names both cells right,
and the share of executed moves that are shortest-path moves. Boards are read back from the
transcripts' ``grid`` (or ``grid_coord``) observations, so the analysis needs nothing but the file.

With several attempts per puzzle (``--config.eval.pass_k=K``; any environment), ``attempt_spread``
splits the puzzles into never / sometimes / always solved, which bounds what RL can add by sharpening
the policy's own distribution: the success if every puzzle it sometimes solves were always solved
(``sharpening_bound``). A puzzle never solved in K attempts needs behaviour the policy does not yet
sample, which on-policy advantages (a group of all failures has no reward spread) cannot reward.

``--before FILE`` (the same puzzles evaluated earlier, e.g. right after the warm-up) adds
``spread_transitions``: how many puzzles moved from each class to each class, and each earlier class's
mean success then and now — where training sharpened (sometimes → always), where it reached new
behaviour (never → solved), and where it lost what the earlier policy could do (→ never).

    python -m ragen_jax.offline.eval_analysis AFTER.jsonl --before WARMUP.jsonl

``--by_length frozen_lake|sokoban`` adds ``by_solution_length``: the puzzles grouped by the fewest
actions that solve their first board (FrozenLake: the shortest safe path; Sokoban: BFS over player
and boxes, ``environments.sokoban.expert``), with each group's success (and, with ``--before``, its
success then) — which levels training gained or lost. Several files (one per seed, say) pool their
records; ``--step`` / ``--before_step`` pick an evaluation inside a run's transcripts file:

    python -m ragen_jax.offline.eval_analysis runs/sokoban/eval/transcripts.jsonl --step 400 \
        --before runs/sokoban/eval/transcripts.jsonl --before_step 0 --by_length sokoban
"""
from __future__ import annotations

import argparse
import collections
import json
import re
from collections import deque

from environments.sokoban.expert import shortest_solution_length
from environments.sokoban.render import DEFAULT_GRID_LOOKUP

MOVES = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}
CATEGORIES = ("malformed", "wrong cells", "invalid", "into a hole", "not nearer", "budget")
_CELLS = re.compile(r"player is at \((\d+), (\d+)\) and the goal at \((\d+), (\d+)\)")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_BOARD_CHARS = set("P_OGX√")  # FrozenLake's grid symbols


def turns_of(transcript: str, board_chars: set = _BOARD_CHARS) -> list[tuple[list[str], str]]:
    """``[(board rows, reply)]`` per assistant turn; the board is the grid shown in that turn's
    user message (the last ``State:`` block before the reply), rows of ``board_chars`` only."""
    parts = transcript.split("<|im_start|>assistant\n")
    out = []
    for before, after in zip(parts[:-1], parts[1:]):
        state = before.rsplit("State:\n", 1)
        if len(state) < 2:
            raise ValueError("a turn without a 'State:' observation; is this a FrozenLake eval transcript?")
        block = state[1].split("Grid Map: \n")[-1]
        rows = []
        for line in block.split("\n"):
            if line and set(line) <= board_chars:
                rows.append(line)
            elif rows:
                break
        if not rows:
            raise ValueError("no grid in a turn's observation; the analysis needs the 'grid' or 'grid_coord' "
                             "observation format")
        out.append((rows, after.split("<|im_end|>")[0]))
    return out


def distances(board: list[str]):
    """(player cell, goal cell, {cell: shortest safe path length to the goal}) by BFS from the goal."""
    n_rows, n_cols = len(board), len(board[0])
    find = lambda chars: next(((r, c) for r in range(n_rows) for c in range(n_cols) if board[r][c] in chars), None)
    player, goal = find("PX√"), find("G√")
    dist = {goal: 0}
    queue = deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES.values():
            q = (r + dr, c + dc)
            if 0 <= q[0] < n_rows and 0 <= q[1] < n_cols and q not in dist and board[q[0]][q[1]] != "O":
                dist[q] = dist[(r, c)] + 1
                queue.append(q)
    return player, goal, dist


def analyse(records: list[dict]) -> dict:
    """Failure categories (first wrong thing per failed episode) and per-turn / per-move rates."""
    failures = collections.Counter()
    turns = cells_right = moves = shortest = 0
    for rec in records:
        first_wrong = None
        for board, reply in turns_of(rec["transcript"]):
            player, goal, dist = distances(board)
            if player is None or player == goal or player not in dist:
                break  # the episode is over (on the goal or in a hole)
            turns += 1
            named = _CELLS.search(reply)
            right = bool(named) and (int(named[1]), int(named[2])) == player and (int(named[3]), int(named[4])) == goal
            cells_right += right
            answer = _ANSWER.search(reply)
            wrong = None
            if not named or not answer:
                wrong = "malformed"
            elif not right:
                wrong = "wrong cells"
            pos = player
            for word in (answer[1].split("||") if answer else []):
                word = word.strip()
                if word not in MOVES:
                    wrong = wrong or "invalid"
                    break
                r, c = pos[0] + MOVES[word][0], pos[1] + MOVES[word][1]
                nxt = (min(max(r, 0), len(board) - 1), min(max(c, 0), len(board[0]) - 1))
                moves += 1
                good = nxt in dist and dist[nxt] < dist[pos]
                shortest += good
                if not good:
                    wrong = wrong or ("into a hole" if nxt not in dist else "not nearer")
                    break
                pos = nxt
                if dist[pos] == 0:
                    break
            if wrong and first_wrong is None:
                first_wrong = wrong
        if not rec["success"]:
            failures[first_wrong or "budget"] += 1
    return {
        "episodes": len(records),
        "failures": sum(failures.values()),
        "first_wrong": {k: failures.get(k, 0) for k in CATEGORIES},
        "turns": turns,
        "turns_naming_both_cells": cells_right / max(turns, 1),
        "moves": moves,
        "shortest_path_moves": shortest / max(moves, 1),
    }


SPREAD_CLASSES = ("never", "sometimes", "always")


def _success_by_puzzle(records: list[dict]) -> dict[int, float]:
    """Each puzzle's success rate over its attempts."""
    by_puzzle = collections.defaultdict(list)
    for rec in records:
        by_puzzle[rec["puzzle"]].append(bool(rec["success"]))
    return {p: sum(v) / len(v) for p, v in by_puzzle.items()}


def _spread_class(rate: float) -> str:
    return "never" if rate == 0 else "always" if rate == 1 else "sometimes"


def attempt_spread(records: list[dict]) -> dict:
    """Per-puzzle success over its attempts: never / sometimes / always solved, the mean success and
    the ``sharpening_bound`` (every sometimes-solved puzzle always solved). None with one attempt each
    (or records without a ``puzzle`` index)."""
    if not records or any("puzzle" not in rec for rec in records):
        return None
    attempts = collections.Counter(rec["puzzle"] for rec in records)
    if max(attempts.values()) < 2:
        return None
    rates = list(_success_by_puzzle(records).values())
    never, always = sum(r == 0 for r in rates), sum(r == 1 for r in rates)
    n = len(rates)
    return {"puzzles": n, "attempts": max(attempts.values()), "never": never,
            "sometimes": n - never - always, "always": always, "success": sum(rates) / n,
            "sharpening_bound": (n - never) / n}


def spread_transitions(before: list[dict], after: list[dict]) -> dict:
    """How the puzzles' attempt spread moved between two evaluations of the same puzzles.

    ``moved[a][b]``: puzzles in class ``a`` before and ``b`` after (classes never / sometimes /
    always over each evaluation's attempts); ``success[a]``: the mean success of the puzzles in class
    ``a`` before, ``{"before": .., "after": .., "puzzles": n}``. Raises ValueError when the two files do
    not hold the same puzzles (different validation sets cannot be paired).
    """
    for name, records in (("before", before), ("after", after)):
        if not records or any("puzzle" not in rec for rec in records):
            raise ValueError(f"the {name} evaluation has no per-puzzle records (a 'puzzle' index in each line)")
    rate_a, rate_b = _success_by_puzzle(before), _success_by_puzzle(after)
    if set(rate_a) != set(rate_b):
        raise ValueError(f"the two evaluations hold different puzzles ({len(rate_a)} before, {len(rate_b)} "
                         f"after, {len(set(rate_a) & set(rate_b))} shared): evaluate both on the same validation set")
    moved = {a: {b: 0 for b in SPREAD_CLASSES} for a in SPREAD_CLASSES}
    for p, r in rate_a.items():
        moved[_spread_class(r)][_spread_class(rate_b[p])] += 1
    success = {}
    for a in SPREAD_CLASSES:
        members = [p for p, r in rate_a.items() if _spread_class(r) == a]
        if members:
            success[a] = {"puzzles": len(members), "before": sum(rate_a[p] for p in members) / len(members),
                          "after": sum(rate_b[p] for p in members) / len(members)}
    return {"moved": moved, "success": success}


def _read_evaluation(path: str, step: int | None) -> tuple[int, list[dict]]:
    """The records of one evaluation in an eval JSONL (``step``, default the last) and its step."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        raise SystemExit(f"{path}: no records")
    step = max(r["step"] for r in records) if step is None else step
    chosen = [r for r in records if r["step"] == step]
    if not chosen:
        raise SystemExit(f"{path}: no evaluation at step {step}; steps: {sorted({r['step'] for r in records})}")
    return step, chosen


def _frozen_lake_lengths():
    def length(board: list[str]) -> int | None:
        player, _, dist = distances(board)
        return dist.get(player)
    return _BOARD_CHARS, length


def _sokoban_lengths():
    return set(DEFAULT_GRID_LOOKUP.values()), shortest_solution_length


# env -> () -> (the grid's symbols, the fewest actions that solve a board or None)
SOLUTION_LENGTH = {"frozen_lake": _frozen_lake_lengths, "sokoban": _sokoban_lengths}


def success_by_solution_length(records: list[dict], env: str, before: list[dict] | None = None) -> dict:
    """The puzzles grouped by the fewest actions that solve their first board.

    ``{length: {"puzzles": n, "success": mean over the group's puzzles of each one's success rate
    [, "before": the same in ``before``]}}``, lengths ascending, ``"unsolvable"`` last. Raises
    ValueError for an unknown env, records without ``puzzle`` indices, or a ``before`` with other puzzles.
    """
    if env not in SOLUTION_LENGTH:
        raise ValueError(f"--by_length {env!r}: the solution length is known for {sorted(SOLUTION_LENGTH)}")
    chars, length_of = SOLUTION_LENGTH[env]()
    if not records or any("puzzle" not in rec for rec in records):
        raise ValueError("the evaluation has no per-puzzle records (a 'puzzle' index in each line)")
    boards = {}
    for rec in records:
        if rec["puzzle"] not in boards:
            boards[rec["puzzle"]] = turns_of(rec["transcript"], chars)[0][0]
    rate = _success_by_puzzle(records)
    rate_before = None
    if before is not None:
        rate_before = _success_by_puzzle(before)
        if set(rate_before) != set(rate):
            raise ValueError(f"--before holds other puzzles ({len(rate_before)} against {len(rate)}): evaluate "
                             "both on the same validation set")
    groups = collections.defaultdict(list)
    for p, board in boards.items():
        length = length_of(board)
        groups["unsolvable" if length is None else length].append(p)
    out = {}
    lengths = sorted(k for k in groups if k != "unsolvable")
    if "unsolvable" in groups:
        lengths.append("unsolvable")  # after the solvable lengths
    for length in lengths:
        members = groups[length]
        row = {"puzzles": len(members), "success": sum(rate[p] for p in members) / len(members)}
        if rate_before is not None:
            row["before"] = sum(rate_before[p] for p in members) / len(members)
        out[length] = row
    return out


def _read_evaluations(paths: list[str], step: int | None) -> tuple[int, list[dict]]:
    """One evaluation (``step``, default each file's last) from every file, pooled; the steps must agree."""
    read = [_read_evaluation(path, step) for path in paths]
    steps = {s for s, _ in read}
    if len(steps) > 1:
        raise SystemExit(f"{' '.join(paths)}: the files' last evaluations are at different steps {sorted(steps)}; "
                         "pick one with --step / --before_step")
    return read[0][0], [rec for _, records in read for rec in records]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("jsonl", nargs="+", help="eval transcripts (runs/<job>/eval/transcripts.jsonl); several "
                        "files (one per seed) pool their records")
    parser.add_argument("--step", type=int, default=None, help="only the evaluation at this step (default: the last)")
    parser.add_argument("--before", nargs="+", default=None,
                        help="an earlier evaluation of the same puzzles: adds spread_transitions")
    parser.add_argument("--before_step", type=int, default=None,
                        help="the step of the --before evaluation (default: its last)")
    parser.add_argument("--by_length", default=None, choices=sorted(SOLUTION_LENGTH),
                        help="adds by_solution_length: success per fewest-actions solution length")
    args = parser.parse_args(argv)
    step, chosen = _read_evaluations(args.jsonl, args.step)
    spread = attempt_spread(chosen)
    try:
        result = analyse(chosen)
    except ValueError as e:  # not FrozenLake's boards: the attempt spread / lengths alone
        if spread is None and args.before is None and args.by_length is None:
            raise SystemExit(f"{' '.join(args.jsonl)}: {e}") from None
        result = {"episodes": len(chosen), "failure_analysis": f"not run: {e}"}
    if spread is not None:
        result["attempt_spread"] = spread
    before = None if args.before is None else _read_evaluations(args.before, args.before_step)[1]
    if before is not None:
        try:
            result["spread_transitions"] = spread_transitions(before, chosen)
        except ValueError as e:
            raise SystemExit(f"--before {' '.join(args.before)}: {e}") from None
    if args.by_length is not None:
        try:
            result["by_solution_length"] = success_by_solution_length(chosen, args.by_length, before)
        except ValueError as e:
            raise SystemExit(f"--by_length {args.by_length}: {e}") from None
    result = {"step": step, **result}
    print(json.dumps(result, indent=2))
    return result


def cli() -> None:
    """The console entry point (``ragen-eval-analysis``): ``main`` on the command line's arguments."""
    main()


if __name__ == "__main__":
    main()
