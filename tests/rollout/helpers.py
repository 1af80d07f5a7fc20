"""Small tokenizers for rollout tests, trained locally (no hub access).

Byte-level BPE trained on prompt text and board renders, wrapped in ``PreTrainedTokenizerFast``
with either a Qwen-style (``<|im_start|>``/``<|im_end|>``) or a Llama-3-style header chat template.
"""
from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from environments.bandit import Bandit
from environments.frozen_lake import env as frozen_lake_env
from environments.sokoban import env as sokoban_env
from ragen_jax.rollout import prompts

QWEN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def _corpus() -> list[str]:
    boards = [
        "######\n#O####\n#__###\n#X_###\n#_P_##\n######",
        "____\n__OP\nG___\n____",
        "Board size: 6 rows x 6 cols (zero-indexed).\nTargets: (1, 1)\nBoxes: (3, 1)\nPlayer: (4, 2)",
        "Start: (1, 3)\nGoal: (2, 0)\nPlayer: (1, 3)\nHoles: (1, 2)",
        "#: wall, _: empty, O: target, √: box on target, X: box, P: player, S: player on target",
        "P: player, _: empty, O: hole, G: goal, X: player in hole, √: player on goal",
    ]
    texts = [
        sokoban_env.INSTRUCTION,
        sokoban_env.COORD_INSTRUCTION,
        frozen_lake_env.INSTRUCTION,
        Bandit.instruction,
        prompts.INVALID_ACTION_WARNING,
        prompts.turn_block(1, boards[0], 10, warning=True, enable_think=True, max_words=100),
        "<think> I should move Up then Left </think> <answer> Up || Left </answer>",
        "<think>push the box</think><answer>Right || Down</answer>",
        "Reward:\n-0.1\nReward:\n10.8\n",
    ]
    return (boards + texts) * 4


@functools.lru_cache(maxsize=None)
def make_tokenizer(style: str = "qwen", vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with a chat template; ``style`` in {"qwen", "llama3", "none"}."""
    specials = LLAMA3_SPECIALS if style == "llama3" else QWEN_SPECIALS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if style == "llama3":
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|end_of_text|>"
        )
        fast.chat_template = LLAMA3_TEMPLATE
    else:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
            additional_special_tokens=["<|im_start|>"],
        )
        if style == "qwen":
            fast.chat_template = QWEN_TEMPLATE
    return fast
