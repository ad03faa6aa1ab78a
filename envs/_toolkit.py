"""The stateless tools of the ``tools`` env and the small tables they read.

* :func:`calc` — exact arithmetic (``+ - * /``, parentheses, decimals) parsed with :mod:`ast`;
* :func:`convert` — units of time, length, mass and temperature, and currencies at the fixed
  rates of the ``rates`` table;
* :func:`lookup` — rows of the shipped tables ``staff``, ``offices``, ``prices``, ``rates`` and
  ``holidays`` (invented staff and prices; the 2025 public holidays of the Berlin office).

Each raises :class:`~envs._textactions.ActionError` with the reason on bad input. Numbers are
:class:`fractions.Fraction` throughout, so results do not depend on float rounding.
"""
from __future__ import annotations

import ast
import re
from fractions import Fraction

from ._textactions import ActionError

HOME = "Berlin"  # the office whose time the calendar uses and whose holidays apply
STAFF = {  # name: (office, role)
    "Ana Duarte": ("Lisbon", "designer"), "Ben Okafor": ("London", "engineer"),
    "Chloe Martin": ("Zurich", "lawyer"), "Dev Patel": ("Mumbai", "engineer"),
    "Emi Sato": ("Tokyo", "product manager"), "Gus Miller": ("New York", "sales lead"),
    "Hana Kim": ("Tokyo", "researcher"), "Ivo Novak": ("Berlin", "accountant"),
    "Kai Silva": ("New York", "designer"), "Lea Brown": ("London", "recruiter"),
    "Omar Aziz": ("Mumbai", "analyst"), "Rita Costa": ("Lisbon", "engineer"),
}
OFFICES = {  # office: (UTC offset in hours, currency)
    "Berlin": (Fraction(1), "EUR"), "Lisbon": (Fraction(0), "EUR"), "London": (Fraction(0), "GBP"),
    "Zurich": (Fraction(1), "CHF"), "Mumbai": (Fraction(11, 2), "INR"),
    "Tokyo": (Fraction(9), "JPY"), "New York": (Fraction(-5), "USD"),
}
RATES = {  # value of one unit in EUR (fixed for the env)
    "EUR": Fraction(1), "USD": Fraction("0.92"), "GBP": Fraction("1.17"), "CHF": Fraction("1.04"),
    "JPY": Fraction("0.0062"), "INR": Fraction("0.011"),
}
PRICES = {  # item: (price, currency)
    "laptop": (Fraction("1299.00"), "USD"), "monitor": (Fraction("249.99"), "EUR"),
    "desk chair": (Fraction("189.50"), "GBP"), "keyboard": (Fraction(12800), "JPY"),
    "headset": (Fraction("79.90"), "CHF"), "webcam": (Fraction(4999), "INR"),
    "docking station": (Fraction("159.00"), "USD"), "standing desk": (Fraction("420.00"), "EUR"),
    "projector": (Fraction(68000), "JPY"), "whiteboard": (Fraction("95.00"), "GBP"),
}
HOLIDAYS = {
    "2025-01-01": "New Year's Day", "2025-04-18": "Good Friday", "2025-04-21": "Easter Monday",
    "2025-05-01": "Labour Day", "2025-05-29": "Ascension Day", "2025-06-09": "Whit Monday",
    "2025-10-03": "German Unity Day", "2025-12-25": "Christmas Day", "2025-12-26": "Boxing Day",
}
_UNITS = {  # unit: (dimension, size in the dimension's base unit)
    "min": ("time", Fraction(1)), "h": ("time", Fraction(60)), "day": ("time", Fraction(1440)),
    "week": ("time", Fraction(10080)), "m": ("length", Fraction(1)), "km": ("length", Fraction(1000)),
    "mi": ("length", Fraction("1609.344")), "ft": ("length", Fraction("0.3048")),
    "g": ("mass", Fraction(1)), "kg": ("mass", Fraction(1000)), "lb": ("mass", Fraction("453.59237")),
    **{cur: ("currency", rate) for cur, rate in RATES.items()},
}
_ALIASES = {"minute": "min", "minutes": "min", "mins": "min", "hour": "h", "hours": "h", "hr": "h",
            "hrs": "h", "days": "day", "weeks": "week", "meter": "m", "meters": "m", "metre": "m",
            "metres": "m", "miles": "mi", "mile": "mi", "feet": "ft", "foot": "ft", "pounds": "lb",
            "lbs": "lb", "grams": "g", "°c": "c", "°f": "f", "celsius": "c", "fahrenheit": "f"}
_CONVERT_RE = re.compile(r"^(-?\d+(?:\.\d+)?)\s*([^\d\s].*?)\s+(?:to|in|->)\s+(.+)$", re.IGNORECASE)


def fmt(x: Fraction) -> str:
    """An integer as such, anything else to at most 4 decimals."""
    if x.denominator == 1:
        return str(x.numerator)
    return f"{float(x):.4f}".rstrip("0").rstrip(".")


def number(text: str, what: str = "a number") -> Fraction:
    """A decimal number written like ``12``, ``-3`` or ``1.25``."""
    if not re.fullmatch(r"-?\d+(?:\.\d+)?", text.strip()):
        raise ActionError(f"{what} must be a number like 12 or 1.5, got {text.strip()[:30]!r}")
    return Fraction(text.strip())


def calc(expr: str) -> str:
    """``EXPR = VALUE``; only numbers, ``+ - * /`` and parentheses."""
    text = expr.strip().replace("×", "*").replace("÷", "/").rstrip("=").strip()
    if len(text) > 200:
        raise ActionError("the expression is too long")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ActionError(f"cannot parse the expression {text[:60]!r}") from None
    ops = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__,
           ast.Div: Fraction.__truediv__}

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(repr(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ActionError("division by zero")
            return ops[type(node.op)](left, right)
        raise ActionError("calc takes numbers, + - * / and parentheses only")

    return f"{text} = {fmt(walk(tree.body))}"


def _unit(text: str) -> str:
    word = text.strip().rstrip(".").strip()
    if word.upper() in RATES:
        return word.upper()
    word = _ALIASES.get(word.lower(), word.lower())
    if word in _UNITS or word in ("c", "f"):
        return word
    known = ", ".join(u for u in _UNITS) + ", C, F"
    raise ActionError(f"unknown unit {text.strip()[:20]!r} (known: {known})")


def convert(arg: str) -> tuple[str, Fraction, str]:
    """``(text, value, unit)`` of ``VALUE UNIT to UNIT``, e.g. ``1.5 h to min``."""
    m = _CONVERT_RE.match(arg.strip())
    if m is None:
        raise ActionError("write `convert: VALUE UNIT to UNIT`, e.g. `convert: 1.5 h to min`")
    value, src, dst = Fraction(m.group(1)), _unit(m.group(2)), _unit(m.group(3))
    if {src, dst} <= {"c", "f"}:
        out = value if src == dst else value * Fraction(9, 5) + 32 if src == "c" else (value - 32) * Fraction(5, 9)
    elif src in _UNITS and dst in _UNITS and _UNITS[src][0] == _UNITS[dst][0]:
        out = value * _UNITS[src][1] / _UNITS[dst][1]
    else:
        raise ActionError(f"cannot convert {src} to {dst}")
    show = lambda u: u.upper() if u in ("c", "f") else u  # noqa: E731
    return f"{fmt(value)} {show(src)} = {fmt(out)} {show(dst)}", out, dst


TABLES = {
    "staff": {k: f"{k}: office {o}, role {r}" for k, (o, r) in STAFF.items()},
    "offices": {k: f"{k}: UTC{'+' if off >= 0 else '-'}{fmt(abs(off))}, currency {cur}"
                for k, (off, cur) in OFFICES.items()},
    "prices": {k: f"{k}: {fmt(p)} {cur} each" for k, (p, cur) in PRICES.items()},
    "rates": {k: f"1 {k} = {fmt(r)} EUR" for k, r in RATES.items()},
    "holidays": {k: f"{k}: {v}" for k, v in HOLIDAYS.items()},
}


def lookup(arg: str) -> tuple[str, tuple[str, str]]:
    """``(text, (table, key))`` of ``TABLE`` (all its rows, or its keys when it is long) or
    ``TABLE, KEY`` (one row)."""
    table, _, key = (p.strip() for p in arg.partition(","))
    rows = TABLES.get(table.lower())
    if rows is None:
        raise ActionError(f"unknown table {table[:30]!r} (tables: {', '.join(TABLES)})")
    if not key:
        if table.lower() in ("rates", "holidays", "offices"):
            return f"{table.lower()}: " + "; ".join(rows.values()), (table.lower(), "")
        return f"{table.lower()} ({len(rows)} rows): {', '.join(rows)}. Use `lookup: {table.lower()}, KEY`.", \
            (table.lower(), "")
    match = {k.lower(): k for k in rows}.get(" ".join(key.lower().split()))
    if match is None:
        raise ActionError(f"no row {key[:40]!r} in {table.lower()} (keys: {', '.join(rows)})")
    return rows[match], (table.lower(), match)
