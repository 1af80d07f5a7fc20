"""Built-in tools: a calculator, search over a corpus, and a Python interpreter in the sandbox.

The policy is an adversary: whatever a tool evaluates is written by the model. The calculator parses
the expression with ``ast`` and evaluates only numbers and arithmetic (no names, calls, attributes
or subscripts; bounded exponents and sizes), never ``eval``. The Python tool runs the program in the
code environment's sandbox (``environments/code/sandbox.py``: no network, no host files, limits on
time, memory, output and processes).
"""
from __future__ import annotations

import ast
import math
import operator

from environments.code.sandbox import Limits, Sandbox
from environments.text.retrieval import format_results
from environments.text.search_qa import shared_bm25
from ragen_jax.tools.schema import Tool, tool

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 500
MAX_MAGNITUDE = 1e100  # results and operands past this are refused (a power tower would take forever)


class CalculatorError(ValueError):
    """The expression is not arithmetic the calculator evaluates (the message says what)."""


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > 1000 or (abs(left) > 1 and abs(right) * math.log10(abs(left)) > 100):
                raise CalculatorError("the power is too large (results are limited to 1e100)")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        if abs(value) > MAX_MAGNITUDE:
            raise CalculatorError("the result is larger than 1e100")
        return value
    raise CalculatorError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


def calculate(expression: str):
    """The value of an arithmetic ``expression`` (numbers, + - * / // % **, parentheses)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("the expression does not parse") from None
    try:
        value = _evaluate(tree)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return int(value)
    return value


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
      expression: numbers with + - * / // % ** and parentheses, e.g. "(44 - 19) * 2".
    """
    return str(calculate(expression))


def search_tool(retriever=None, top_k: int = 3, timeout_s: float = 10.0, max_chars: int = 4000) -> Tool:
    """A ``search(query)`` tool over ``retriever`` (``environments.text.retrieval``: ``BM25Retriever``
    over the shipped corpus by default, one index per process, or an ``HTTPRetriever`` of a retrieval
    server); the passages it returns are cut to ``max_chars`` in all."""
    index = retriever if retriever is not None else shared_bm25(None)

    def search(query: str) -> str:
        """Search the knowledge corpus and return the most relevant passages.

        Args:
          query: what to look for, in a few words.
        """
        return format_results(index.search(query, top_k=top_k), max_results=top_k, max_total_chars=max_chars)

    return tool(search, timeout_s=timeout_s)


def python_tool(limits=None, timeout_s: float = 15.0, allow_unsandboxed: bool = False) -> Tool:
    """A ``python(code)`` tool: the program runs in the code environment's ``Sandbox`` and the model reads
    its standard output (and error, and how it ended)."""
    sandbox = Sandbox(limits or Limits(timeout_s=min(10.0, timeout_s)), allow_unsandboxed=allow_unsandboxed)

    def python(code: str) -> str:
        """Run a Python program and return what it prints.

        Args:
          code: the whole program; print what you want to see.
        """
        result = sandbox.run(code)
        out = result.stdout.strip()
        if result.status != "exited" or result.exit_code != 0:
            tail = result.stderr.strip().splitlines()[-3:]
            ended = f"exit code {result.exit_code}" if result.status == "exited" else result.status
            out = (out + "\n" if out else "") + f"[{ended}] " + " | ".join(tail)
        return out or "(no output)"

    return tool(python, timeout_s=timeout_s)
