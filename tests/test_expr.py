import pytest
import torch

from kvforge.codegen import expr as ex


@pytest.mark.parametrize("text,value", [
    ("d // x * 128 + off * 8 + d % x", 3 * 128 + 5 * 8 + 1),
    ("(page + 1) * 2 - h", 21),
    ("D + d", 153),
    ("7 - 2 - 1", 4),          # left-associative
    ("100 // 10 // 5", 2),
    ("2 * (3 + 4) % 5", 4),
])
def test_parse_and_evaluate(text, value):
    env = {"d": 25, "x": 8, "off": 5, "page": 9, "h": -1, "D": 128}
    assert ex.evaluate(ex.parse(text), env) == value


def test_rendering_keeps_meaning():
    e = ex.parse("a - (b - c) + (a * (b // c))")
    assert str(e) == "a - (b - c) + a * (b // c)"
    assert ex.to_cpp(e, {"a": "A", "b": "B", "c": "C"}) == "A - (B - C) + A * (B / C)"


def test_substitute_folds_constants():
    e = ex.substitute(ex.parse("page * s0 + h * (nkv * D) + d // x * 1 + 0"),
                      {"nkv": 4, "D": 128, "x": 8})
    assert str(e) == "page * s0 + h * 512 + d // 8"


def test_evaluate_on_tensors_floor_divides():
    d = torch.arange(16)
    assert torch.equal(ex.evaluate(ex.parse("d // 8 * 100 + d % 8"), {"d": d}),
                       (d // 8) * 100 + d % 8)


@pytest.mark.parametrize("text,message", [
    ("d //", "unexpected end of expression in 'd //' at column 5"),
    ("d + * 2", "unexpected '*' in 'd + * 2' at column 5"),
    ("(d + 1", "expected ')' in '(d + 1' at column 7"),
    ("d ** 2", "unexpected '*' in 'd ** 2' at column 4"),
    ("d / 2", "unexpected character '/' in 'd / 2' at column 3"),
    ("d + 1)", "unexpected ')' in 'd + 1)' at column 6"),
    ("__import__('os')", "unexpected character ''' in '__import__('os')' at column 12"),
    ("dd + 1", "unknown name 'dd' (known: d, h) in 'dd + 1' at column 1"),
])
def test_errors_point_at_the_column(text, message):
    with pytest.raises(ex.ExprError) as info:
        ex.parse(text, frozenset({"d", "h"}) if "dd" in text else None)
    assert str(info.value) == message


# ---- properties over random expressions (hypothesis) -----------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

NAMES = ("d", "off", "x", "page")
_leaf = st.one_of(st.integers(0, 40).map(ex.Num), st.sampled_from(NAMES).map(ex.Sym))
_exprs = st.recursive(
    _leaf,
    lambda inner: st.builds(ex.BinOp, st.sampled_from(["+", "*", "//", "%", "-"]), inner, inner),
    max_leaves=12)
_env = st.fixed_dictionaries({n: st.integers(1, 50) for n in NAMES})


def _safe_eval(e, env):
    try:
        return ex.evaluate(e, env)
    except ZeroDivisionError:
        return "div0"


@settings(max_examples=300, deadline=None)
@given(_exprs, _env)
def test_rendering_then_parsing_keeps_the_value(e, env):
    """str() inserts exactly the parentheses needed: re-parsing gives the same function."""
    assert _safe_eval(ex.parse(str(e)), env) == _safe_eval(e, env)


@settings(max_examples=300, deadline=None)
@given(_exprs, _env)
def test_substitution_folds_without_changing_the_value(e, env):
    folded_env = {"x": env["x"], "page": env["page"]}
    try:
        folded = ex.substitute(e, folded_env)
    except ZeroDivisionError:
        return
    assert _safe_eval(folded, env) == _safe_eval(e, env)
