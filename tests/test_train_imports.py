"""train/ has no import cycle: every import between its modules, lazy ones (inside functions)
and type-only ones included, runs one way (docs/design.md: stages and report depend on the
loop's settings and records, not the other way round; runtime and distributed share
checkpoint_files instead of importing each other)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

TRAIN = Path(__file__).resolve().parent.parent / "train"


def edges(folder: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports anywhere in its file."""
    names = {p.stem for p in folder.glob("*.py")}
    out: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:  # from .x import y / from . import x
                    mods = [node.module] if node.module else [a.name for a in node.names]
                elif node.module and node.module.startswith(f"{folder.name}."):
                    mods = [node.module.split(".")[1]]
                else:
                    continue
                found |= {m.split(".")[0] for m in mods if m.split(".")[0] in names}
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names
                          if a.name.startswith(f"{folder.name}.") and a.name.split(".")[1] in names}
        out[path.stem] = found - {path.stem, "__init__"}
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk (each reported once, from its first module)."""
    found, state = [], {}

    def walk(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = "done"

    for start in sorted(graph):
        if start not in state:
            walk(start, [start])
    return found


def test_train_has_no_import_cycle():
    assert cycles(edges(TRAIN)) == []


def test_the_check_finds_a_planted_cycle(tmp_path):
    pkg = tmp_path / "train"
    pkg.mkdir()
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from train.a import y\n")  # lazy, absolute
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    assert cycles(edges(pkg)) == [["a", "b", "a"]]
    (pkg / "a.py").write_text("x = 1\n")
    assert cycles(edges(pkg)) == []


@pytest.mark.parametrize("name", ["LoopConfig", "run_loop"])
def test_the_loop_keeps_its_public_names(name):
    import train.loop

    assert hasattr(train.loop, name)
