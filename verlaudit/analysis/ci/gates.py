"""Gate expressions over a run's metric series, e.g. ``median(actor/grad_norm) < 5``.

The style follows NeMo-RL's metric checks, but nothing is ever handed to ``eval``: a small tokenizer
and a recursive-descent parser accept only numbers, whitelisted aggregate functions applied to a
metric name, arithmetic, comparisons and ``and`` / ``or`` / ``not``. Anything else (attribute access,
calls of other names, lambdas, subscripts, strings that are not metric names) is a ValueError that
says where in the expression it stopped. Exercised by `pytest tests/test_gates.py` and by
``verlaudit compare RUN --baseline B --gate 'max(actor/grad_norm) < 10'``.

Grammar::

    expr    := or
    or      := and ("or" and)*
    and     := not ("and" not)*
    not     := "not" not | cmp
    cmp     := sum (CMP sum)*            chained like Python: a < b < c
    sum     := term (("+" | "-") term)*
    term    := unary (("*" | "/") unary)*
    unary   := "-" unary | atom
    atom    := NUMBER | FUNC "(" METRIC ["," INT] ")" | "(" expr ")"

``FUNC(metric, n)`` aggregates only the last ``n`` recorded steps. Metric names may contain
``/ . - _ @ :`` (``actor/grad_norm``, ``timing_s/gen``); quote them (``'a b'``) if they hold anything else.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def _finite(xs: Sequence[float]) -> list[float]:
    return [x for x in xs if math.isfinite(x)]


def _nan_if_any_nonfinite(fn: Callable[[Sequence[float]], float]) -> Callable[[Sequence[float]], float]:
    # A NaN anywhere in the series must fail a gate like `max(loss) < 5`, not be skipped over.
    def wrapped(xs: Sequence[float]) -> float:
        if not xs:
            return math.nan
        if any(math.isnan(x) for x in xs):
            return math.nan
        return float(fn(xs))

    return wrapped


FUNCTIONS: dict[str, Callable[[Sequence[float]], float]] = {
    "mean": _nan_if_any_nonfinite(statistics.fmean),
    "median": _nan_if_any_nonfinite(statistics.median),
    "min": _nan_if_any_nonfinite(min),
    "max": _nan_if_any_nonfinite(max),
    "std": _nan_if_any_nonfinite(lambda xs: statistics.pstdev(xs) if len(xs) > 1 else 0.0),
    "sum": _nan_if_any_nonfinite(math.fsum),
    "last": lambda xs: float(xs[-1]) if xs else math.nan,
    "first": lambda xs: float(xs[0]) if xs else math.nan,
    "count": lambda xs: float(len(xs)),
    "count_nonfinite": lambda xs: float(len(xs) - len(_finite(xs))),
}
"""Aggregates over the per-step values of one metric (steps where it was not recorded are absent)."""

_CMP = {
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}
_TOKEN = re.compile(
    r"""\s*(?:
      (?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    | (?P<op><=|>=|==|!=|<|>|\(|\)|,|\+|-|\*|/)
    | (?P<name>[A-Za-z_][A-Za-z0-9_./@:\-]*)
    | (?P<str>'[^']*'|"[^"]*")
    )""",
    re.VERBOSE,
)
_KEYWORDS = ("and", "or", "not")


@dataclasses.dataclass(frozen=True)
class _Tok:
    kind: str  # num | op | name | str | end
    text: str
    pos: int


def tokenize(text: str) -> list[_Tok]:
    """Splits a gate expression into tokens; a character that starts no token is a ValueError."""
    toks: list[_Tok] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(
                f"gate {text!r}: unexpected character {text[pos:].lstrip()[:1]!r} at column {pos + 1}"
            )
        kind = m.lastgroup or ""
        toks.append(_Tok(kind, m.group(kind), m.start(kind)))
        pos = m.end()
    toks.append(_Tok("end", "", len(text)))
    return toks


# The parse tree: nested tuples, so evaluation is a small interpreter over known node shapes only.
Node = tuple


@dataclasses.dataclass(frozen=True)
class Gate:
    """A parsed gate: its source text, the tree, and the metric names it reads."""

    text: str
    tree: Node
    metrics: tuple[str, ...]

    def evaluate(self, series: Mapping[str, Sequence[float]]) -> tuple[bool, dict[str, float]]:
        """Evaluates against ``metric -> values``; returns (passed, value of every aggregate term).
        A metric missing from ``series`` raises KeyError naming it (the caller decides whether that
        is a typo or a run that died before recording it)."""
        values: dict[str, float] = {}
        result = _eval(self.tree, series, values)
        return bool(result), values


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = tokenize(text)
        self.i = 0
        self.metrics: list[str] = []

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def take(self) -> _Tok:
        t = self.toks[self.i]
        self.i += 1
        return t

    def fail(self, tok: _Tok, what: str) -> ValueError:
        shown = tok.text or "end of expression"
        return ValueError(f"gate {self.text!r}: {what} at column {tok.pos + 1} (found {shown!r})")

    def expect(self, text: str) -> None:
        t = self.take()
        if t.text != text:
            raise self.fail(t, f"expected {text!r}")

    def parse(self) -> Gate:
        tree = self.or_()
        t = self.peek()
        if t.kind != "end":
            raise self.fail(t, "unexpected text after a complete expression")
        if tree[0] not in ("cmp", "and", "or", "not"):
            raise ValueError(
                f"gate {self.text!r}: a gate must compare something, e.g. 'median(actor/grad_norm) < 5'"
            )
        return Gate(self.text, tree, tuple(dict.fromkeys(self.metrics)))

    def or_(self) -> Node:
        node = self.and_()
        while self.peek().kind == "name" and self.peek().text == "or":
            self.take()
            node = ("or", node, self.and_())
        return node

    def and_(self) -> Node:
        node = self.not_()
        while self.peek().kind == "name" and self.peek().text == "and":
            self.take()
            node = ("and", node, self.not_())
        return node

    def not_(self) -> Node:
        if self.peek().kind == "name" and self.peek().text == "not":
            self.take()
            return ("not", self.not_())
        return self.cmp()

    def cmp(self) -> Node:
        first = self.sum_()
        ops: list[str] = []
        rest: list[Node] = []
        while self.peek().kind == "op" and self.peek().text in _CMP:
            ops.append(self.take().text)
            rest.append(self.sum_())
        return ("cmp", first, tuple(ops), tuple(rest)) if ops else first

    def sum_(self) -> Node:
        node = self.term()
        while self.peek().kind == "op" and self.peek().text in "+-":
            op = self.take().text
            node = ("bin", op, node, self.term())
        return node

    def term(self) -> Node:
        node = self.unary()
        while self.peek().kind == "op" and self.peek().text in "*/":
            op = self.take().text
            node = ("bin", op, node, self.unary())
        return node

    def unary(self) -> Node:
        if self.peek().kind == "op" and self.peek().text == "-":
            self.take()
            return ("neg", self.unary())
        return self.atom()

    def atom(self) -> Node:
        t = self.take()
        if t.kind == "num":
            return ("num", float(t.text))
        if t.kind == "op" and t.text == "(":
            node = self.or_()
            self.expect(")")
            return node
        if t.kind == "name" and t.text not in _KEYWORDS:
            if t.text not in FUNCTIONS:
                nxt = self.peek()
                if nxt.text == "(":
                    raise self.fail(t, f"unknown function {t.text!r}; expected one of {', '.join(FUNCTIONS)}")
                raise self.fail(
                    t,
                    f"a bare name {t.text!r} is not a value; wrap the metric in a function, e.g. last({t.text})",
                )
            return self.call(t.text)
        raise self.fail(t, "expected a number, a function call like max(actor/loss), or '('")

    def call(self, func: str) -> Node:
        self.expect("(")
        m = self.take()
        if m.kind == "str":
            metric = m.text[1:-1]
        elif m.kind == "name" and m.text not in _KEYWORDS:
            metric = m.text
        else:
            raise self.fail(m, f"{func}() takes a metric name such as actor/grad_norm")
        window = None
        if self.peek().text == ",":
            self.take()
            w = self.take()
            if w.kind != "num" or not w.text.isdigit() or int(w.text) < 1:
                raise self.fail(w, f"{func}(metric, N): N must be a positive integer (the last N steps)")
            window = int(w.text)
        self.expect(")")
        self.metrics.append(metric)
        return ("call", func, metric, window)


def parse_gate(text: str) -> Gate:
    """Parses one gate expression; raises ValueError saying what is wrong and where."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"gate {text!r}: empty; expected e.g. 'median(actor/grad_norm) < 5'")
    return _Parser(text.strip()).parse()


def _eval(node: Node, series: Mapping[str, Sequence[float]], values: dict[str, float]) -> Any:
    tag = node[0]
    if tag == "num":
        return node[1]
    if tag == "call":
        _, func, metric, window = node
        if metric not in series:
            raise KeyError(metric)
        xs = list(series[metric])
        if window is not None:
            xs = xs[-window:]
        v = FUNCTIONS[func](xs)
        values[f"{func}({metric}{'' if window is None else f', {window}'})"] = v
        return v
    if tag == "neg":
        return -_eval(node[1], series, values)
    if tag == "bin":
        _, op, a, b = node
        x, y = _eval(a, series, values), _eval(b, series, values)
        if op == "+":
            return x + y
        if op == "-":
            return x - y
        if op == "*":
            return x * y
        return x / y if y != 0 else math.copysign(math.inf, x) if x != 0 else math.nan
    if tag == "cmp":
        _, first, ops, rest = node
        left = _eval(first, series, values)
        ok = True
        for op, r in zip(ops, rest):
            right = _eval(r, series, values)
            ok = ok and bool(_CMP[op](left, right))
            left = right
        return ok
    if tag == "not":
        return not _eval(node[1], series, values)
    if tag == "and":
        # both sides evaluated so the report shows every value the gate depends on
        a, b = _eval(node[1], series, values), _eval(node[2], series, values)
        return bool(a) and bool(b)
    if tag == "or":
        a, b = _eval(node[1], series, values), _eval(node[2], series, values)
        return bool(a) or bool(b)
    raise AssertionError(f"unknown gate node {tag!r}")


def check_gates(
    gates: Sequence[Gate], metrics_by_name: Mapping[str, Sequence[float]]
) -> list[dict[str, Any]]:
    """Evaluates each gate; returns one record per gate: text, passed, values, message."""
    out = []
    for g in gates:
        missing = [m for m in g.metrics if m not in metrics_by_name]
        if missing:
            out.append(
                {
                    "gate": g.text,
                    "passed": False,
                    "values": {},
                    "message": f"metric {', '.join(missing)} was not recorded by this run",
                }
            )
            continue
        passed, values = g.evaluate(metrics_by_name)
        shown = ", ".join(f"{k} = {v:.6g}" for k, v in values.items())
        out.append(
            {
                "gate": g.text,
                "passed": passed,
                "values": values,
                "message": f"{'passed' if passed else 'FAILED'}: {g.text} ({shown})",
            }
        )
    return out


def check_known_metrics(gates: Sequence[Gate], known: Sequence[str], where: str = "gate") -> None:
    """A metric that no compared run ever recorded is a typo, not a failure: ValueError naming it
    and the closest recorded names."""
    import difflib

    names = set(known)
    for g in gates:
        for m in g.metrics:
            if m not in names:
                close = difflib.get_close_matches(m, sorted(names), n=3, cutoff=0.5)
                hint = (
                    f"; did you mean {', '.join(close)}?" if close else "; check metrics.jsonl for the names"
                )
                raise ValueError(f"{where} {g.text!r}: unknown metric {m!r} (no run recorded it){hint}")
