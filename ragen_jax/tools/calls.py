"""Tool calls in a model's reply, and running them.

A parser (registry ``TOOL_CALL_PARSERS``) reads the calls out of a reply's text:

* ``hermes`` — Qwen2.5's and Hermes' format, what their chat templates teach: each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several per reply;
* ``search_tag`` — Search-R1's ``<search>query</search>``, a call of the ``search`` tool.

A call that does not parse (malformed or truncated JSON, no name, arguments that are not an object)
is a ``ToolCall`` with ``error`` set: the environment charges the format penalty and tells the model
what was wrong, as for a malformed action; it never raises.

``run_calls`` executes a reply's calls in parallel (threads; coroutine tools on an event loop), each
under its tool's ``timeout_s``; an unknown tool, arguments that do not fit the schema, an exception
or a timeout come back as that call's output text (``ToolResult.error``), never as an exception.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import re
import time
from typing import Callable, Optional, Sequence

from ragen_jax.registry import Registry
from ragen_jax.tools.schema import Tool, check_arguments

MAX_CALLS_PER_REPLY = 8  # calls past this many are reported, not run
MAX_OUTPUT_CHARS = 4000  # a tool's output as the model sees it


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: ``name`` and ``arguments`` (a dict), or ``error`` (why the call text did not parse;
    ``text`` is what was read)."""

    name: str = ""
    arguments: dict = dataclasses.field(default_factory=dict)
    id: str = ""
    error: str = ""
    text: str = ""


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """The outcome of one call: ``content`` is what the model reads (the output, or the error)."""

    call: ToolCall
    content: str
    error: str = ""  # "" when the tool ran and returned
    seconds: float = 0.0


TOOL_CALL_PARSERS: Registry[Callable[[str], list[ToolCall]]] = Registry("tool-call format")

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", flags=re.DOTALL)


@TOOL_CALL_PARSERS.register("hermes")
def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` in ``text`` (an unclosed last one is read as truncated)."""
    calls = []
    for i, match in enumerate(_HERMES.finditer(text)):
        body, closed = match.group(1).strip(), bool(match.group(2))
        call_id = f"call_{i}"
        if not closed:
            calls.append(ToolCall(id=call_id, text=body, error="the tool call is not closed with </tool_call> "
                                  "(the reply was cut or malformed)"))
            continue
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:
            calls.append(ToolCall(id=call_id, text=body[:200], error=f"the tool call is not valid JSON ({e})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj.get("name"):
            calls.append(ToolCall(id=call_id, text=body[:200], error='a tool call is a JSON object with a "name" '
                                  'string and an "arguments" object'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string, as the OpenAI API does
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(name=obj["name"], id=call_id, text=body[:200],
                                  error='"arguments" must be a JSON object'))
            continue
        calls.append(ToolCall(name=obj["name"], arguments=args, id=call_id))
    return calls


_SEARCH = re.compile(r"<search>(.*?)(</search>|$)", flags=re.DOTALL)


@TOOL_CALL_PARSERS.register("search_tag")
def parse_search_tag(text: str) -> list[ToolCall]:
    """Search-R1's ``<search>query</search>``: a call of the ``search`` tool with ``{"query": ...}``."""
    calls = []
    for i, match in enumerate(_SEARCH.finditer(text)):
        query, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(ToolCall(id=f"call_{i}", text=query[:200], error="<search> is not closed with </search>"))
        elif not query:
            calls.append(ToolCall(id=f"call_{i}", error="the search query is empty"))
        else:
            calls.append(ToolCall(name="search", arguments={"query": query}, id=f"call_{i}"))
    return calls


def parse_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """The calls in ``text`` under the format ``fmt`` (``TOOL_CALL_PARSERS``)."""
    return TOOL_CALL_PARSERS.get(fmt)(text)


def _as_text(value) -> str:
    if isinstance(value, str):
        out = value
    else:
        try:
            out = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            out = str(value)
    return out if len(out) <= MAX_OUTPUT_CHARS else out[:MAX_OUTPUT_CHARS] + " ...[cut]"


def _invoke(t: Tool, arguments: dict):
    if inspect.iscoroutinefunction(t.fn):
        return asyncio.run(asyncio.wait_for(t.fn(**arguments), t.timeout_s))
    return t.fn(**arguments)


# Calls run on daemon-like workers shared by every run_calls: a call past its timeout is abandoned
# (a Python thread cannot be stopped), so a tool that may hang must bound itself (the Python tool's
# sandbox does); the pool is wide enough that abandoned calls do not starve the next turn's.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="ragen-tool")


def run_calls(calls: Sequence[ToolCall], tools: dict[str, Tool] | Sequence[Tool],
              max_calls: int = MAX_CALLS_PER_REPLY) -> list[ToolResult]:
    """Runs ``calls`` in parallel, each under its tool's ``timeout_s``; one ``ToolResult`` per call, in
    order (see the module docstring)."""
    table = tools if isinstance(tools, dict) else {t.name: t for t in tools}
    results: list[Optional[ToolResult]] = [None] * len(calls)
    pending = {}
    for i, call in enumerate(calls):
        if call.error:
            results[i] = ToolResult(call, f"Error: {call.error}", error=call.error)
        elif i >= max_calls:
            results[i] = ToolResult(call, f"Error: at most {max_calls} tool calls a reply; this one was not run",
                                    error="too many calls")
        elif call.name not in table:
            known = ", ".join(sorted(table)) or "none"
            results[i] = ToolResult(call, f"Error: unknown tool {call.name!r}; the tools are: {known}",
                                    error="unknown tool")
        else:
            problem = check_arguments(table[call.name], call.arguments)
            if problem:
                results[i] = ToolResult(call, f"Error: {call.name}: {problem}", error="bad arguments")
            else:
                pending[i] = (_POOL.submit(_invoke, table[call.name], call.arguments), time.monotonic())
    for i, (future, t0) in pending.items():
        t = table[calls[i].name]
        try:
            value = future.result(timeout=max(0.0, t.timeout_s - (time.monotonic() - t0)))
            results[i] = ToolResult(calls[i], _as_text(value), seconds=time.monotonic() - t0)
        except (concurrent.futures.TimeoutError, asyncio.TimeoutError):
            future.cancel()
            results[i] = ToolResult(calls[i], f"Error: {t.name} did not answer within {t.timeout_s:g} s",
                                    error="timeout", seconds=time.monotonic() - t0)
        except Exception as e:  # the tool's own failure is the model's information, not a crash
            results[i] = ToolResult(calls[i], f"Error: {t.name} raised {type(e).__name__}: {_as_text(str(e))}",
                                    error=type(e).__name__, seconds=time.monotonic() - t0)
    return results
