"""Tools in OpenAI's chat format, for the server (``ragen_jax.serve``): a request's ``tools`` checked,
its conversation (assistant ``tool_calls``, ``tool`` messages) written as the model reads it, and a
reply's ``<tool_call>`` text returned as ``tool_calls``.

A model reads tools one of two ways:

* its chat template lists them (Qwen2.5's, Hermes-style: ``apply_chat_template(..., tools=)``): the
  messages go to the template as OpenAI structures (arguments as objects), which writes calls and
  tool results its own way;
* its template ignores ``tools`` (SmolLM2's, the tiny preset's): the conversation is written in the
  convention ``ToolEnv`` trains on — the listing in Qwen2.5's words appended to the system message,
  an assistant's calls as ``<tool_call>{...}</tool_call>`` text, tool results as a user message of
  ``<tool_response>`` blocks.
"""
from __future__ import annotations

import json
import re
import secrets

from ragen_jax.tools.calls import parse_hermes

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_tools(tools) -> list[dict]:
    """A request's ``tools``: a non-empty list of ``{"type": "function", "function": {"name", ...}}``.
    Raises ``ValueError`` naming the entry and what is wrong."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("'tools' must be a non-empty list of {'type': 'function', 'function': {...}} objects")
    names = set()
    for k, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise ValueError(f"tools[{k}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"tools[{k}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if name in names:
            raise ValueError(f"tools[{k}].function.name {name!r} is listed twice")
        names.add(name)
        if not isinstance(f.get("description", ""), str):
            raise ValueError(f"tools[{k}].function.description must be a string")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f"tools[{k}].function.parameters must be a JSON schema of type 'object'")
    return tools


def tools_listing(tools: list[dict]) -> str:
    """The tool section of a system message in Qwen2.5's words (its template's ``tools=`` text)."""
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{schemas}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def _arguments(call: dict):
    """An assistant message's call arguments as an object (OpenAI sends a JSON string)."""
    args = call.get("function", {}).get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args


def _call_text(call: dict) -> str:
    body = {"name": call.get("function", {}).get("name", ""), "arguments": _arguments(call)}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def for_template(messages: list[dict]) -> list[dict]:
    """Messages for a template that lists tools: OpenAI's structures, arguments parsed to objects."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            m = dict(m, content=m.get("content") or "", tool_calls=[
                {"type": "function", "id": c.get("id", ""),
                 "function": {"name": c.get("function", {}).get("name", ""), "arguments": _arguments(c)}}
                for c in m["tool_calls"]])
        out.append(m)
    return out


def as_plain_chat(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages in ``system`` / ``user`` / ``assistant`` roles only, the convention ``ToolEnv``
    trains on: the listing joins the system message (one is added when there is none), calls become
    ``<tool_call>`` text, consecutive tool results one user message of ``<tool_response>`` blocks."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
                continue
            out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{tools_listing(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": tools_listing(tools)})
    return out


def reply_message(text: str, tools: list[dict] | None) -> tuple[dict, bool]:
    """The assistant message of a reply -> ``(message, called)``. With ``tools``, well-formed
    ``<tool_call>`` blocks naming listed tools become ``tool_calls`` (arguments as JSON strings, as
    OpenAI returns them) and the text before the first block the ``content`` (None when empty);
    a reply whose calls do not parse or name an unlisted tool is returned as text."""
    if tools:
        calls = parse_hermes(text)
        names = {t["function"]["name"] for t in tools}
        if calls and all(not c.error and c.name in names for c in calls):
            head = text[:text.find("<tool_call>")].strip()
            return {"role": "assistant", "content": head or None, "tool_calls": [
                {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                for c in calls]}, True
    return {"role": "assistant", "content": text}, False


def calls_in_answer(content: str, tool_calls: list[dict]) -> str:
    """A hosted model's reply (``content`` and the ``tool_calls`` the API returned) as the transcript
    text a local model would have written: the calls as ``<tool_call>`` blocks inside the reply's
    ``<answer>`` (closing one left open, or added after the text when there is none), where the
    rollout's parser hands them to the tool environment."""
    calls = "\n".join(_call_text(c) for c in tool_calls)
    if not calls:
        return content
    head, sep, tail = content.rpartition("<answer>")
    if not sep:
        return f"{content}<answer>{calls}</answer>"
    inside = tail.split("</answer>", 1)[0]
    return f"{head}<answer>{inside}{calls}</answer>"
