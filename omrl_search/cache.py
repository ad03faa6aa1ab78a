"""Where omrl-search keeps what it builds once and reuses: the converted SmolLM2 folder,
generated TextWorld games, ScienceWorld's task catalogue."""
from __future__ import annotations

import os


def cache_root() -> str:
    """``$OMRL_CACHE`` or ``~/.cache/omrl-search``."""
    return os.path.expanduser(os.environ.get("OMRL_CACHE") or "~/.cache/omrl-search")
