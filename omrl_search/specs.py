"""Parsing of the small ``NAME[:key=value,...]`` specs used by the CLI and the API, and the
one-line errors bad input raises."""
from __future__ import annotations

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


def parse_kv(text: str, what: str = "spec") -> dict[str, Any]:
    """``"n=8,temperature=0.7"`` -> ``{"n": 8, "temperature": 0.7}``."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise SpecError(f"bad {what} {text!r}: expected key=value, got {part!r}")
        out[key.strip()] = coerce(value.strip())
    return out


def parse_spec(spec: str, what: str = "spec") -> tuple[str, dict[str, Any]]:
    """``"best_of_n:n=8"`` -> ``("best_of_n", {"n": 8})``."""
    name, _, rest = spec.partition(":")
    if not name.strip():
        raise SpecError(f"bad {what} {spec!r}: missing name")
    return name.strip(), parse_kv(rest, what)


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
