"""The shipped ``tiny`` tokenizer: offline loading, byte-level round trip, chat template, determinism."""
import filecmp

import pytest
from hypothesis import given, settings, strategies as st
from transformers import AutoTokenizer

from ragen_jax.offline import build_tiny_tokenizer as btt

PATH = str(btt.DEFAULT_DIR)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(PATH)


def test_special_and_tag_tokens(tok):
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<answer>", "</answer>"):
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == t
    # Tags are ordinary tokens: decoding with skip_special_tokens keeps them (the parser needs them).
    assert tok.decode(tok.encode("<think>a</think><answer>Up</answer><|im_end|>"), skip_special_tokens=True) \
        == "<think>a</think><answer>Up</answer>"
    assert 1000 <= len(tok) <= 2100


def test_grid_symbols_are_one_token_per_cell(tok):
    # RAGEN's CoordSokoban board (seed 10000) with the box pushed onto the target.
    grid = "######\n#√####\n#__###\n#__###\n#_P_##\n######"
    pieces = [tok.decode([i]) for i in tok.encode(grid)]
    assert pieces == [c for c in grid]


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=0, max_size=80))
def test_round_trip_any_text(tok, text):
    # Byte-level BPE: every string (any unicode, control characters) decodes back exactly.
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_template_matches_qwen_framing(tok):
    msgs = [{"role": "system", "content": "You're a helpful assistant. S"},
            {"role": "user", "content": "\nTurn 1:\nState:\n#P_#\n"},
            {"role": "assistant", "content": "<think>go</think><answer>Right</answer>"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    expected = ("<|im_start|>system\nYou're a helpful assistant. S<|im_end|>\n"
                "<|im_start|>user\n\nTurn 1:\nState:\n#P_#\n<|im_end|>\n"
                "<|im_start|>assistant\n<think>go</think><answer>Right</answer><|im_end|>\n")
    assert text == expected
    gen = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert gen.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_rebuild_is_deterministic(tmp_path):
    # Regenerating from the seeded corpus reproduces the shipped files byte for byte.
    btt.save(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(tmp_path / name, btt.DEFAULT_DIR / name, shallow=False), name
