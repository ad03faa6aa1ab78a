"""Generated tasks for the ``os`` env, in the style of AgentBench OS.

Twenty families: ten *questions* about files (count lines, count files by extension, find the
largest file, sum a CSV column, the most frequent IP, ...; checked by answer equality) and ten
*file changes* (upper-case a file, fix permissions, delete temp files, rename, sort, move,
replace text, ...; checked against the expected final files). Each generator draws the files
from a seeded RNG and computes the answer or the expected files in Python, alongside the
canonical shell command that produces them (the expert's solution).

A task's split is a stable hash of its content, so train and test never share a task; each
family contributes the same number of tasks to a split, listed round-robin so any prefix mixes
families.
"""
from __future__ import annotations

import random
from collections import Counter
from functools import lru_cache
from typing import Any, Callable

from omrl_search.env import stable_hash

PER_FAMILY = {"train": 20, "test": 2}
TEST_PERCENT = 20
WORDS = (
    "apple river stone cloud maple tiger ocean pencil garden silver rocket lemon candle forest "
    "piano marble winter falcon copper meadow harbor violet thunder ember glacier canyon willow "
    "orbit velvet lantern"
).split()
CITIES = "Paris Lima Oslo Cairo Quito Seoul Dakar Perth Minsk Hanoi".split()
ASK = " Reply with `answer: <value>`."
SUBMIT = " When you are done, reply with `answer: done` (leave no temporary files behind)."

Files = dict[str, list]  # path -> [text, mode]


def _line(rng: random.Random, lo: int = 2, hi: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _text(lines: list[str]) -> str:
    return "".join(f"{line}\n" for line in lines)


def _names(rng: random.Random, k: int, suffix: str = "") -> list[str]:
    return [w + suffix for w in rng.sample(WORDS, k)]


def _question(files: Files, instruction: str, solution: str, answer: Any) -> dict:
    return {"instruction": instruction + ASK, "files": files, "solution": solution,
            "answer": str(answer)}


def _change(files: Files, instruction: str, solution: str, expected: Files) -> dict:
    return {"instruction": instruction + SUBMIT, "files": files, "solution": solution,
            "expected": expected}


def _same(files: Files) -> Files:
    """The files as expected entries whose mode is not checked."""
    return {p: [text, None] for p, (text, _) in files.items()}


# --- questions -------------------------------------------------------------------------------
def count_lines(rng):
    path, other = (f"notes/{n}.txt" for n in _names(rng, 2))
    n = rng.randint(5, 40)
    files = {path: [_text([_line(rng) for _ in range(n)]), 0o644],
             other: [_text([_line(rng) for _ in range(rng.randint(3, 9))]), 0o644]}
    return _question(files, f"How many lines does the file {path} have?", f"wc -l < {path}", n)


def count_ext(rng):
    ext = rng.choice(("py", "txt", "md", "json"))
    files = {}
    for name in _names(rng, rng.randint(8, 14)):
        folder = rng.choice(("project", "project/src", "project/docs", "project/src/util"))
        suffix = rng.choice(("py", "txt", "md", "json"))
        files[f"{folder}/{name}.{suffix}"] = [_line(rng) + "\n", 0o644]
    count = sum(p.endswith(f".{ext}") for p in files)
    return _question(files, f"How many files with the extension .{ext} are there under project/ "
                     "(in all its subdirectories)?",
                     f"find project -type f -name '*.{ext}' | wc -l", count)


def grep_count(rng):
    lines, errors = [], 0
    for i in range(rng.randint(12, 35)):
        level = rng.choice(("INFO", "INFO", "WARN", "ERROR"))
        errors += level == "ERROR"
        stamp = f"2024-03-{i // 10 + 1:02d} 10:{i:02d}:{rng.randint(0, 59):02d}"
        lines.append(f"{stamp} {level} {_line(rng)}")
    return _question({"app.log": [_text(lines), 0o644]}, "How many lines of app.log have the level "
                     "ERROR?", "grep -c ' ERROR ' app.log", errors)


def largest(rng):
    names = _names(rng, rng.randint(4, 7), ".dat")
    sizes = rng.sample(range(2, 30), len(names))  # in lines of one word: distinct byte sizes
    word = rng.choice(WORDS)
    files = {f"data/{n}": [_text([word] * s), 0o644] for n, s in zip(names, sizes)}
    return _question(files, "Which file in data/ is the largest (in bytes)? Answer with the file "
                     "name only, e.g. report.dat.", "ls -S data | head -n 1",
                     names[sizes.index(max(sizes))])


def csv_sum(rng):
    rows = [(i + 1, rng.choice(WORDS), rng.randint(1, 500)) for i in range(rng.randint(6, 20))]
    text = _text(["id,item,amount"] + [f"{i},{w},{a}" for i, w, a in rows])
    return _question({"sales.csv": [text, 0o644]}, "What is the sum of the amount column of "
                     "sales.csv?", "awk -F, 'NR > 1 {s += $3} END {print s}' sales.csv",
                     sum(a for *_, a in rows))


def top_ip(rng):
    ips = [f"10.0.{rng.randint(0, 9)}.{i}" for i in rng.sample(range(2, 250), rng.randint(3, 6))]
    counts = sorted(rng.sample(range(1, 12), len(ips)), reverse=True)
    hits = [ip for ip, c in zip(ips, counts) for _ in range(c)]
    rng.shuffle(hits)
    lines = [f'{ip} - - [01/Mar/2024:10:{i % 60:02d}:00] "GET /{rng.choice(WORDS)} HTTP/1.1" 200'
             for i, ip in enumerate(hits)]
    return _question({"access.log": [_text(lines), 0o644]}, "Which IP address appears most often "
                     "in access.log? Answer with the address only.",
                     "awk '{print $1}' access.log | sort | uniq -c | sort -rn | head -n 1 | "
                     "awk '{print $2}'", ips[0])


def distinct(rng):
    rows = [(rng.choice(WORDS), rng.choice(CITIES)) for _ in range(rng.randint(8, 20))]
    text = _text(["name,city"] + [f"{n},{c}" for n, c in rows])
    return _question({"users.csv": [text, 0o644]}, "How many different cities appear in the city "
                     "column of users.csv?", "tail -n +2 users.csv | cut -d, -f2 | sort -u | wc -l",
                     len({c for _, c in rows}))


def exec_count(rng):
    modes = [rng.choice((0o755, 0o644, 0o700, 0o600)) for _ in range(rng.randint(5, 10))]
    modes[0] = 0o755
    names = _names(rng, len(modes))
    files = {f"bin/{n}": ["#!/bin/sh\necho hi\n", m] for n, m in zip(names, modes)}
    return _question(files, "How many regular files in bin/ are executable by their owner?",
                     "find bin -type f -perm -u+x | wc -l", sum(m & 0o100 > 0 for m in modes))


def which_contains(rng):
    token = f"KEY-{rng.randint(1000, 9999)}"
    names = _names(rng, rng.randint(4, 7))
    paths = [f"notes/{rng.choice(('', '2023/', '2024/'))}{n}.txt" for n in names]
    files = {p: [_text([_line(rng) for _ in range(rng.randint(2, 6))]), 0o644] for p in paths}
    target = rng.choice(paths)
    lines = files[target][0].splitlines()
    lines.insert(rng.randrange(len(lines) + 1), f"the code is {token}")
    files[target][0] = _text(lines)
    return _question(files, f"Which file under notes/ contains the text {token}? Answer with its "
                     "path, e.g. notes/example.txt.", f"grep -rl {token} notes", target)


def word_count(rng):
    word = rng.choice(WORDS)
    lines = [_line(rng, 3, 9) for _ in range(rng.randint(6, 15))]
    count = sum(line.split().count(word) for line in lines)
    return _question({"story.txt": [_text(lines), 0o644]}, f"How many times does the word {word} "
                     "occur in story.txt?", f"grep -ow {word} story.txt | wc -l", count)


# --- file changes ----------------------------------------------------------------------------
def upper(rng):
    files = {"names.txt": [_text([_line(rng, 1, 3) for _ in range(rng.randint(3, 8))]), 0o644],
             "readme.txt": [_text([_line(rng)]), 0o644]}
    expected = _same(files)
    expected["names.txt"][0] = files["names.txt"][0].upper()
    return _change(files, "Convert the contents of names.txt to upper case (in place).",
                   "tr a-z A-Z < names.txt > names.tmp && mv names.tmp names.txt", expected)


def make_exec(rng):
    names = _names(rng, rng.randint(3, 6))
    k = rng.randint(2, len(names) - 1)
    files = {f"scripts/{n}.sh": ["#!/bin/sh\necho run\n", 0o644] for n in names[:k]}
    files.update({f"scripts/{n}.txt": [_line(rng) + "\n", 0o644] for n in names[k:]})
    expected = {p: [t, 0o755 if p.endswith(".sh") else m] for p, (t, m) in files.items()}
    return _change(files, "Make every .sh file in scripts/ executable (mode 755); leave the other "
                   "files as they are.", "chmod 755 scripts/*.sh", expected)


def private(rng):
    files = {f"keys/{n}.pem": [f"KEY {rng.randint(10**5, 10**6)}\n", 0o644]
             for n in _names(rng, rng.randint(2, 5))}
    files["public.txt"] = ["shared\n", 0o644]
    expected = {p: [t, 0o600 if p.startswith("keys/") else m] for p, (t, m) in files.items()}
    return _change(files, "Make every file in keys/ readable and writable by its owner only "
                   "(mode 600).", "chmod 600 keys/*", expected)


def delete_tmp(rng):
    files = {}
    for n in _names(rng, rng.randint(5, 10)):
        folder = rng.choice(("build", "build/obj", "build/cache"))
        files[f"{folder}/{n}.{rng.choice(('o', 'tmp', 'c', 'tmp'))}"] = [_line(rng) + "\n", 0o644]
    files[f"build/{rng.choice(WORDS)}-x.tmp"] = ["scratch\n", 0o644]
    expected = _same({p: v for p, v in files.items() if not p.endswith(".tmp")})
    return _change(files, "Delete every .tmp file under build/ (in all its subdirectories).",
                   "find build -type f -name '*.tmp' -delete", expected)


def rename_ext(rng):
    names = _names(rng, rng.randint(3, 6))
    k = rng.randint(2, len(names))
    files = {f"photos/{n}.{'jpeg' if i < k else 'png'}": [f"image {n}\n", 0o644]
             for i, n in enumerate(names)}
    expected = _same({p.replace(".jpeg", ".jpg"): v for p, v in files.items()})
    return _change(files, "Rename every .jpeg file in photos/ to end in .jpg instead.",
                   'for f in photos/*.jpeg; do mv "$f" "${f%.jpeg}.jpg"; done', expected)


def sort_unique(rng):
    words = [rng.choice(WORDS) for _ in range(rng.randint(8, 20))]
    files = {"words.txt": [_text(words), 0o644]}
    return _change(files, "Sort the lines of words.txt alphabetically and remove duplicate lines, "
                   "in place.", "sort -u words.txt -o words.txt",
                   {"words.txt": [_text(sorted(set(words))), None]})


def move_logs(rng):
    files = {f"{n}.log": [_text([_line(rng)]), 0o644] for n in _names(rng, rng.randint(2, 4))}
    files.update({"notes.txt": ["keep me\n", 0o644], "data.csv": ["a,b\n1,2\n", 0o644]})
    expected = _same({(f"logs/{p}" if p.endswith(".log") else p): v for p, v in files.items()})
    return _change(files, "Move every .log file of the work dir into a new directory logs/.",
                   "mkdir logs && mv *.log logs/", expected)


def replace(rng):
    old, new = rng.choice((("localhost", "db.internal"), ("debug", "release"), ("8080", "9090")))
    keys = rng.sample(("host", "mode", "port", "backup", "mirror", "cache"), 4)
    lines = ["[main]"] + [f"{k} = {rng.choice((old, rng.choice(WORDS)))}" for k in keys]
    lines.append(f"fallback = {old}")
    text = _text(lines)
    return _change({"config.ini": [text, 0o644]}, f"Replace every occurrence of {old} with {new} "
                   "in config.ini.", f"sed -i 's/{old}/{new}/g' config.ini",
                   {"config.ini": [text.replace(old, new), None]})


def count_to_file(rng):
    n = rng.randint(3, 30)
    files = {"data.txt": [_text([_line(rng) for _ in range(n)]), 0o644]}
    expected = _same(files)
    expected["count.txt"] = [f"{n}\n", None]
    return _change(files, "Write the number of lines of data.txt into a new file count.txt (just "
                   "the number).", "wc -l < data.txt > count.txt", expected)


def concat(rng):
    parts = [f"part{i}.txt" for i in range(1, rng.randint(3, 5))]
    files = {p: [_text([_line(rng) for _ in range(rng.randint(1, 4))]), 0o644] for p in parts}
    expected = _same(files)
    expected["all.txt"] = ["".join(files[p][0] for p in parts), None]
    return _change(files, f"Concatenate {', '.join(parts)} in that order into a new file all.txt "
                   "(keep the parts).", f"cat {' '.join(parts)} > all.txt", expected)


FAMILIES: dict[str, Callable[[random.Random], dict]] = {f.__name__: f for f in (
    count_lines, count_ext, grep_count, largest, csv_sum, top_ip, distinct, exec_count,
    which_contains, word_count, upper, make_exec, private, delete_tmp, rename_ext, sort_unique,
    move_logs, replace, count_to_file, concat)}


def content_split(spec: dict) -> str:
    """``test`` for about 20% of task contents, ``train`` otherwise (stable across processes)."""
    key = ("os", spec["instruction"], sorted((p, tuple(v)) for p, v in spec["files"].items()))
    return "test" if int(stable_hash(key), 16) % 100 < TEST_PERCENT else "train"


@lru_cache(maxsize=2)
def generated(split: str) -> tuple[tuple[str, dict], ...]:
    """``(task_id, spec)`` of the split, round-robin over families (computed once per process)."""
    per_family = []
    for family, make in FAMILIES.items():
        found, seen, seed = [], set(), 0
        while len(found) < PER_FAMILY[split]:
            spec = make(random.Random(f"os:{family}:{seed}"))
            key = stable_hash((spec["instruction"], repr(sorted(spec["files"].items()))))
            if content_split(spec) == split and key not in seen:
                seen.add(key)
                found.append((f"os-{family}-{seed}", dict(spec, family=family)))
            seed += 1
        per_family.append(found)
    return tuple(item for row in zip(*per_family) for item in row)
