"""Write a task file (JSONL, what ``omrl bench --file`` reads) from an env's built-in split:
the first N tasks of chosen levels, leaving out the split's last ``--skip-last`` tasks (the
loop's dev slice is the train split's last ``dev_limit`` tasks, so training data never touches
the puzzles keep-best decides on).

    python -m train.task_file --env countdown --split train --level 1:120 --level 2:120 \\
        --skip-last 100 --out runs/ei/tasks.jsonl

A split with knobs (``train:level=1``) is its own seeded stream, which can hold puzzles of the
plain split's dev slice: ``--exclude-last train:100`` leaves those out by puzzle (the loop's
``puzzle_key``, not the id), and ``--exclude-file`` leaves out the puzzles of an earlier task file.

    python -m train.task_file --env countdown --split train:level=1 --level 1:400 \\
        --exclude-last train:100 --exclude-file runs/ei/tasks.jsonl --out runs/ei2/tasks.jsonl

A row is the task's id, split and data; every row is read back through the env's own
``task_from_dict`` before the file is written (atomically), so a file this writes always loads.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def level_counts(specs: list[str]) -> dict[int, int]:
    """``["1:120", "2:120"]`` -> ``{1: 120, 2: 120}``; one clear error for a bad spec."""
    out = {}
    for spec in specs:
        level, sep, count = spec.partition(":")
        if not (sep and level.isdigit() and count.isdigit()):
            raise SystemExit(f"task_file: --level takes LEVEL:COUNT, e.g. 1:120 (got {spec!r})")
        out[int(level)] = int(count)
    return out


def held_tasks(cls, last: list[str], files: list[str]) -> list:
    """The tasks whose puzzles stay out: each ``SPLIT:N``'s last N tasks and each task file's."""
    from train.loop_select import dev_slice

    held = []
    for spec in last:
        split, sep, count = spec.rpartition(":")
        if not (sep and split and count.isdigit()):
            raise SystemExit(f"task_file: --exclude-last takes SPLIT:N, e.g. train:100 (got {spec!r})")
        held += dev_slice(cls.tasks(split), int(count))
    for path in files:
        try:
            held += cls.load_tasks(path)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"task_file: cannot read --exclude-file {path}: {exc}")
    return held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", required=True)
    ap.add_argument("--split", default="train")
    ap.add_argument("--level", action="append", default=[], metavar="LEVEL:COUNT",
                    help="the first COUNT tasks whose data has this level (repeatable; none: all)")
    ap.add_argument("--skip-last", type=int, default=0, help="leave out the split's last N tasks")
    ap.add_argument("--exclude-last", action="append", default=[], metavar="SPLIT:N",
                    help="leave out the puzzles of SPLIT's last N tasks (repeatable)")
    ap.add_argument("--exclude-file", action="append", default=[], metavar="PATH",
                    help="leave out the puzzles of this task file (repeatable)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from omrl_search.env import env_class
    from omrl_search.outdir import write_file_atomic
    from train.loop_select import without

    cls = env_class(args.env)
    tasks = cls.tasks(args.split)
    pool = tasks[:len(tasks) - args.skip_last] if args.skip_last else tasks
    pool = without(pool, held_tasks(cls, args.exclude_last, args.exclude_file))  # by puzzle, not id
    chosen = [] if args.level else pool
    for level, n in sorted(level_counts(args.level).items()):
        picked = [t for t in pool if t.data.get("level") == level][:n]
        if len(picked) < n:
            print(f"task_file: level {level} has {len(picked)} tasks, not {n}", file=sys.stderr)
        chosen += picked
    rows = [{"task_id": t.task_id, "split": t.split, **t.data} for t in chosen]
    for row in rows:
        try:
            same = cls.task_from_dict(row).task_id == row["task_id"]
        except (ValueError, TypeError, KeyError, NotImplementedError) as exc:
            raise SystemExit(f"task_file: {args.env} cannot read task {row['task_id']} back: {exc}")
        if not same:
            raise SystemExit(f"task_file: {args.env} read task {row['task_id']} back under another id")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(out, "".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} tasks to {out}")


if __name__ == "__main__":
    main()
