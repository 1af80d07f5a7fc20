"""The text the agent reads: system message, per-turn user blocks, reward messages, warning.

RAGEN's prompt, with its bugs fixed:
  * the instruction, the symbol legend and the action list come from the environment actually
    configured (``env.instruction_text``, ``env.legend()``, ``env.action_names``), not from
    dataclass defaults (so the coordinate range in Sokoban's / FrozenLake's coordinate hint is
    the real board size);
  * the sentence about actions states ``max_actions_per_turn`` — the number the loop executes
    per turn — instead of the episode budget.

Conversation layout (one user message per turn, the reward of the previous turn opening it)::

    system:    "You're a helpful assistant. " + instruction [+ legend] [+ coord hint] + actions
    user:      "\\nTurn 1:\\nState:\\n{obs}\\nYou have 10 actions left. Always output: ... \\n"
    assistant: "<think>" (forced) + sampled reply
    user:      "Reward:\\n{r}\\n" + "\\nTurn 2:\\nState:\\n{obs}\\n" [+ warning] + "You have 8 ..."
    ...

Every function here is host-side and returns ``str``; the device builds the same text from token
tables (``codec.py``) and tests check the two agree character for character.
"""
from __future__ import annotations

SYSTEM_PREFIX = "You're a helpful assistant. "

INVALID_ACTION_WARNING = (
    "No valid action provided previously. Environment state remains the same. Please try again.\n"
)

THINK_FORMAT = "<think> [Your thoughts] </think> <answer> [your answer] </answer>"
ANSWER_FORMAT = "<answer> [your answer] </answer>"

ACTION_SEPARATOR = "||"

def system_message(
    instruction: str,
    *,
    legend: str | None,
    action_names: tuple[str, ...] | None,
    max_actions_per_turn: int,
) -> str:
    """``"You're a helpful assistant. " + instruction + legend + action list``.

    ``legend`` is ``env.legend()`` for observation formats that show the symbol grid (``None`` for
    pure-coordinate or free-text observations); ``action_names`` is ``env.action_names`` (``None``
    for language environments whose actions are free text).
    """
    text = SYSTEM_PREFIX + instruction
    if legend:
        text += "\nThe meaning of each symbol in the state is:\n" + legend
    if action_names:
        text += "\nYour available actions are:\n" + ", ".join(action_names)
        text += (
            f"\nYou can make up to {max_actions_per_turn} actions, separated by the action separator"
            f' " {ACTION_SEPARATOR} "\n'
        )
    return text


def format_instruction(enable_think: bool) -> str:
    return THINK_FORMAT if enable_think else ANSWER_FORMAT


def forced_prefix(enable_think: bool) -> str:
    """Text forced after the assistant header: the model continues from inside ``<think>``."""
    return "<think>" if enable_think else "<answer>"


def turn_block(
    turn: int,
    state_text: str,
    actions_left: int,
    *,
    warning: bool,
    enable_think: bool,
    max_words: int,
) -> str:
    """One turn's user text (``turn`` is 1-based, as printed)."""
    return (
        f"\nTurn {turn}:\nState:\n{state_text}\n"
        + (INVALID_ACTION_WARNING if warning else "")
        + f"You have {actions_left} actions left. Always output: {format_instruction(enable_think)}"
        " with no extra text. Strictly follow this format. "
        f"Max response length: {max_words} words (tokens).\n"
    )


def reward_text(reward: float | None, decimals: int = 1, limit: float | None = None) -> str:
    """The reward as printed in ``"Reward:\\n{r}\\n"``.

    ``None`` means the environment was not stepped (no valid action): the original printed its
    integer accumulator, ``"0"``. Otherwise the value is rounded to ``decimals`` places and printed
    with Python's float repr (``-0.2``, ``10.8``, ``0.0``). Rounding removes float noise such as
    ``10.799999999999999`` that the original's running sum could show; the device renders from a
    table of exactly these strings (see ``codec.NumberTables``).
    """
    if reward is None:
        return "0"
    value = round(float(reward), decimals)
    if limit is not None:  # the device table's range (codec.PromptCodec)
        value = min(max(value, -limit), limit)
    return repr(value + 0.0)


def reward_message(reward: float | None, decimals: int = 1, limit: float | None = None) -> str:
    return f"Reward:\n{reward_text(reward, decimals, limit)}\n"


def build_system_text(env, fmt: str, config, board_shape, env_params=None) -> str:
    """The system message for ``env`` as configured: ``config.instruction`` or the env's own
    (``env.instruction_text``), its legend for grid formats, its action list where it has one."""
    instruction = config.instruction
    if instruction is None:
        instruction = env.instruction_text(fmt, board_shape, env_params)
    legend = env.legend() if fmt in ("grid", "grid_coord") else None
    actions = tuple(env.action_names) if env.lists_actions(fmt) else None
    return system_message(
        instruction, legend=legend, action_names=actions,
        max_actions_per_turn=config.max_actions_per_turn,
    )
