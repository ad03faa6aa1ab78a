"""benchmarks/anytime_curve.py: one bench run at the largest budget read as a tokens -> success
curve (a task counts at budget B when its first success came within B tokens)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "anytime_curve.py"


def _row(strategy, task, success, tokens):
    return {"strategy": strategy, "budget": "tokens=20000", "task_id": task, "success": success,
            "spent": {"tokens": tokens}}


def _run(tmp_path, rows, *args):
    (tmp_path / "outcomes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), *args], capture_output=True,
                          text=True, cwd=tmp_path)


def test_each_budget_counts_the_tasks_solved_within_it(tmp_path):
    rows = [_row("mcts", "a", True, 900), _row("mcts", "b", True, 4000), _row("mcts", "c", False, 20100),
            _row("mcts", "d", True, 5001), _row("react", "a", False, 300), _row("react", "b", False, 310),
            _row("react", "c", True, 280), _row("react", "d", False, 305)]
    out = tmp_path / "curve.json"
    done = _run(tmp_path, rows, "--strategy", "mcts", "--baseline", "react", "--budgets", "5000,1000,20000",
                "--out", str(out))
    assert done.returncode == 0, done.stderr
    points = json.loads(out.read_text())["points"]
    assert [(p["tokens"], p["successes"]) for p in points] == [(None, 1), (1000, 1), (5000, 2), (20000, 3)]
    assert points[1]["tokens_per_task"] == 1000 * 3 // 4 + 900 // 4  # unsolved tasks spend the budget
    assert points[3]["vs_baseline"]["b_only"] == 3 and points[3]["vs_baseline"]["a_only"] == 1
    assert 0 < points[2]["ci_low"] < 0.5 < points[2]["ci_high"] < 1


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    done = _run(tmp_path, [_row("mcts", "a", True, 10)], "--strategy", "beam", "--budgets", "10")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "'beam'" in done.stderr
    (tmp_path / "outcomes.jsonl").write_text("{not json\n")
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--strategy", "mcts", "--budgets", "1"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "outcomes.jsonl:1:" in done.stderr


def test_versus_sets_another_run_against_the_curve_at_its_budget(tmp_path):
    rows = [_row("mcts", "a", True, 900), _row("mcts", "b", True, 4000), _row("mcts", "c", False, 20100),
            _row("mcts", "d", True, 2999)]
    other = tmp_path / "other"
    other.mkdir()
    theirs = [{"strategy": "mcts", "budget": "tokens=3000", "task_id": t, "success": ok,
               "spent": {"tokens": tok, "rm_tokens": rm}}
              for t, ok, tok, rm in [("a", True, 800, 100), ("b", True, 2900, 300), ("c", True, 3000, 500),
                                     ("d", False, 3000, 700), ("e", True, 10, 1)]]
    (other / "outcomes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in theirs))
    out = tmp_path / "curve.json"
    done = _run(tmp_path, rows, "--strategy", "mcts", "--budgets", "3000", "--versus", str(other), "--out", str(out))
    assert done.returncode == 0, done.stderr
    v = json.loads(out.read_text())["versus"]
    # at 3000 tokens this run solved a and d; the other a, b and c (e is not in this run)
    assert v["tokens"] == 3000 and v["this"]["successes"] == 2 and v["other"]["successes"] == 3
    assert (v["mcnemar"]["tasks"], v["mcnemar"]["b_only"], v["mcnemar"]["a_only"]) == (4, 2, 1)
    assert v["other_tokens_per_task"] == round((800 + 2900 + 3000 + 3000) / 4)
    assert v["other_rm_tokens_per_task"] == 400
    (other / "outcomes.jsonl").write_text(json.dumps({**theirs[0], "budget": "env_steps=9"}) + "\n")
    done = _run(tmp_path, rows, "--strategy", "mcts", "--budgets", "3000", "--versus", str(other))
    assert done.returncode == 2 and "one token budget" in done.stderr and len(done.stderr.strip().splitlines()) == 1
