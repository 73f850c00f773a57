"""Index expressions of the layout contracts.

A contract writes shapes and element positions as small integer expressions
(`d // x`, `off % x`, `D + d`). They are parsed here into a tiny AST and only
ever *emitted* (as C++ for the kernel, evaluated on ints or integer arrays for the
reference and the layout analysis); nothing from the YAML is pasted or `eval`ed.

Grammar::

    expr   := term (('+' | '-') term)*
    term   := factor (('*' | '//' | '%') factor)*
    factor := INT | NAME | '(' expr ')'

All operands are non-negative in every use (slots are guarded before any address
is formed), so C++ truncating `/` and `%` agree with Python's floor semantics.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Union

__all__ = ["Expr", "Num", "Sym", "BinOp", "ExprError", "parse"]


class ExprError(ValueError):
    """A malformed expression; `column` is 0-based within the expression text."""

    def __init__(self, message: str, text: str, column: int):
        super().__init__(f"{message} in '{text}' at column {column + 1}")
        self.reason = message
        self.text = text
        self.column = column


@dataclass(frozen=True)
class Num:
    value: int

    def symbols(self) -> frozenset[str]:
        return frozenset()

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class Sym:
    name: str

    def symbols(self) -> frozenset[str]:
        return frozenset({self.name})

    def __str__(self) -> str:
        return self.name


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "//": 2, "%": 2}
_PY_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "//": lambda a, b: a // b,
    "%": lambda a, b: a % b,
}


@dataclass(frozen=True)
class BinOp:
    op: str
    lhs: "Expr"
    rhs: "Expr"

    def symbols(self) -> frozenset[str]:
        return self.lhs.symbols() | self.rhs.symbols()

    def __str__(self) -> str:
        return _render(self, lambda s: s.name, "//")


Expr = Union[Num, Sym, BinOp]


def _render(e: Expr, name_of: Callable[[Sym], str], div: str) -> str:
    if isinstance(e, Num):
        return str(e.value)
    if isinstance(e, Sym):
        return name_of(e)
    prec = _PRECEDENCE[e.op]

    def side(child: Expr, right: bool) -> str:
        text = _render(child, name_of, div)
        if isinstance(child, BinOp):
            cp = _PRECEDENCE[child.op]
            # Left-associative: a right child of equal precedence needs parentheses.
            if cp < prec or (right and cp == prec):
                return f"({text})"
        return text

    op = div if e.op == "//" else e.op
    return f"{side(e.lhs, False)} {op} {side(e.rhs, True)}"


def evaluate(e: Expr, env: Mapping[str, Any]) -> Any:
    """Evaluate on Python ints, numpy or torch integer arrays (all floor-divide)."""
    if isinstance(e, Num):
        return e.value
    if isinstance(e, Sym):
        return env[e.name]
    return _PY_OPS[e.op](evaluate(e.lhs, env), evaluate(e.rhs, env))


def substitute(e: Expr, values: Mapping[str, int]) -> Expr:
    """Replace known symbols by constants and fold constant sub-expressions."""
    if isinstance(e, Num):
        return e
    if isinstance(e, Sym):
        return Num(values[e.name]) if e.name in values else e
    lhs, rhs = substitute(e.lhs, values), substitute(e.rhs, values)
    if isinstance(lhs, Num) and isinstance(rhs, Num):
        if e.op in ("//", "%") and rhs.value == 0:
            raise ZeroDivisionError(f"division by zero in '{e}'")
        return Num(_PY_OPS[e.op](lhs.value, rhs.value))
    # Identities that keep the emitted C++ free of `* 1` and `+ 0`.
    if e.op == "*" and isinstance(rhs, Num) and rhs.value == 1:
        return lhs
    if e.op == "*" and isinstance(lhs, Num) and lhs.value == 1:
        return rhs
    if e.op in ("+", "-") and isinstance(rhs, Num) and rhs.value == 0:
        return lhs
    if e.op == "+" and isinstance(lhs, Num) and lhs.value == 0:
        return rhs
    return BinOp(e.op, lhs, rhs)


def to_cpp(e: Expr, names: Mapping[str, str]) -> str:
    """C++ text; every remaining symbol must be mapped to a C++ identifier."""
    def name_of(s: Sym) -> str:
        return names[s.name]
    return _render(e, name_of, "/")


_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z_0-9]*)|(//|[-+*%()]))")


def parse(text: str, allowed: frozenset[str] | None = None) -> Expr:
    """Parse `text`; names outside `allowed` (when given) are errors."""
    if not isinstance(text, (str, int)) or isinstance(text, bool):
        raise ExprError(f"expected an integer expression, got {type(text).__name__}", str(text), 0)
    text = str(text)
    tokens: list[tuple[str, str, int]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            col = pos + (len(text[pos:]) - len(text[pos:].lstrip()))
            raise ExprError(f"unexpected character '{text[col]}'", text, col)
        kind = "int" if m.group(1) else "name" if m.group(2) else "op"
        tokens.append((kind, m.group(m.lastindex or 0), m.start(m.lastindex or 0)))
        pos = m.end()
    tokens.append(("end", "", len(text)))
    i = 0

    def peek() -> tuple[str, str, int]:
        return tokens[i]

    def take() -> tuple[str, str, int]:
        nonlocal i
        tok = tokens[i]
        i += 1
        return tok

    def factor() -> Expr:
        kind, val, col = take()
        if kind == "int":
            return Num(int(val))
        if kind == "name":
            if allowed is not None and val not in allowed:
                raise ExprError(
                    f"unknown name '{val}' (known: {', '.join(sorted(allowed))})", text, col)
            return Sym(val)
        if (kind, val) == ("op", "("):
            inner = expr()
            k2, v2, c2 = take()
            if (k2, v2) != ("op", ")"):
                raise ExprError("expected ')'", text, c2)
            return inner
        what = "end of expression" if kind == "end" else f"'{val}'"
        raise ExprError(f"unexpected {what}", text, col)

    def binary(level: int) -> Expr:
        lhs = factor() if level == 2 else binary(2)
        while peek()[0] == "op" and _PRECEDENCE.get(peek()[1]) == level:
            op = take()[1]
            rhs = factor() if level == 2 else binary(2)
            lhs = BinOp(op, lhs, rhs)
        return lhs

    def expr() -> Expr:
        return binary(1)

    result = expr()
    kind, val, col = peek()
    if kind != "end":
        raise ExprError(f"unexpected '{val}'", text, col)
    return result
