"""A tool: a Python callable with the OpenAI function schema the model sees.

    @tool
    def search(query: str, top_k: int = 3) -> str:
        '''Search the corpus.

        Args:
          query: what to look for.
          top_k: how many passages to return.
        '''

    search.schema  # {"type": "function", "function": {"name": "search", "description": ..., "parameters": ...}}

The schema is built from the signature (JSON types from the annotations: ``str``, ``int``,
``float``, ``bool``, ``list[T]``, ``dict``, ``Literal[...]`` as an enum, ``Optional[T]`` as ``T``)
and the docstring (its first paragraph is the description; a Google-style ``Args:`` section gives
each parameter's), or given whole. Parameters without a default are required.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import re
import types
import typing
from typing import Any, Callable, Optional

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def json_type(annotation) -> dict:
    """The JSON schema of a parameter annotation; an annotation JSON cannot express raises ``TypeError``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin is typing.Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1 or next(iter(kinds)) not in _JSON_TYPES:
            raise TypeError(f"Literal{list(args)} mixes types or holds a non-JSON value; give one JSON type")
        return {"type": _JSON_TYPES[next(iter(kinds))], "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return json_type(rest[0])
        return {"anyOf": [json_type(a) for a in rest]}
    if origin in (list, tuple, collections.abc.Sequence):
        return {"type": "array", "items": json_type(args[0])} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    raise TypeError(f"annotation {annotation!r} has no JSON schema type; use str, int, float, bool, list[...], dict "
                    "or Literal[...]")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) of a Google-style docstring: the first paragraph, and
    the ``Args:`` section's entries (``name: text`` or ``name (type): text``, continued on deeper lines)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    text = "\n".join(lines)
    description = text.split("\n\n")[0].replace("\n", " ").strip()
    params: dict[str, str] = {}
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:") + 1
    except StopIteration:
        return description, params
    indent, current = None, None
    for line in lines[start:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:
            break  # the next section (Returns:, Raises:, ...)
        entry = re.match(r"^(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line.strip())
        if entry and (indent is None or depth == indent):
            indent, current = depth, entry.group(1)
            params[current] = entry.group(2).strip()
        elif current is not None and depth > indent:
            params[current] = (params[current] + " " + line.strip()).strip()
    return description, params


def function_schema(fn: Callable, name: Optional[str] = None, description: Optional[str] = None) -> dict:
    """The OpenAI function schema of ``fn`` (see the module docstring)."""
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    doc_description, doc_params = _docstring_parts(fn.__doc__ or "")
    properties, required = {}, []
    for pname, param in sig.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__}: *args / **kwargs cannot be described to a model; name each "
                            "parameter")
        if pname not in hints:
            raise TypeError(f"tool {fn.__name__}: parameter {pname!r} has no type annotation; annotate it "
                            "(str, int, float, bool, list[...], dict or Literal[...])")
        prop = json_type(hints[pname])
        if pname in doc_params:
            prop["description"] = doc_params[pname]
        if param.default is param.empty:
            required.append(pname)
        properties[pname] = prop
    return {"type": "function", "function": {
        "name": name or fn.__name__,
        "description": description if description is not None else doc_description,
        "parameters": {"type": "object", "properties": properties, "required": required},
    }}


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable the model may call: ``fn(**arguments)`` returns the tool's output (any value; it
    reaches the model as text). ``timeout_s``: how long one call may take before the model is told it
    timed out. ``fn`` may be a coroutine function."""

    fn: Callable[..., Any]
    schema: dict
    timeout_s: float = 10.0

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @property
    def parameters(self) -> dict:
        return self.schema["function"]["parameters"]

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def tool(fn: Optional[Callable] = None, *, name: Optional[str] = None, description: Optional[str] = None,
         schema: Optional[dict] = None, timeout_s: float = 10.0):
    """Makes ``fn`` a ``Tool`` (as ``@tool`` or ``@tool(name=..., timeout_s=...)``); ``schema`` replaces
    the one built from the signature and docstring."""
    def wrap(f):
        if timeout_s <= 0:
            raise ValueError(f"tool {f.__name__}: timeout_s={timeout_s} must be > 0")
        return Tool(fn=f, schema=schema if schema is not None else function_schema(f, name, description),
                    timeout_s=float(timeout_s))

    return wrap(fn) if fn is not None else wrap


def check_arguments(t: Tool, arguments: Any) -> str:
    """Why ``arguments`` do not fit ``t``'s schema ("" when they do): an object, every required key,
    no unknown key, each value of its JSON type."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    params = t.parameters
    props = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    unknown = [k for k in arguments if k not in props]
    if unknown:
        return f"unknown argument(s): {', '.join(unknown)}; {t.name} takes {', '.join(props) or 'none'}"
    for key, value in arguments.items():
        problem = _type_problem(props[key], value)
        if problem:
            return f"argument {key!r}: {problem}"
    return ""


def _type_problem(prop: dict, value) -> str:
    if "anyOf" in prop:
        return "" if any(not _type_problem(p, value) for p in prop["anyOf"]) else f"{value!r} fits none of its types"
    kind = prop.get("type")
    ok = {"string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
          "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list)}.get(kind, lambda v: True)
    if not ok(value):
        return f"expected {kind}, got {type(value).__name__}"
    if "enum" in prop and value not in prop["enum"]:
        return f"{value!r} is not one of {prop['enum']}"
    if kind == "array" and "items" in prop:
        for i, item in enumerate(value):
            problem = _type_problem(prop["items"], item)
            if problem:
                return f"item {i}: {problem}"
    return ""
