"""Build the ``tiny`` preset's tokenizer shipped in ``ragen_jax/assets/tiny_tokenizer/``.

A byte-level BPE (every byte is a token, so any text round-trips through encode/decode) trained
with the ``tokenizers`` library on a synthetic corpus of what the agent reads and writes: Sokoban
and FrozenLake renders in every observation format (all symbols, including "√"), the task
instructions, turn blocks, reward lines, action names, Bandit arm names, numbers and coordinates,
and short reasoning sentences. The chat framing is Qwen's (``<|im_start|>role\\n…<|im_end|>\\n``,
pad ``<|endoftext|>``, eos ``<|im_end|>``) so the same rollout code serves the tiny model and real
Qwen2.5 checkpoints. ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` are single (non-special)
tokens: a tiny model learns the reply format in a handful of steps instead of spelling tags out.

Deterministic: the corpus comes from a seeded NumPy generator and BPE training is single-threaded,
so re-running the script reproduces the shipped files byte for byte (a test checks this).

    python -m ragen_jax.offline.build_tiny_tokenizer [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_tokenizer"

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")

# Qwen2's pre-tokenisation: contractions, letter runs, single digits, punctuation runs, newlines.
# Single digits matter here: coordinates like "(3, 12)" tokenise digit by digit, as in Qwen.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Grid cells: a symbol next to another symbol is its own pre-token, so a board row tokenises one
# token per cell (the model sees the 2-D structure) while prose words such as "Player" or "Goal"
# (a symbol letter followed by lower case) keep their merges.
GRID_SYMBOLS = "#_OGXPS√"
GRID_CELL_PATTERN = f"[{GRID_SYMBOLS}](?=[{GRID_SYMBOLS}])|(?<=[{GRID_SYMBOLS}])[{GRID_SYMBOLS}]"

# Qwen-style chat template (no default system message: RAGEN always sends one).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SOKOBAN_SYMBOLS = {"#": "wall", "_": "empty", "O": "target", "√": "box on target", "X": "box",
                   "P": "player", "S": "player on target"}
FROZEN_LAKE_SYMBOLS = {"P": "player", "_": "empty", "O": "hole", "G": "goal", "X": "player in hole",
                       "√": "player on goal"}
SOKOBAN_ACTIONS = ("Up", "Down", "Left", "Right")
FROZEN_LAKE_ACTIONS = ("Left", "Down", "Right", "Up")
BANDIT_ARMS = ("Teacher", "Trader", "Nurse", "StartupFounder", "Librarian", "Investor", "Accountant",
               "StockBroker", "Engineer", "RealEstateAgent", "Pharmacist", "Musician", "Clerk",
               "Freelancer", "Technician", "Youtuber", "Planner", "Artist", "Postman", "Pilot", "Banker",
               "VentureCapitalist", "Gardener", "Cryptominer", "Receptionist", "Explorer", "Archivist",
               "Filmmaker", "Bookkeeper", "Consultant", "SocialWorker", "Photographer", "Mechanic",
               "GameDesigner", "Secretary", "Entrepreneur", "Cashier", "DataScientist", "CivilServant",
               "StartupAccelerator")

INSTRUCTIONS = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. "
    "When you are exactly next to a box, you can push it by moving in the same direction. "
    "You cannot push a box through a wall, and you cannot pull a box. "
    "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>",
    "You are provided with a symbol grid and the zero-indexed coordinates of the player, each box, "
    "and each target. \nCoordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5). ",
    "You are solving the FrozenLake puzzle. Forbid the hole and go to the target. "
    "You may move to the unintended direction due to the slippery ice. "
    "Example answer format: <think>To forbid the hole and go to the target, I should go left then go up."
    "</think><answer>Left || Up</answer>",
    "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. "
    "Game Rules: 1. There are 2 arms, named {a} and {b}. 2. Each arm has its own reward distribution, "
    "related to their names. 3. Analyze the symbolic meaning of each arm's name to guess how their reward "
    "distribution might behave. 4. Based on the symbolic meaning of their names, which arm do you think "
    "is more likely to give higher rewards on average? Choose between {a} and {b}, and output like "
    "<answer> {a} </answer> or <answer> {b} </answer>.",
)

REASONING = (
    "The player is at ({pr}, {pc}) and the goal at ({gr}, {gc}); moving {a} avoids the hole at ({hr}, {hc}).",
    "The player is at ({pr}, {pc}) and the goal is at ({gr}, {gc}). I should move {a} then {b}.",
    "The box is at ({br}, {bc}) and the target at ({gr}, {gc}); I push it {a} from ({pr}, {pc}).",
    "I stand at ({pr}, {pc}). The goal is {n} rows down and {m} columns right, so I go {a} || {b}.",
    "The goal is to the {d} of me. Moving {a} brings me closer without falling into a hole.",
    "The box needs to go {a}. I walk around it to ({pr}, {pc}) first, then push {b}.",
    "Only {n} actions are left, so I take the shortest path: {a} || {b}.",
)


def _grid(rng: np.random.Generator, rows: int, cols: int, symbols: str) -> str:
    cells = rng.choice(list(symbols), size=(rows, cols))
    return "\n".join("".join(r) for r in cells)


def _coords(rng: np.random.Generator, rows: int, cols: int, k: int) -> str:
    return ", ".join(f"({rng.integers(rows)}, {rng.integers(cols)})" for _ in range(k))


def _sokoban_coord(rng, rows, cols) -> str:
    lines = [f"Board size: {rows} rows x {cols} cols (zero-indexed)."]
    for label in ("Targets", "Boxes", "Boxes on target", "Player", "Player on target"):
        if rng.random() < 0.7:
            lines.append(f"{label}: {_coords(rng, rows, cols, int(rng.integers(1, 3)))}")
    return "\n".join(lines)


def _frozen_lake_coord(rng, rows, cols) -> str:
    lines = [f"Board size: {rows} rows x {cols} cols (zero-indexed)."]
    for label in ("Start", "Goal", "Player", "Player on goal", "Player in hole", "Holes"):
        if rng.random() < 0.7:
            lines.append(f"{label}: {_coords(rng, rows, cols, int(rng.integers(1, 4)))}")
    return "\n".join(lines)


def _state(rng, env: str) -> str:
    rows, cols = int(rng.integers(3, 10)), int(rng.integers(3, 10))
    if env == "sokoban":
        grid = _grid(rng, rows, cols, "#_O√XPS")
        coord = _sokoban_coord(rng, rows, cols)
    else:
        grid = _grid(rng, rows, cols, "P_OGX√")
        coord = _frozen_lake_coord(rng, rows, cols)
    fmt = rng.integers(3)
    if fmt == 0:
        return grid
    if fmt == 1:
        return coord
    return "Coordinates: \n" + coord + "\nGrid Map: \n" + grid


def _reasoning(rng, actions) -> str:
    tpl = REASONING[int(rng.integers(len(REASONING)))]
    v = {k: int(rng.integers(10)) for k in ("pr", "pc", "gr", "gc", "hr", "hc", "br", "bc", "n", "m")}
    return tpl.format(a=rng.choice(actions), b=rng.choice(actions),
                      d=rng.choice(["left", "right", "top", "bottom"]), **v)


def _legend(symbols: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in symbols.items())


def _episode(rng) -> str:
    """One multi-turn conversation in the chat framing (the most frequent text the model sees)."""
    env = ("sokoban", "frozen_lake", "bandit")[int(rng.integers(3))]
    if env == "bandit":
        a, b = rng.choice(BANDIT_ARMS, size=2, replace=False)
        user = INSTRUCTIONS[3].format(a=a, b=b)
        answer = f"<think>{a} sounds steady while {b} is risky.</think><answer>{rng.choice([a, b])}</answer>"
        return (f"<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                f"<|im_start|>assistant\n{answer}<|im_end|>\n")
    actions = SOKOBAN_ACTIONS if env == "sokoban" else FROZEN_LAKE_ACTIONS
    symbols = SOKOBAN_SYMBOLS if env == "sokoban" else FROZEN_LAKE_SYMBOLS
    instr = INSTRUCTIONS[0] + ("\n" + INSTRUCTIONS[1] if rng.random() < 0.3 else "") if env == "sokoban" \
        else INSTRUCTIONS[2]
    system = (f"You're a helpful assistant. {instr}\nThe meaning of each symbol in the state is:\n{_legend(symbols)}"
              f"\nYour available actions are:\n{', '.join(actions)}"
              f"\nYou can make up to 10 actions, separated by the action separator \" || \"\n")
    text = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
    left = 10
    for turn in range(1, int(rng.integers(1, 6)) + 1):
        if turn > 1:
            reward = rng.choice(["-0.1", "-0.2", "0", "0.0", "1.0", "10.9", "10.8", "-1.0"])
            text += f"<|im_start|>user\nReward:\n{reward}\n"
        warning = ("No valid action provided previously. Environment state remains the same. Please try again.\n"
                   if rng.random() < 0.1 else "")
        text += (f"\nTurn {turn}:\nState:\n{_state(rng, env)}\n{warning}You have {left} actions left. "
                 "Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> with no extra "
                 f"text. Strictly follow this format. Max response length: {int(rng.choice([100, 120, 64]))} "
                 "words (tokens).\n<|im_end|>\n")
        acts = " || ".join(rng.choice(actions, size=int(rng.integers(1, 3))))
        text += f"<|im_start|>assistant\n<think>{_reasoning(rng, actions)}</think><answer>{acts}</answer><|im_end|>\n"
        left = max(0, left - 2)
    return text


def build_corpus(num_episodes: int = 3000, seed: int = 0) -> list[str]:
    """The training corpus: chat episodes plus bare numbers (every digit and common integers)."""
    rng = np.random.default_rng(seed)
    corpus = [_episode(rng) for _ in range(num_episodes)]
    corpus += [" ".join(str(i) for i in range(200)), "-0.1 -0.2 0.25 0.5 1.0 10.9 -1.5 3.14"]
    return corpus


def build_tokenizer(num_episodes: int = 3000, seed: int = 0):
    """Train the byte-level BPE and return a ``transformers`` fast tokenizer with the chat template."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # single-threaded training: deterministic merges

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GRID_CELL_PATTERN), behavior="isolated"),
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(num_episodes, seed), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )


def save(out_dir: str | Path = DEFAULT_DIR) -> Path:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = build_tokenizer()
    hf.save_pretrained(str(out_dir))
    # One self-contained config file: fold a separately written template back into it.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    for extra in ("chat_template.jinja", "special_tokens_map.json"):
        if (out_dir / extra).exists():
            (out_dir / extra).unlink()
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_DIR), help="output directory")
    args = parser.parse_args()
    path = save(args.out)
    print(f"wrote {path}")


def cli() -> None:
    """The console entry point (``ragen-build-tiny-tokenizer``): ``main`` on the command line's arguments."""
    main()


if __name__ == "__main__":
    main()
