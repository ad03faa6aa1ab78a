"""train/task_file.py (``python -m train.task_file``): a task file of chosen levels that loads back and leaves out the dev slice."""
import json
import subprocess
import sys
from pathlib import Path

from envs.countdown import CountdownEnv

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    return subprocess.run([sys.executable, "-m", "train.task_file", *args], capture_output=True, text=True, cwd=ROOT)


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


def test_knob_stream_leaves_out_dev_slice_and_earlier_file_by_puzzle(tmp_path):
    # the level=1 stream is seeded apart from the plain split, so it can repeat a dev-slice
    # puzzle under the same data; --exclude-last and --exclude-file drop those by puzzle
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    r = run("--env", "countdown", "--split", "train:level=1", "--level", "1:60",
            "--exclude-last", "train:100", "--out", str(first))
    assert r.returncode == 0, r.stderr
    r = run("--env", "countdown", "--split", "train:level=1", "--level", "1:60",
            "--exclude-last", "train:100", "--exclude-file", str(first), "--out", str(second))
    assert r.returncode == 0, r.stderr

    def puzzles(path):
        return [(tuple(row["numbers"]), row["target"]) for row in map(json.loads, path.read_text().splitlines())]

    a, b = puzzles(first), puzzles(second)
    assert len(a) == len(b) == 60 and not set(a) & set(b)
    dev = {(tuple(t.data["numbers"]), t.data["target"]) for t in CountdownEnv.tasks("train")[-100:]}
    stream = [(tuple(t.data["numbers"]), t.data["target"]) for t in CountdownEnv.tasks("train:level=1")]
    kept = [p for p in stream if p not in dev]
    assert a == kept[:60] and b == kept[60:120]
    assert dev & set(stream[:120]), "the first 120 share no puzzle with the dev slice: the exclusion is untested"


def test_bad_exclude_spec_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "tasks.jsonl"
    r = run("--env", "countdown", "--exclude-last", "train", "--out", str(out))
    assert r.returncode != 0 and "SPLIT:N" in r.stderr and not out.exists()
    r = run("--env", "countdown", "--exclude-file", str(tmp_path / "missing.jsonl"), "--out", str(out))
    assert r.returncode != 0 and "missing.jsonl" in r.stderr and not out.exists()
