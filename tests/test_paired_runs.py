"""python -m omrl_search.paired_runs: two bench runs paired task by task."""
from __future__ import annotations

import json
import subprocess
import sys


def _outcomes(path, wins, strategy="mcts", budget="tokens=100"):
    path.write_text("".join(json.dumps({"strategy": strategy, "budget": budget, "task_id": f"t{i}",
                                        "success": w, "spent": {"tokens": 10}}) + "\n"
                            for i, w in enumerate(wins)))
    return path


def test_pairs_two_runs_on_their_shared_tasks(tmp_path):
    a = _outcomes(tmp_path / "a.jsonl", [0, 0, 0, 0, 0, 0, 0, 1])
    b = _outcomes(tmp_path / "b.jsonl", [1, 1, 1, 1, 1, 1, 1, 1])
    out = subprocess.run([sys.executable, "-m", "omrl_search.paired_runs", f"{a}:mcts", str(b)],
                         capture_output=True, text=True, check=True).stdout
    last = json.loads(out.strip().splitlines()[-1])
    assert [r["successes"] for r in last["runs"]] == [1, 8]
    assert last["paired"]["tasks"] == 8 and last["paired"]["b_only"] == 7
    assert abs(last["paired"]["p_value"] - 2 / 2 ** 7) < 1e-4  # exact McNemar: 7 discordant, one way


def test_an_ambiguous_run_names_its_choices(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text(_outcomes(tmp_path / "x", [1]).read_text()
                 + _outcomes(tmp_path / "y", [0], strategy="react").read_text())
    r = subprocess.run([sys.executable, "-m", "omrl_search.paired_runs", str(a), str(a)],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "name one of mcts@tokens=100, react@tokens=100" in r.stderr
