"""Search strategies, one file per algorithm; each is listed in ``pyproject.toml`` as an
``omrl_search.strategies`` entry point and imported only when it is used (docs/design.md §7)."""
