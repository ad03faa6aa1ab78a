"""Write a task file (JSONL, what ``omrl bench --file`` reads) from an env's built-in split:
the first N tasks of chosen levels, leaving out the split's last ``--skip-last`` tasks (the
loop's dev slice is the train split's last ``dev_limit`` tasks, so training data never touches
the puzzles keep-best decides on).

    python benchmarks/task_file.py --env countdown --split train --level 1:120 --level 2:120 \\
        --skip-last 100 --out runs/ei/tasks.jsonl

A row is the task's id, split and data; the file is read back through the env's own
``load_tasks`` before it is written, so a file this writes always loads.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def level_counts(specs: list[str]) -> dict[int, int]:
    """``["1:120", "2:120"]`` -> ``{1: 120, 2: 120}``; one clear error for a bad spec."""
    out = {}
    for spec in specs:
        level, sep, count = spec.partition(":")
        if not (sep and level.isdigit() and count.isdigit()):
            raise SystemExit(f"task_file: --level takes LEVEL:COUNT, e.g. 1:120 (got {spec!r})")
        out[int(level)] = int(count)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", required=True)
    ap.add_argument("--split", default="train")
    ap.add_argument("--level", action="append", default=[], metavar="LEVEL:COUNT",
                    help="the first COUNT tasks whose data has this level (repeatable; none: all)")
    ap.add_argument("--skip-last", type=int, default=0, help="leave out the split's last N tasks")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from omrl_search.env import env_class

    cls = env_class(args.env)
    tasks = cls.tasks(args.split)
    pool = tasks[:len(tasks) - args.skip_last] if args.skip_last else tasks
    counts = level_counts(args.level)
    chosen = list(pool) if not counts else [
        t for level, n in sorted(counts.items()) for t in [t for t in pool if t.data.get("level") == level][:n]]
    for level, n in counts.items():
        got = sum(t.data.get("level") == level for t in chosen)
        if got < n:
            print(f"task_file: level {level} has {got} tasks, not {n}", file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".jsonl")
    with os.fdopen(fd, "w") as f:
        for t in chosen:
            f.write(json.dumps({"task_id": t.task_id, "split": t.split, **t.data}) + "\n")
    back = cls.load_tasks(tmp)  # raises file:line: reason on a row the env cannot read
    if [t.task_id for t in back] != [t.task_id for t in chosen]:
        os.unlink(tmp)
        raise SystemExit(f"task_file: {args.env} did not read the rows back as written")
    os.replace(tmp, out)
    print(f"wrote {len(chosen)} tasks to {out}")


if __name__ == "__main__":
    main()
