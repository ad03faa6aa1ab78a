"""Test doubles shared by several test files."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from omrl_search.backends.scripted import OraclePolicy

ROOT = Path(__file__).resolve().parent.parent


def load_script(relative: str, name: str | None = None) -> ModuleType:
    """A script that is not a package module (``benchmarks/...``, ``examples/...``), loaded
    from its path under the repository root."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Recording(OraclePolicy):
    """The oracle, recording every batch it is asked for."""

    def __init__(self, p=0.3):
        super().__init__(p)
        self.batches = []

    def generate(self, requests):
        self.batches.append(requests)
        return super().generate(requests)


class PartlyCached(OraclePolicy):
    """The oracle, reporting ``prompt_tokens // divisor`` of every prompt as served by a prefix
    cache (``Generation.cached_tokens``)."""

    def __init__(self, p=0.3, divisor=2):
        super().__init__(p)
        self.divisor = divisor

    def generate(self, requests):
        out = super().generate(requests)
        for gs in out:
            for g in gs:
                g.cached_tokens = g.prompt_tokens // self.divisor
        return out


def fake_ctx(**fields):
    """A stand-in for a search's context with the per-search fields strategies and value
    sources share (:class:`omrl_search.ops.SearchContext`), empty, plus ``fields``."""
    from types import SimpleNamespace

    base = dict(values={}, rollout_leaves={}, value_caches={}, text_keys=None, answer=None,
                state=None, scratch={})
    return SimpleNamespace(**{**base, **fields})
