"""Test doubles shared by several test files."""
from __future__ import annotations

from omrl_search.backends.scripted import OraclePolicy


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
