"""benchmarks/bon_selection.py: best-of-N's selection rules replayed on the same saved chains
agree with what the searches themselves chose, and bad input is one line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import omrl_search as om

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bon_selection.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_rules_on_the_saved_chains_match_the_searches_own_choices(tmp_path):
    tasks = om.load_tasks("game24", "test", limit=12)
    kw = dict(policy="scripted:oracle:p=0.6", seed=3)
    by_rm = om.search_many(tasks, strategy="best_of_n:n=4,select_by=rm", reward_model="rules:outcome=1", **kw)
    by_vote = om.search_many(tasks, strategy="best_of_n:n=4,select_by=vote", **kw)
    om.write_results(tmp_path / "trees.jsonl", by_rm)
    done = _run(tmp_path / "trees.jsonl")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    rules = out["rules"]
    assert out["tasks"] == 12 and out["chains_per_task"] == 4
    # the rm rule is what the rm search returned; vote what the same chains' vote search returned
    assert rules["rm"]["successes"] == sum(r.success for r in by_rm)
    assert rules["vote"]["successes"] == sum(r.success for r in by_vote)
    # an outcome rule scores solved chains highest: the rm rule reaches pass@N; some task is
    # solved by some chain but not by the vote, else the check below could not tell them apart
    assert rules["rm"]["successes"] == rules["pass@n"]["successes"] > rules["vote"]["successes"]
    vs = rules["rm"]["vs_vote"]
    assert vs["a_only"] == 0 and vs["b_only"] == rules["rm"]["successes"] - rules["vote"]["successes"]


def test_a_reward_model_given_rescores_the_same_chains(tmp_path):
    """Chains saved without useful scores (a format rule scores every chain alike), rescored by
    the outcome rule: the rm rule then reaches pass@N, as when the search used that rule."""
    tasks = om.load_tasks("game24", "test", limit=12)
    om.write_results(tmp_path / "trees.jsonl", om.search_many(
        tasks, strategy="best_of_n:n=4,select_by=rm", reward_model="rules:format=1",
        policy="scripted:oracle:p=0.6", seed=3))
    plain = json.loads(_run(tmp_path / "trees.jsonl").stdout.strip().splitlines()[-1])["rules"]
    done = _run(tmp_path / "trees.jsonl", "--reward-model", "rules:outcome=1")
    assert done.returncode == 0, done.stderr
    rescored = json.loads(done.stdout.strip().splitlines()[-1])["rules"]
    assert rescored["rm"]["successes"] == rescored["pass@n"]["successes"] > plain["rm"]["successes"]
    assert rescored["vote"] == plain["vote"]


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    tasks = om.load_tasks("game24", "test", limit=2)
    om.write_results(tmp_path / "vote.jsonl", om.search_many(
        tasks, strategy="best_of_n:n=2,select_by=vote", policy="scripted:oracle:p=0.5", seed=0))
    done = _run(tmp_path / "vote.jsonl")  # chains without reward-model scores
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "score" in done.stderr
    done = _run(tmp_path / "nope.jsonl")
    assert done.returncode == 2 and "nope.jsonl" in done.stderr
