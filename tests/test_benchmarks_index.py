"""benchmarks/: every script listed in its README index, none editing sys.path."""
from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def path_edits(source: str) -> list[int]:
    """Lines that change ``sys.path`` (insert/append/extend/remove, assignment, ``+=``)."""
    def is_sys_path(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path"
                and isinstance(node.value, ast.Name) and node.value.id == "sys")

    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and is_sys_path(node.func.value)):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value))
                   for t in targets):
                lines.append(node.lineno)
    return sorted(lines)


def test_no_benchmark_edits_sys_path():
    found = {p.name: path_edits(p.read_text()) for p in BENCH.glob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_check_finds_planted_edits():
    planted = ("import sys\nsys.path.insert(0, 'x')\nsys.path.append('y')\n"
               "sys.path = ['z']\nsys.path[:0] = ['w']\nsys.path += ['v']\nprint(sys.path[0])\n")
    assert path_edits(planted) == [2, 3, 4, 5, 6]


def test_the_index_lists_exactly_the_scripts_there_are():
    text = (BENCH / "README.md").read_text()
    listed = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `")}
    assert listed == {p.name for p in BENCH.glob("*.py")}
