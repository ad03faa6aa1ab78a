"""benchmarks/dev_slice_power.py: how often a dev slice of n tasks sees the difference two
checkpoints showed on held-out tasks (simulated from their discordant rates)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "dev_slice_power.py"


def _run(*args, cwd=None):
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd)
    return done, (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None)


def test_clear_differences_are_seen_and_none_is_never_seen():
    _, better = _run("--counts", "50,0,100", "--sizes", "100", "--sims", "300")
    assert better["sizes"]["100"] == {"higher": 1.0, "significant": 1.0, "rejected": 0.0}
    _, worse = _run("--counts", "0,50,100", "--sizes", "100", "--sims", "300")
    assert worse["sizes"]["100"] == {"higher": 0.0, "significant": 0.0, "rejected": 1.0}
    _, same = _run("--counts", "0,0,100", "--sizes", "100", "--sims", "300")
    assert same["sizes"]["100"] == {"higher": 0.0, "significant": 0.0, "rejected": 0.0}


def test_power_grows_with_the_slice_and_is_seeded():
    done, small_gain = _run("--counts", "20,5,200", "--sizes", "50,100,300", "--sims", "1000")
    s = small_gain["sizes"]
    assert s["50"]["significant"] < s["100"]["significant"] < s["300"]["significant"]
    assert 0.3 < s["100"]["significant"] < 0.65 and s["300"]["significant"] > 0.9  # McNemar at these rates
    assert "(+7.5 points)" in done.stdout
    assert _run("--counts", "20,5,200", "--sizes", "50,100,300", "--sims", "1000")[1] == small_gain


def test_outcome_files_give_the_discordant_counts(tmp_path):
    def write(name, solved):
        rows = [{"strategy": "react", "budget": "tokens=2000", "task_id": f"t{i}", "success": i in solved,
                 "spent": {"tokens": 10}} for i in range(20)]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    write("a.jsonl", {0, 1, 2, 3})
    write("b.jsonl", {2, 3, 4, 5, 6})
    _, out = _run(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--sizes", "10", "--sims", "50")
    assert (out["b_only"], out["a_only"], out["tasks"]) == (3, 2, 20)


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    for args in (["--counts", "5,300,200"], ["only-one-file"], [str(tmp_path / "missing.jsonl"), "x"]):
        done, _ = _run(*args)
        assert done.returncode == 2
        assert len(done.stderr.strip().splitlines()) == 1 and "dev_slice_power: error" in done.stderr
