"""Built-in tools an agent config can name (``agent: {kind: tool, tools: [python]}``).

A config crosses Redis as plain data, so tools are referenced by kind: these two are
registered under the entry-point group ``ludic.tools`` (libludic/plugins.py), and a user's
tool is any plain function named by its import path or its own entry point. Its typed
signature becomes the tool's JSON schema (see ``Tool.from_function``).

* ``python(code, stdin="")``: runs ``code`` as a script in the code_exec sandbox (the
  same one that grades code_exec answers: namespaces + rlimits, 2 s, 256 MB) and returns
  its exit status, stdout and stderr, each cut to 400 characters (the tool message goes
  back into the model's context, which is short on small models). Where the sandbox
  refuses to run (a guarantee it cannot keep on this host, not allowed by
  ``LUDIC_SANDBOX_ALLOW``) it raises ``ToolUnavailable`` with the sandbox's reason.
* ``calculator(expression)``: evaluates ``+ - * / // % **`` and parentheses over
  numbers (an AST walk, never ``eval``).
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from libludic.agents.tool_agent import ToolUnavailable
from libludic.envs.code_exec.env import default_sandbox

_OUT = 400
_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def python(code: str, stdin: str = "") -> str:
    """Run a Python 3 script in a sandbox (2 s, 256 MB) and return its exit status, stdout and stderr."""
    sandbox = default_sandbox()
    try:
        sandbox.describe()  # probed once per process: a guarantee it cannot keep raises
    except RuntimeError as e:
        raise ToolUnavailable(f"the python tool cannot run: {e}") from e
    r = sandbox.run(code, stdin=stdin, timeout_s=2.0, memory_limit_mb=256)
    return f"status: {r.reason}\nstdout:\n{r.stdout[:_OUT]}\nstderr:\n{r.stderr[-_OUT:]}"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."""

    def ev(node: ast.AST) -> Any:
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError(f"exponent {right} is too large (max 100)")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {ast.dump(node)[:60]}")

    return str(ev(ast.parse(expression, mode="eval").body))
