"""Parsing of the small ``NAME[:key=value,...]`` specs used by the CLI and the API, and the
one-line errors bad input raises."""
from __future__ import annotations

import math
import types
import typing
from typing import Any


class SpecError(ValueError):
    """A spec string is malformed; the message names the spec and what is wrong."""


def coerce(text: str) -> Any:
    """Turn a spec value into bool, int, float or leave it a string."""
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_kv(text: str, what: str = "spec", raw: bool = False) -> dict[str, Any]:
    """``"n=8,temperature=0.7"`` -> ``{"n": 8, "temperature": 0.7}`` (``raw``: values left as
    the strings given, for :func:`convert` to type by the field they set)."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise SpecError(f"bad {what} {text!r}: expected key=value, got {part!r}")
        out[key.strip()] = value.strip() if raw else coerce(value.strip())
    return out


def parse_spec(spec: str, what: str = "spec", raw: bool = False) -> tuple[str, dict[str, Any]]:
    """``"best_of_n:n=8"`` -> ``("best_of_n", {"n": 8})``."""
    name, _, rest = spec.partition(":")
    if not name.strip():
        raise SpecError(f"bad {what} {spec!r}: missing name")
    return name.strip(), parse_kv(rest, what, raw)


_NONE = ("none", "null")
_BOOLS = {"true": True, "yes": True, "on": True, "1": True,
          "false": False, "no": False, "off": False, "0": False}
_NAMES = {bool: "a bool (true/false)", int: "an int", float: "a number", str: "a string"}


def convert(text: str, annotation: Any, what: str) -> Any:
    """``text`` as the type a dataclass field is annotated with (int, float, bool, str, an
    ``X | None``, a ``Literal``; anything else as :func:`coerce` reads it). A value that does not
    fit raises one line naming ``what`` and the expected type: ``width must be an int, got 'abc'``."""
    value = _convert(text, annotation)
    if value is _BAD:
        raise SpecError(f"{what} must be {_describe(annotation)}, got {text!r}")
    return value


_BAD = object()


def _convert(text: str, ann: Any) -> Any:
    if ann is Any or ann is object:
        return coerce(text)
    origin = typing.get_origin(ann)
    if origin is typing.Union or origin is types.UnionType:
        if type(None) in typing.get_args(ann) and text.lower() in _NONE:
            return None
        for arg in typing.get_args(ann):
            value = _BAD if arg is type(None) else _convert(text, arg)
            if value is not _BAD:
                return value
        return _BAD
    if origin is typing.Literal:
        for choice in typing.get_args(ann):
            if str(choice) == text or coerce(text) == choice:
                return choice
        return _BAD
    if ann is bool:
        return _BOOLS.get(text.lower(), _BAD)
    if ann is str:
        return text
    if ann is int:
        try:
            return int(text)
        except ValueError:
            pass
        try:
            f = float(text)
        except ValueError:
            return _BAD
        return int(f) if math.isfinite(f) and f.is_integer() else _BAD
    if ann is float:
        for cast in (int, float):  # an int stays an int (as it was written)
            try:
                value = cast(text)
            except ValueError:
                continue
            return value if math.isfinite(value) else _BAD
        return _BAD
    return coerce(text)


def _describe(ann: Any) -> str:
    origin = typing.get_origin(ann)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(ann)
        parts = [_describe(a) for a in args if a is not type(None)]
        return " or ".join(parts + (["none"] if type(None) in args else []))
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(ann)))
    if ann is float:
        return "a finite number"
    return _NAMES.get(ann, getattr(ann, "__name__", str(ann)))


def finite_limits(limits: dict[str, Any], what: str = "budget") -> dict[str, Any]:
    """``limits`` unchanged, after checking each number is finite: ``tokens=nan`` or ``inf``
    would otherwise run unlimited."""
    for kind, value in limits.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecError(f"{what} {kind}={value} must be a finite positive number "
                            "(leave the kind out for no limit)")
    return limits


def split_path_spec(arg: str, what: str = "options") -> tuple[str, dict[str, Any]]:
    """``"PATH"`` or ``"PATH:key=value,..."`` -> ``(PATH, options)``. A path that exists as given
    is never split (it may contain a colon)."""
    import os

    head, sep, tail = arg.rpartition(":")
    if sep and "=" in tail and not os.path.exists(arg):
        return head, parse_kv(tail, what)
    return arg, {}


class UsageError(Exception):
    """A bad argument or setting; the CLI prints it as one line and exits with status 2."""


def error_line(exc: BaseException) -> str:
    """``Type: first line of the message`` of an exception, for one-line errors."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
