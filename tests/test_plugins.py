"""Plugins through entry points (docs/design.md §7): the packages under ``examples/`` installed
with pip add an env, a strategy and a policy backend that ``omrl search`` then uses; a broken
plugin is one error line naming it and hides no other; commands load only when run."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from omrl_search import env as env_module
from omrl_search import plugins
from omrl_search.env import Env, env_class, list_envs, register_env
from omrl_search.plugins import PluginError, Registry

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("env_plugin", "strategy_plugin", "backend_plugin")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The three example packages pip-installed into one folder (copies, so the build leaves
    nothing in the repository), plus a fake distribution with broken entry points."""
    work = tmp_path_factory.mktemp("plugins")
    target = work / "site"
    copies = [shutil.copytree(ROOT / "examples" / name, work / name) for name in EXAMPLES]
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--no-build-isolation", "--no-compile", "--target", str(target),
                           *map(str, copies)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    broken = target / "omrl_broken_plugins-0.1.dist-info"
    broken.mkdir()
    (broken / "METADATA").write_text("Metadata-Version: 2.1\nName: omrl-broken-plugins\nVersion: 0.1\n")
    (broken / "entry_points.txt").write_text(
        "[omrl_search.envs]\nghost = no_such_module_xyz:GhostEnv\nnotenv = json:dumps\n\n"
        "[omrl_search.commands]\nbroken = no_such_module_xyz.cmd\n\n"
        "[omrl_search.env_servers]\nfake = omrl_fake_server:factory\n")
    (target / "omrl_fake_server.py").write_text(
        "import sys\n"
        "from omrl_search.env import make_env\n"
        "class Factory:\n"
        "    max_envs = 1\n"
        "    def __call__(self, name):\n"
        "        return make_env(name)\n"
        "def factory(url, env):\n"
        "    print(f'fake env server {url} for {env}', file=sys.stderr)\n"
        "    return Factory()\n")
    return target


def omrl(site: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-m", "omrl_search.cli", *argv], capture_output=True,
                          text=True, env=env, cwd=site, timeout=120)


def results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_env_plugin_is_listed_and_solved_by_the_oracle(site, tmp_path):
    assert "walk" in omrl(site, "envs").stdout.split()
    out = tmp_path / "walk"
    proc = omrl(site, "search", "--env", "walk", "--policy", "scripted:oracle:p=0", "--no-progress",
                "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())["react"]
    assert (summary["tasks"], summary["successes"]) == (22, 22)  # the odd goals -21..21
    for r in results(out):
        goal = r["task"]["data"]["goal"]
        actions = [n["step"]["action"] for n in r["tree"]["nodes"] if n.get("step")]
        assert actions == ["right" if goal > 0 else "left"] * abs(goal)


def test_env_plugin_passes_the_shared_env_property_test(tmp_path):
    """The recipe's promise: a plugin env is held to the same contract as the bundled ones
    (installed alone: the shared site also holds deliberately broken entry points)."""
    copy = shutil.copytree(ROOT / "examples" / "env_plugin", tmp_path / "env_plugin")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--no-build-isolation", "--no-compile", "--target", str(tmp_path / "site"),
                           str(copy)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "test_env_contract.py"), "-k", "walk"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_strategy_plugin_retries_invalid_steps(site, tmp_path):
    out = tmp_path / "retry"
    proc = omrl(site, "search", "--env", "walk", "--split", "train", "--strategy", "retry:retries=3",
                "--policy", "scripted:oracle:p=0,malformed=0.5", "--seed", "1", "--no-progress",
                "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    retried = 0
    for r in results(out):
        assert r["strategy"].startswith("retry:retries=3")
        nodes = r["tree"]["nodes"]
        kids: dict[int, list[dict]] = {}
        for n in nodes[1:]:
            kids.setdefault(n["parent"], []).append(n)
        for siblings in kids.values():  # a chain: only invalid steps are tried again, at most 3 times
            assert 1 <= len(siblings) <= 4
            assert all(not s["step"]["valid"] for s in siblings[:-1])
            retried += len(siblings) > 1
    assert retried > 0  # malformed=0.5 made some steps invalid, and they were retried
    assert json.loads((out / "summary.json").read_text())["retry"]["successes"] >= 1


def test_backend_plugin_gives_its_own_text(site, tmp_path):
    assert "constant" in omrl(site, "policies").stdout.split()
    out = tmp_path / "constant"
    proc = omrl(site, "search", "--env", "walk", "--policy", "constant:right", "--no-progress",
                "--limit", "13", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    by_goal = {r["task"]["data"]["goal"]: r for r in results(out)}
    assert {g: r["success"] for g, r in by_goal.items()} == {g: g > 0 for g in range(-21, 5, 2)}
    steps = [n["step"] for n in by_goal[3]["tree"]["nodes"] if n.get("step")]
    assert [s["completion"] for s in steps] == ["Think: I always do the same.\nAct: right"] * 3
    bad = omrl(site, "search", "--env", "walk", "--policy", "constant:", "--no-progress")
    assert bad.returncode == 2 and bad.stderr.strip() == "omrl: error: constant: give the action, e.g. constant:right"


def test_a_broken_plugin_is_one_line_and_hides_no_other(site):
    proc = omrl(site, "search", "--env", "ghost", "--no-progress")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert ("plugin 'ghost' (omrl_search.envs: ghost = no_such_module_xyz:GhostEnv "
            "(omrl-broken-plugins 0.1)) failed to load: ModuleNotFoundError") in proc.stderr
    proc = omrl(site, "search", "--env", "notenv", "--no-progress")
    assert proc.returncode == 2 and "is not an Env subclass" in proc.stderr
    assert {"ghost", "notenv", "walk", "game24"} <= set(omrl(site, "envs").stdout.split())
    ok = omrl(site, "search", "--env", "walk", "--policy", "scripted:oracle:p=0", "--no-progress")
    assert ok.returncode == 0 and "react" in ok.stdout
    # a broken command: named when run; `omrl --help` warns in one line and lists the others
    proc = omrl(site, "broken")
    assert proc.returncode == 2 and "plugin 'broken' (omrl_search.commands: broken" in proc.stderr
    proc = omrl(site, "--help")
    assert proc.returncode == 0 and "bench" in proc.stdout and "train" in proc.stdout
    assert proc.stderr.count("omrl: warning: plugin 'broken'") == 1


def test_env_server_plugins_are_found_by_url_scheme(site):
    proc = omrl(site, "search", "--env", "game24", "--limit", "2", "--env-server", "fake+x://nowhere",
                "--policy", "scripted:oracle:p=0", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "fake env server fake+x://nowhere for game24" in proc.stderr and "react" in proc.stdout
    proc = omrl(site, "search", "--env", "game24", "--env-server", "gopher://h:70", "--no-progress")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "no env-server plugin for its scheme (known: agentgym://, fake://, http://" in proc.stderr


def test_only_the_command_run_is_imported():
    code = ("import sys; from omrl_search.cli import main; main(['report', '--help'])")
    proc = subprocess.run([sys.executable, "-c", code + "\n", ], capture_output=True, text=True)
    assert "usage: omrl report" in proc.stdout
    code = ("import sys\nfrom omrl_search.cli import main\n"
            "try:\n    main(['export', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('train', 'envs', 'reward_models', 'torch') or m == 'omrl_search.bench'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr


def test_registry_prefers_code_then_entry_points_and_checks_the_kind():
    try:
        @register_env("zz_throwaway")
        class Throwaway(Env):  # abstract methods are never called here
            pass

        assert env_class("zz_throwaway") is Throwaway and "zz_throwaway" in list_envs()
    finally:
        env_module._ENVS.registered.pop("zz_throwaway", None)  # other tests list every env
    assert "zz_throwaway" not in list_envs()
    assert env_class("game24").name == "game24"  # loaded from its entry point
    reg = Registry("omrl_search.envs", "an int", lambda obj: isinstance(obj, int))
    try:
        with pytest.raises(PluginError, match=r"plugin 'game24' \(omrl_search.envs: game24 = "
                                              r"envs.game24:Game24Env .*\) is not an int"):
            reg.get("game24")
        assert reg.get("no-such-env") is None
    finally:
        Registry.all.remove(reg)
    assert "game24" in plugins.names("omrl_search.envs")
