"""A calculator MCP server: `python -m k2_data.agentic.servers.calculator` (stdio)."""

from __future__ import annotations

import ast
import math
import operator
import statistics as stats

from k2_data.agentic.servers._base import make_server, tool_error

server = make_server("calculator", "Exact arithmetic and descriptive statistics.")

_BIN = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UN = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"sqrt": math.sqrt, "abs": abs, "round": round, "log": math.log, "exp": math.exp}


def evaluate(expression: str) -> float | int:
    """Arithmetic on numbers with + - * / // % **, parentheses and sqrt/abs/round/log/exp; no names."""

    def ev(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            right = ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _BIN[type(node.op)](ev(node.left), right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UN:
            return _UN[type(node.op)](ev(node.operand))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCS
            and not node.keywords
        ):
            return _FUNCS[node.func.id](*(ev(a) for a in node.args))
        raise ValueError(f"unsupported expression element: {ast.dump(node)[:60]}")

    return ev(ast.parse(expression, mode="eval"))


@server.tool()
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. "(3 + 4) * 2" or "sqrt(2) / 3"."""
    try:
        return str(evaluate(expression))
    except ZeroDivisionError:
        raise tool_error("division by zero") from None
    except (ValueError, SyntaxError, TypeError, OverflowError) as e:
        raise tool_error(f"cannot evaluate {expression!r}: {e}") from None


@server.tool()
def statistics(numbers: list[float]) -> dict:
    """Count, mean, median, min, max and (for 2+ numbers) standard deviation of a list of numbers."""
    if not numbers:
        raise tool_error("numbers is empty")
    out = {
        "count": len(numbers),
        "mean": stats.fmean(numbers),
        "median": stats.median(numbers),
        "min": min(numbers),
        "max": max(numbers),
    }
    if len(numbers) > 1:
        out["stdev"] = stats.stdev(numbers)
    return out


if __name__ == "__main__":
    server.run("stdio")
