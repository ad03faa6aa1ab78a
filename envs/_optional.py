"""Optional dependencies of the bundled envs: imported on first use, one clear error when missing.

Env modules are imported whenever :mod:`envs` is (to register them), so they never import
TextWorld, minigrid and friends at their top level; they call :func:`require` where they need one.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from omrl_search.env import EnvError

EXTRA = "pip install 'omrl-search[envs]'"


class MissingPackage(EnvError, ImportError):
    """An env's optional dependency is not installed."""


def require(module: str, env: str) -> Any:
    """Import ``module`` for env ``env`` or raise :class:`MissingPackage` naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = exc.name or module.split(".")[0]
        raise MissingPackage(f"env {env!r} needs {missing!r}: {EXTRA}") from None


def check(module: str, env: str) -> None:
    """Fail early (without importing it) when ``module`` is not installed."""
    if importlib.util.find_spec(module) is None:
        raise MissingPackage(f"env {env!r} needs {module!r}: {EXTRA}")
