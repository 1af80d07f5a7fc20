"""Tools in OpenAI's chat format (``tools.openai_format``): requests' tools checked, conversations with
calls and tool results written in ToolEnv's convention, replies' <tool_call> blocks read back as
``tool_calls`` — each against a hand-written expectation. No randomness."""
from __future__ import annotations

import json

import pytest

from ragen_jax.tools.openai_format import as_plain_chat, check_tools, reply_message, tools_listing

SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the corpus.",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                          "required": ["query"]}}}


@pytest.mark.parametrize("tools, fragment", [
    ([], "non-empty list"),
    ({"type": "function"}, "non-empty list"),
    ([{"type": "retrieval"}], "tools[0] must be"),
    ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
    ([SEARCH, SEARCH], "listed twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "type 'object'"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "description must be a string"),
])
def test_bad_tools_are_named(tools, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        check_tools(tools)


def test_a_conversation_with_calls_and_results_in_toolenv_convention():
    messages = [{"role": "system", "content": "Answer questions."},
                {"role": "user", "content": "Where was Ann born?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "Ann"}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": '{"query": "born"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Ann was born in Kessock."},
                {"role": "tool", "tool_call_id": "call_2", "content": "nothing"}]
    assert as_plain_chat(messages, [SEARCH]) == [
        {"role": "system", "content": "Answer questions.\n\n" + tools_listing([SEARCH])},
        {"role": "user", "content": "Where was Ann born?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "search", "arguments": {"query": "Ann"}}\n</tool_call>\n'
                                         '<tool_call>\n{"name": "search", "arguments": {"query": "born"}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\nAnn was born in Kessock.\n</tool_response>\n"
                                    "<tool_response>\nnothing\n</tool_response>"}]
    # Without a system message the listing is one; without tools nothing is added.
    assert as_plain_chat(messages[1:2], [SEARCH])[0] == {"role": "system", "content": tools_listing([SEARCH])}
    assert as_plain_chat(messages[:2], None) == messages[:2]
    assert json.dumps(SEARCH) in tools_listing([SEARCH]) and "<tool_call>" in tools_listing([SEARCH])


def test_a_reply_calls_tools_only_when_every_block_parses_and_names_a_listed_tool():
    text = 'Let me look.\n<tool_call>{"name": "search", "arguments": {"query": "Ann"}}</tool_call>'
    message, called = reply_message(text, [SEARCH])
    assert called and message["content"] == "Let me look."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "search", "arguments": '{"query": "Ann"}'}
    # Malformed JSON, an unlisted tool, no tools in the request: the text comes back as it is.
    for reply, tools in (('<tool_call>{"name": "search", "arguments": {</tool_call>', [SEARCH]),
                         ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', [SEARCH]),
                         (text, None)):
        assert reply_message(reply, tools) == ({"role": "assistant", "content": reply}, False)


def test_a_hosted_models_calls_enter_the_transcript_inside_its_answer():
    from ragen_jax.tools.openai_format import calls_in_answer

    call = {"id": "c", "type": "function", "function": {"name": "search", "arguments": '{"query": "Ann"}'}}
    block = '<tool_call>\n{"name": "search", "arguments": {"query": "Ann"}}\n</tool_call>'
    assert calls_in_answer("<think>look</think>", [call]) == f"<think>look</think><answer>{block}</answer>"
    assert calls_in_answer("<think>a</think><answer>", [call]) == f"<think>a</think><answer>{block}</answer>"
    assert calls_in_answer("<think>a</think><answer>x</answer>", [call]) == f"<think>a</think><answer>x{block}</answer>"
    assert calls_in_answer("<think>a</think>", []) == "<think>a</think>"


@pytest.mark.parametrize("module", ["ragen_jax.tools.openai_format", "ragen_jax.tools.calls", "ragen_jax.tools.env"])
def test_the_tool_modules_import_first_in_a_fresh_interpreter(module):
    """No import cycle through the rollout (the server and the remote evaluation import these)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
