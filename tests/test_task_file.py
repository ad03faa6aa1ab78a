"""benchmarks/task_file.py: a task file of chosen levels that loads back and leaves out the dev slice."""
import json
import subprocess
import sys
from pathlib import Path

from envs.countdown import CountdownEnv

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "task_file.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT)


def test_levels_counts_and_no_dev_slice(tmp_path):
    out = tmp_path / "tasks.jsonl"
    r = run("--env", "countdown", "--split", "train", "--level", "1:5", "--level", "2:3",
            "--skip-last", "100", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["level"] for row in rows] == [1] * 5 + [2] * 3
    train = CountdownEnv.tasks("train")
    dev = {(tuple(t.data["numbers"]), t.data["target"]) for t in train[-100:]}
    assert not dev & {(tuple(row["numbers"]), row["target"]) for row in rows}
    loaded = CountdownEnv.load_tasks(out)
    first = [t for t in train[:-100] if t.data["level"] == 1][:5]
    assert [t.task_id for t in loaded[:5]] == [t.task_id for t in first]
    assert [t.data["numbers"] for t in loaded[:5]] == [t.data["numbers"] for t in first]


def test_bad_level_spec_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "tasks.jsonl"
    r = run("--env", "countdown", "--level", "one", "--out", str(out))
    assert r.returncode != 0 and "LEVEL:COUNT" in r.stderr and not out.exists()
