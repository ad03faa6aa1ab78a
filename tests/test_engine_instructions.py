"""``benchmarks/engine_instructions.py``: its stretch bookkeeping, and (slow, with valgrind) a run."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT, load_script

SCRIPT = ROOT / "benchmarks" / "engine_instructions.py"


def test_the_meter_names_stretches_in_order_and_dumps_read_in_numeric_order(tmp_path):
    ei = load_script("benchmarks/engine_instructions.py")
    calls = []

    class Lib:
        def meter_start(self):
            calls.append("start")

        def meter_stop(self):
            calls.append("stop")

    meter = ei.Meter(Lib())
    meter.names = ["search", "env", "policy"]
    t0 = meter()
    t1 = meter()
    meter(), meter()
    assert t1 - t0 > 0  # code that divides by a stretch's length does not fail
    assert calls == ["start", "stop", "start", "stop"] and meter.stretches == ["search", "env"]
    for i, count in ((1, 500), (2, 70), (10, 9)):  # cg.out.10 comes after cg.out.2
        (tmp_path / f"cg.out.{i}").write_text(f"version: 1\ncmd: x\nsummary: {count}\n")
    (tmp_path / "cg.out").write_text("summary: 1\n")  # the dump at exit is not a stretch
    assert ei.dumps(tmp_path) == [500, 70, 9]


def test_parts_switch_collection_on_inside_a_part_and_off_inside_the_env_and_count_their_calls():
    ei = load_script("benchmarks/engine_instructions.py")
    toggles = []

    class Lib:
        def meter_toggle(self):
            toggles.append("toggle")

    switch = ei.Switch(Lib())
    env_step = switch.wrap(lambda: "stepped", False)
    inner = switch.wrap(lambda: env_step(), True)  # a part's method called inside the part
    part = switch.wrap(lambda: [env_step(), inner()][1], True)
    assert env_step() == "stepped" and toggles == [] and switch.calls == {"on": 0, "off": 0, "same": 0}
    assert part() == "stepped" and not switch.on
    # on; off and on around the env call; the nested part method adds no switch; off and on; off
    assert len(toggles) == 6 and switch.calls == {"on": 1, "off": 2, "same": 1}
    cost = ei.Switch.costs([100, 100 + 2000 * 50, 5000, 5000 + 2000 * 30, 5000 + 2000 * 7])
    assert cost == {"base": 100, "on": 50.0, "off": 30.0, "same": 7.0}
    assert ei.Switch.net(1000, switch.calls, cost) == 1000 - 100 - 50 - 2 * 30 - 7


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("cc") is None,
                    reason="needs valgrind and a C compiler")
def test_a_run_counts_search_env_and_policy_apart():
    done = subprocess.run([sys.executable, str(SCRIPT), "--kinds", "beam", "--tasks", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    ours = next(r for r in rows if r["side"] == "omrl-search")
    assert ours["nodes"] > 0
    assert 0 < ours["env_instructions"] < ours["search_instructions"]
    assert 0 < ours["policy_instructions"] < ours["search_instructions"]
    assert ours["engine_instructions"] == (ours["search_instructions"] - ours["env_instructions"]
                                           - ours["policy_instructions"]) > 0


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("cc") is None,
                    reason="needs valgrind and a C compiler")
def test_parts_split_our_count_by_part():
    done = subprocess.run([sys.executable, str(SCRIPT), "--kinds", "beam", "--tasks", "2", "--parts"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    parts = {r["part"]: r for r in out["parts"]}
    assert list(parts) == ["children", "requests", "strategy", "start, result", "driver"]
    assert all(r["instructions"] > 0 for r in parts.values())
    total = out["rows"][0]["engine_instructions"]
    assert 0.8 * total < sum(r["instructions"] for r in parts.values()) < 1.25 * total
