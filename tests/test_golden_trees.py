"""Every strategy still grows the same seeded trees (tests/golden_runs.py says which runs and how a
digest is taken; tests/data/golden_trees.json holds the digests)."""
from __future__ import annotations

import json

import pytest

from golden_runs import GOLDEN, run_one, runs

_WANT = json.loads(GOLDEN.read_text())
_RUNS = runs()


def test_every_golden_run_has_a_digest():
    assert sorted(_WANT) == sorted(name for name, _ in _RUNS)


@pytest.mark.parametrize("name,kw", _RUNS, ids=[n for n, _ in _RUNS])
def test_seeded_trees_are_unchanged(name, kw):
    assert run_one(**kw) == _WANT[name]
