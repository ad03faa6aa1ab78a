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
