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
