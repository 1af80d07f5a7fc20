"""TextWorld: text adventures generated locally by the ``textworld`` package, played as a host env.

Games are generated and compiled by TextWorld itself (``textworld.generator``) from
``(nb_rooms, nb_objects, quest_length)`` and a seed, once, into ``games_dir`` (default
``~/.cache/ragen_jax/textworld``; ~3 s a game), a pool of ``num_games``; ``reset(seed)`` starts
game ``seed % num_games``. The observation is the game's own text — the objective and the room at
the start, then each command's feedback — followed by the admissible commands, as ALFWorld prompts
do; the answer is one command (free text: an inadmissible one is simply what the game answers,
e.g. "You can't see any such thing."). Reward: the gain in game score; ``success``: the quest won.
"""
from __future__ import annotations

import os
import re
import warnings
from pathlib import Path


def _clean(text: str) -> str:
    """Drop the game's ASCII banner and prompt markers, collapse blank runs."""
    text = re.sub(r"\n\s*>\s*$", "", text or "")
    lines = [ln.rstrip() for ln in text.splitlines() if not re.fullmatch(r"[\s$|\\/_>-]*", ln) or not ln.strip()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


class TextWorld:
    """A pool of generated TextWorld games (see the module docstring)."""

    action_names = None
    instruction = (
        "You are playing a text adventure. Read the room and your objective, then act with one command from the "
        "admissible commands, for example <answer>open trunk</answer>.\n"
    )

    def __init__(self, num_games: int = 4, nb_rooms: int = 2, nb_objects: int = 4, quest_length: int = 2,
                 games_dir: str | None = None, seed: int = 0):
        try:
            import textworld  # noqa: F401
        except ImportError as e:  # pragma: no cover - the envs extra installs it
            raise ImportError("the textworld env needs the `textworld` package: pip install 'ragen_jax[envs]'") from e
        root = Path(os.path.expanduser(games_dir or "~/.cache/ragen_jax/textworld"))
        self.dir = root / f"r{nb_rooms}_o{nb_objects}_q{quest_length}_s{seed}"
        self.games = [self._game(i, nb_rooms, nb_objects, quest_length, seed) for i in range(int(num_games))]
        self.env = None
        self.score = 0

    def _game(self, i, nb_rooms, nb_objects, quest_length, seed) -> str:
        path = self.dir / f"game_{i}.z8"
        if path.is_file():
            return str(path)
        import textworld
        from textworld.generator import compile_game, make_game

        opts = textworld.GameOptions()
        opts.seeds = seed * 10_007 + i
        opts.nb_rooms, opts.nb_objects, opts.quest_length = nb_rooms, nb_objects, quest_length
        opts.path = str(path)
        opts.file_ext = ".z8"
        opts.force_recompile = True
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = compile_game(make_game(opts), opts)
        return str(tmp)

    def _text(self, feedback: str, state) -> str:
        cmds = state.admissible_commands or []
        return f"{_clean(feedback)}\nAdmissible commands: {', '.join(cmds)}"

    def reset(self, seed: int) -> str:
        import textworld

        if self.env is not None:
            self.env.close()
        infos = textworld.EnvInfos(admissible_commands=True, max_score=True, won=True, lost=True, objective=True,
                                   description=True)
        with warnings.catch_warnings():
            # jericho does not know TextWorld's generated games; TextWorld tracks score itself.
            warnings.filterwarnings("ignore", message=".*is not fully supported.*")
            self.env = textworld.start(self.games[int(seed) % len(self.games)], request_infos=infos)
            state = self.env.reset()
        self.score, self.commands = 0, list(state.admissible_commands or [])
        return self._text(f"{state.objective}\n\n{state.description}", state)

    def step(self, action: str):
        command = action.strip()
        valid = command in self.commands  # admissible in the state the command was given in
        state, score, done = self.env.step(command)
        reward, self.score = float(score - self.score), score
        self.commands = list(state.admissible_commands or [])
        return self._text(state.feedback, state), reward, bool(done), {
            "success": bool(state.won), "action_is_valid": valid, "action_is_effective": valid}
