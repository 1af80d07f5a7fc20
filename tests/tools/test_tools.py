"""Tools: schemas against hand-written ones, the call parsers on well-formed, several, nested,
truncated and hostile calls, running calls (parallel, timeouts, exceptions, bad arguments), and the
built-ins against hostile input. No randomness (nothing to seed)."""
from __future__ import annotations

import asyncio
import copy
import json
import time
from typing import Literal, Optional

import pytest

from ragen_jax.tools import ToolCall, function_schema, parse_calls, run_calls, tool
from ragen_jax.tools.builtin import CalculatorError, calculate, calculator, python_tool, search_tool


def weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius", days: Optional[int] = None,
            tags: list[str] = ()) -> str:
    """Get the weather forecast
    for a city.

    Args:
      city: the city's name,
        e.g. "Paris".
      unit (str): the temperature unit.
      days: how many days ahead.

    Returns:
      the forecast.
    """
    return f"{city}: sunny"


def test_schema_from_signature_and_docstring_equals_the_hand_written_one():
    expected = {"type": "function", "function": {
        "name": "weather",
        "description": "Get the weather forecast for a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": 'the city\'s name, e.g. "Paris".'},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "the temperature unit."},
            "days": {"type": "integer", "description": "how many days ahead."},
            "tags": {"type": "array", "items": {"type": "string"}},
        }},
    }}
    assert function_schema(weather) == expected
    t = tool(weather, name="forecast", description="Forecast.", timeout_s=3)
    assert t.name == "forecast" and t.schema["function"]["description"] == "Forecast." and t.timeout_s == 3.0
    assert t(city="Oslo") == "Oslo: sunny"
    given = {"type": "function", "function": {"name": "w", "description": "", "parameters": {"type": "object"}}}
    assert tool(weather, schema=given).schema is given


def test_schema_errors_name_the_fix():
    def untyped(x):
        return x

    def star(*args: int):
        return args

    with pytest.raises(TypeError, match="'x' has no type annotation"):
        function_schema(untyped)
    with pytest.raises(TypeError, match=r"\*args"):
        function_schema(star)


def test_hermes_calls_well_formed_several_and_nested():
    text = ('<think>two lookups</think>\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"query": "x", "filters": {"year": [2020, 2021], '
            '"deep": {"a": {"b": null}}}}}</tool_call>'
            '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>')
    calls = parse_calls(text)
    assert [(c.name, c.error) for c in calls] == [("weather", ""), ("search", ""), ("calc", "")]
    assert calls[0].arguments == {"city": "Paris"}
    assert calls[1].arguments["filters"] == {"year": [2020, 2021], "deep": {"a": {"b": None}}}
    assert calls[2].arguments == {"expression": "1+1"}  # arguments given as a JSON string
    assert [c.id for c in calls] == ["call_0", "call_1", "call_2"]
    assert parse_calls("no calls here") == []


@pytest.mark.parametrize("body, match", [
    ('{"name": "weather", "arguments": {"city": "Paris"}', "not closed"),  # truncated reply
    ('<tool_call>{"name": "weather", "arguments": {"city": }}</tool_call>', "not valid JSON"),
    ('<tool_call>["weather"]</tool_call>', '"name" string'),
    ('<tool_call>{"name": 3}</tool_call>', '"name" string'),
    ('<tool_call>{"name": "w", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ('<tool_call>' + "[" * 5000 + "]" * 5000 + '</tool_call>', "not valid JSON|\"name\" string"),  # deep nesting
    ('<tool_call>{"name": "w", "arguments": {"q": "</tool_call>"}}</tool_call>', "not valid JSON"),
])
def test_malformed_and_hostile_calls_are_errors_not_exceptions(body, match):
    text = body if body.startswith("<tool_call>") else "<tool_call>" + body
    calls = parse_calls(text)
    assert calls and calls[0].error
    assert any(__import__("re").search(match, c.error) for c in calls)


def test_search_tag_format():
    calls = parse_calls("<search>capital of France</search> then <search></search> and <search>cut", "search_tag")
    assert calls[0] == ToolCall(name="search", arguments={"query": "capital of France"}, id="call_0")
    assert "empty" in calls[1].error and "not closed" in calls[2].error
    with pytest.raises(ValueError, match="Unknown tool-call format 'xml'"):
        parse_calls("", "xml")


def _sleepy(name, seconds, timeout_s=5.0):
    def fn(x: int) -> str:
        time.sleep(seconds)
        return f"{name}:{x}"
    return tool(fn, name=name, timeout_s=timeout_s)


def test_calls_run_in_parallel_and_errors_come_back_as_output():
    slow_a, slow_b = _sleepy("a", 0.6), _sleepy("b", 0.6)
    hang = _sleepy("hang", 3.0, timeout_s=0.2)

    @tool
    def boom(x: int) -> str:
        """Fails."""
        raise RuntimeError("disk on fire")

    @tool
    async def later(x: int) -> dict:
        """A coroutine tool."""
        await asyncio.sleep(0.01)
        return {"x": x, "ok": True}

    tools = [slow_a, slow_b, hang, boom, later]
    calls = [ToolCall(name="a", arguments={"x": 1}), ToolCall(name="b", arguments={"x": 2}),
             ToolCall(name="hang", arguments={"x": 3}), ToolCall(name="boom", arguments={"x": 4}),
             ToolCall(name="later", arguments={"x": 5}), ToolCall(name="nope", arguments={}),
             ToolCall(name="a", arguments={}), ToolCall(name="a", arguments={"x": "1"}),
             ToolCall(name="a", arguments={"x": 1, "y": 2}), ToolCall(error="the tool call is not valid JSON")]
    t0 = time.monotonic()
    results = run_calls(calls, tools, max_calls=10)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.1  # a and b overlapped (0.6 s each) and the hanging call was given up at 0.2 s
    assert [r.content for r in results[:2]] == ["a:1", "b:2"]
    assert results[2].error == "timeout" and "did not answer within 0.2 s" in results[2].content
    assert results[3].error == "RuntimeError" and "disk on fire" in results[3].content
    assert json.loads(results[4].content) == {"x": 5, "ok": True}
    assert results[5].error == "unknown tool" and "'nope'" in results[5].content and "a, b, boom" in results[5].content
    assert "missing required argument(s): x" in results[6].content
    assert "expected integer, got str" in results[7].content
    assert "unknown argument(s): y" in results[8].content
    assert results[9].content.startswith("Error: the tool call is not valid JSON")
    over = run_calls([ToolCall(name="a", arguments={"x": i}) for i in range(3)], [_sleepy("a", 0.0)], max_calls=2)
    assert [r.error for r in over] == ["", "", "too many calls"]


@pytest.mark.parametrize("expression, value", [
    ("(44 - 19) * 2", 50), ("2 ** 10", 1024), ("7 / 2", 3.5), ("7 // 2", 3), ("-3 % 5", 2), ("1.5 * 4", 6),
    ("2 ** -1", 0.5), ("((1 + 2) * (3 + 4)) - 5", 16),
])
def test_calculator_values(expression, value):
    assert calculate(expression) == value
    assert calculator(expression=expression) == str(value)


@pytest.mark.parametrize("expression, match", [
    ("__import__('os').system('echo pwned')", "not Call"),
    ("().__class__.__bases__", "not Attribute"),
    ("x + 1", "not Name"),
    ("'a' * 10", "not Constant"),
    ("9 ** 9 ** 9", "too large"),
    ("10 ** 1000", "too large"),
    ("1 / 0", "division by zero"),
    ("(-8) ** 0.5", "not a real number"),
    ("lambda: 1", "not Lambda"),
    ("(" * 240 + "1" + ")" * 240, "does not parse|nested too deeply"),
    ("1+" * 300 + "1", "longer than"),
    ("[1, 2][0]", "not "),
], ids=lambda v: v if len(v) < 40 else v[:20] + "...")
def test_calculator_refuses_what_is_not_arithmetic(expression, match):
    with pytest.raises(CalculatorError, match=match):
        calculate(expression)


def test_search_tool_on_the_shipped_corpus():
    pytest.importorskip("bm25s")
    search = search_tool(top_k=2)
    assert search.schema["function"]["parameters"]["required"] == ["query"]
    (result,) = run_calls(parse_calls('<tool_call>{"name": "search", "arguments": {"query": "born"}}</tool_call>'),
                          [search])
    assert result.error == "" and "[Document 1]" in result.content


def test_python_tool_runs_in_the_sandbox():
    from environments.code.sandbox import Limits, SandboxUnavailable

    try:
        py = python_tool(Limits(timeout_s=2.0), timeout_s=10.0)
    except SandboxUnavailable:
        pytest.skip("the kernel refuses the sandbox's namespaces here")
    ok, loop, crash = run_calls([ToolCall(name="python", arguments={"code": "print(sum(range(10)))"}),
                                 ToolCall(name="python", arguments={"code": "while True: pass"}),
                                 ToolCall(name="python", arguments={"code": "import os; print(os.listdir('/work/..'))\n"
                                                                             "raise SystemExit(3)"})], [py])
    assert ok.content == "45"
    assert "[timeout]" in loop.content or "[killed]" in loop.content
    assert "[exit code 3]" in crash.content


def test_tool_env_a_scripted_policy_solves_questions_through_the_search_tool():
    """A scripted policy: search the question's person, read the answer off the passage, finish.
    Reward by exact match; the tool output comes back as <tool_response> text."""
    pytest.importorskip("bm25s")
    from ragen_jax.tools.env import ToolSearchQA

    env = ToolSearchQA(max_turns=4, max_tool_calls=2)
    assert '"name": "search"' in env.instruction and "<tool_call>" in env.instruction
    obs = env.reset(0)
    assert obs == "Question: In which town was Anouk Brennan born?"
    call = '<tool_call>{"name": "search", "arguments": {"query": "Anouk Brennan born"}}</tool_call>'
    text, reward, done, info = env.step(call)
    assert text.startswith("<tool_response>") and "Kessock" in text and reward == 0.0 and not done
    assert info["action_is_valid"]
    text, reward, done, info = env.step("finish[Kessock]")
    assert reward == 1.0 and done and info["success"]
    # A wrong answer, a malformed call (format failure, with feedback), the tool budget, the turn limit.
    env.reset(0)
    assert env.step("finish[Paris]")[1:3] == (0.0, True)
    env.reset(0)
    text, _, done, info = env.step('<tool_call>{"name": "search", "arguments": {"query": }}</tool_call>')
    assert "not valid JSON" in text and not info["action_is_valid"] and not done
    env.step(call)
    text, _, done, _ = env.step(call)
    assert "tool budget" in text and not done
    text, _, done, _ = env.step(call)
    assert done and "tool budget" in text  # the fourth turn is the last
    assert env.take_counters() == {"tool_calls": 3, "tool_errors": 0, "malformed_calls": 1}  # since the start


# A chat template that lists tools as Qwen2.5's does: appended to the system message, one JSON schema
# a line inside <tools></tools> (written here for the test; the framing of every message is Qwen's).
TOOLS_TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.first and m['role'] == 'system' and tools %}"
    "{{ '<|im_start|>system\\n' + m['content'] + '\\n\\n# Tools\\n\\n<tools>' }}"
    "{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_the_tools_reach_the_model_through_its_chat_templates_tools_argument():
    """A tokenizer whose template lists tools gets the system message that template writes for
    ``tools=`` (hand-derived below); one whose template ignores them gets the Qwen-worded listing."""
    pytest.importorskip("bm25s")
    from ragen_jax.config import resolve
    from ragen_jax.rollout.chat import system_with_tools
    from ragen_jax.tools.env import REPLY_FORMAT, ToolSearchQA
    from ragen_jax.training.build import build_env
    from tests.rollout.helpers import make_tokenizer

    env = ToolSearchQA()
    schema = env.tools["search"].schema
    listing = copy.deepcopy(make_tokenizer("qwen"))  # make_tokenizer's are shared (cached): not changed here
    listing.chat_template = TOOLS_TEMPLATE
    expected = (f"{env.task_text}\n{REPLY_FORMAT}\n\n# Tools\n\n<tools>\n"
                f"{json.dumps(schema, ensure_ascii=False)}\n</tools>")
    assert env.instruction_for(listing) == expected
    assert system_with_tools(make_tokenizer("qwen"), "Solve it.", [schema]) is None  # ignores tools=
    assert env.instruction_for(make_tokenizer("qwen")) == env.instruction
    # build_env hands the rollout what the template wrote.
    from configs import search_tools

    cfg = search_tools.get_config()
    host_env, _ = build_env(resolve(cfg), listing)
    assert host_env.instruction == expected


def test_tool_output_never_enters_the_loss():
    """A rollout of the tool task with scripted replies (a search call, then the answer): the tokens the
    loss sees decode to exactly the two replies; the tool's output, which the transcript holds in
    <tool_response> tags, is none of them. Fixed seed (config.seed), scripted replies: deterministic."""
    pytest.importorskip("bm25s")
    import jax
    import numpy as np

    from configs import search_tools
    from ragen_jax.config import resolve
    from ragen_jax.rollout.carry import ForcedReplies
    from ragen_jax.starpo.train_state import policy_params
    from ragen_jax.training.run import setup

    c = search_tools.get_config()
    c.rollout.update(dict(num_groups=1, group_size=2, max_turns=2, max_actions_per_traj=2))
    c.env.max_turns = 2
    run = setup(resolve(c))
    tok = run.tokenizer
    replies = ['I will search.</think><answer><tool_call>{"name": "search", "arguments": '
               '{"query": "Anouk Brennan born"}}</tool_call></answer>',
               "Found it.</think><answer>finish[Kessock]</answer>"]
    ids = [tok(r, add_special_tokens=False)["input_ids"] for r in replies]
    width = max(map(len, ids))
    assert width <= c.rollout.max_new_tokens
    tokens = np.zeros((2, 2, width), np.int32)
    for t, row in enumerate(ids):
        tokens[:, t, :len(row)] = row
    forced = ForcedReplies(tokens=tokens, lengths=np.asarray([[len(i) for i in ids]] * 2, np.int32))
    traj = run.rollout(policy_params(run.train_state), jax.random.key(0), forced=forced)
    for b in range(2):
        buf, mask = np.asarray(traj.tokens[b]), np.asarray(traj.loss_mask[b])
        transcript = tok.decode(buf[np.asarray(traj.valid_mask[b])])
        assert "<tool_response>" in transcript and "</tool_response>" in transcript
        learned = tok.decode(buf[mask])
        assert learned.replace(tok.eos_token, "") == "".join(replies)
        assert "<tool_response>" not in learned
