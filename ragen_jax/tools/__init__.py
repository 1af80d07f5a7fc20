"""Tools an agent calls: a Python callable with the OpenAI function schema the model sees
(``schema.py``), the calls read out of a reply and run (``calls.py``), and built-ins (``builtin.py``:
calculator, search, Python in the sandbox)."""
from ragen_jax.tools.calls import (TOOL_CALL_PARSERS, ToolCall, ToolResult, parse_calls, parse_hermes,
                                   parse_search_tag, run_calls)
from ragen_jax.tools.schema import Tool, check_arguments, function_schema, tool

__all__ = ["TOOL_CALL_PARSERS", "Tool", "ToolCall", "ToolResult", "check_arguments", "function_schema",
           "parse_calls", "parse_hermes", "parse_search_tag", "run_calls", "tool"]
