"""The import rules of docs/design.md §2, read from the source with ``ast``: every ``import`` and
``from`` statement anywhere in a module (function bodies included) and every module named to
``importlib.import_module`` / ``__import__``; in the core also any string that spells a module
of an outer package (a table entry). Plus what ``import omrl_search`` and ``omrl search`` load."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUTER = {"envs", "strategies", "reward_models", "train"}
FIRST_PARTY = OUTER | {"omrl_search"}
#: package -> the first-party packages it may import (besides itself)
ALLOWED = {"omrl_search": set(), "envs": {"omrl_search"}, "strategies": {"omrl_search"},
           "reward_models": {"omrl_search"}, "train": {"omrl_search", "reward_models"}}
MODULE_STRING = re.compile(r"^(envs|strategies|reward_models|train)(\.\w+)+(:\w+)?$")


def _dynamic_name(node: ast.Call) -> str | None:
    """The module a call ``import_module("x.y")`` / ``__import__("x")`` names (an f-string's
    leading text counts: ``f"train.{kind}"`` names ``train``), else None."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value)
    return None


def imported(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, how) for every module ``path`` names: statements, dynamic imports, and
    (for the core) strings that spell an outer package's module."""
    tree = ast.parse(path.read_text(), str(path))
    core = path.relative_to(ROOT).parts[0] == "omrl_search"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, "import") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, "from-import"))
        elif isinstance(node, ast.Call) and (name := _dynamic_name(node)):
            found.append((node.lineno, name, "dynamic import"))
        elif core and isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and MODULE_STRING.match(node.value):
            found.append((node.lineno, node.value, "module string"))
    return found


def violations(package: str) -> list[str]:
    allowed = ALLOWED[package] | {package}
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module, how in imported(path):
            top = module.split(".")[0]
            if top in FIRST_PARTY and top not in allowed:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {how} of {module!r}")
    return bad


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_the_layout_allows(package):
    assert (ROOT / package / "__init__.py").exists()
    assert violations(package) == []


def test_the_checker_sees_lazy_and_dynamic_imports(tmp_path):
    """The checker itself: imports inside functions, importlib strings, f-strings and table
    entries are all caught (so the test above can fail)."""
    core = ROOT / "omrl_search"
    probe = core / "_probe_import_rules.py"
    probe.write_text("import importlib\n"
                     "def f(kind):\n"
                     "    from train import loop\n"
                     "    import envs.game24\n"
                     "    importlib.import_module('strategies.beam')\n"
                     "    __import__(f'reward_models.{kind}')\n"
                     "TABLE = {'x': 'train.cli', 'doc': 'see train.cli for the flags'}\n")
    try:
        got = {(module, how) for _, module, how in imported(probe)}
    finally:
        probe.unlink()
    assert got >= {("train", "from-import"), ("envs.game24", "import"),
                   ("strategies.beam", "dynamic import"), ("reward_models.", "dynamic import"),
                   ("train.cli", "module string")}
    assert not any("see train" in module for module, _ in got)


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_import_omrl_search_loads_no_trainer_and_no_torch():
    proc = _python("import sys, omrl_search; "
                   "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                   "('torch', 'train', 'envs', 'strategies', 'reward_models')))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_omrl_search_with_a_scripted_policy_imports_no_torch():
    proc = _python("import sys; from omrl_search.cli import main; "
                   "rc = main(['search', '--env', 'game24', '--policy', 'scripted:oracle:p=0', "
                   "'--limit', '1', '--no-progress']); "
                   "print('RC', rc, sorted(m for m in sys.modules if m.split('.')[0] in "
                   "('torch', 'train', 'reward_models', 'transformers')))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "RC 0 []"
    assert "react" in proc.stdout  # the search ran and printed its table
