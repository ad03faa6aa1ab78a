"""The ``os`` env: sandbox confinement and limits, exact work-dir snapshots, actions, tasks, expert.

Limits are set small (wall 2 s, CPU 1 s) so the runaway commands are stopped quickly.
"""
from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections import Counter

import pytest

from envs import _os_tasks
from envs._sandbox import HOME, STAMP, scan
from envs.os_shell import OsEnv, parse_action
from omrl_search.env import EnvError, TaskFileError, make_env

FAST = {"wall_s": 2.0, "cpu_s": 1, "procs": 16, "memory_mb": 64, "stop_output_bytes": 64 * 1024}
FILES = {
    "a.txt": "alpha\nbeta\n",
    "bin/run.sh": {"content": "#!/bin/sh\necho run\n", "mode": "755"},
    "deep/er/x.txt": {"content": "x\n", "mode": "600"},
}


@pytest.fixture
def env():
    e = make_env("os", **FAST)
    e.reset(OsEnv.task_from_dict({"instruction": "Look around.", "files": FILES, "answer": "2"}))
    yield e
    e.close()


def run(env, command: str) -> str:
    """The observation of ``bash: command`` without its first line (the command echoed)."""
    result = env.step(f"bash: {command}")
    assert result.valid is True and not result.done
    assert result.observation.startswith(f"$ {command[:300]}")
    return result.observation.split("\n", 1)[1]


# --- confinement -----------------------------------------------------------------------------
def test_network_is_unreachable(env):
    listener = socket.socket()  # a service on the host's loopback must not be reachable either
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        obs = run(env, f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED; "
                       "exec 4<>/dev/tcp/1.1.1.1/80 && echo CONNECTED; "
                       "getent hosts pypi.org || echo NODNS")
    finally:
        listener.close()
    assert "CONNECTED" not in obs and "NODNS" in obs
    assert "Connection refused" in obs and "Network is unreachable" in obs


def test_nothing_outside_the_work_dir_is_writable(env, tmp_path):
    before = env.workdir.tree
    obs = run(env, f"for p in /usr/x /etc/x /x /home/x /proc/x /dev/x /bin/x {tmp_path}/x; do "
                   "touch $p 2>/dev/null && echo WROTE $p; done; ln -s /etc/passwd link; "
                   "echo pwned >> link; echo scratch > /tmp/s && echo TMP-OK")
    assert "WROTE" not in obs and "TMP-OK" in obs and not (tmp_path / "x").exists()
    # /tmp is a private in-memory dir that vanishes with the command
    assert "No such file or directory" in run(env, "ls /tmp/s")
    assert open("/etc/passwd").read().count("pwned") == 0
    new = {e.path for e in env.workdir.tree} - {e.path for e in before}
    assert new == {"link"}  # the only change is inside the work dir


def test_host_home_and_project_are_not_readable(env):
    host_tmp = os.path.dirname(env.workdir.path)
    obs = run(env, f"ls /root /work {host_tmp} 2>&1; cat /work/main/README.md; id -u")
    assert "No such file or directory" in obs and "omrl-search" not in obs
    assert os.path.basename(env.workdir.path) not in obs  # the host path of the work dir is hidden
    assert obs.splitlines()[-2] == ("65534" if os.geteuid() == 0 else str(os.geteuid()))


def test_limits_are_set_inside(env):
    lines = run(env, "ulimit -u; ulimit -v; ulimit -t; ulimit -f").splitlines()
    assert lines[:4] == ["16", str(64 * 1024), "1", "1024"]


def _still_works(env) -> None:
    assert run(env, "echo ok") == "ok\n[exit code 0]"


def _timed(env, command: str) -> tuple[str, float]:
    t0 = time.monotonic()
    obs = run(env, command)
    return obs, time.monotonic() - t0


def _processes_with(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


def test_fork_bomb_is_stopped(env):
    marker = "forkbomb-7f3a"
    counts: list[int] = []
    stop = threading.Event()

    def watch() -> None:  # how many bomb processes exist on the host while it runs
        while not stop.is_set():
            counts.append(len(_processes_with(marker)))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        obs, took = _timed(env, f": {marker}; b(){{ b|b& }}; b; sleep 30")
    finally:
        stop.set()
        watcher.join()
    assert took < FAST["wall_s"] + 3
    assert "Resource temporarily unavailable" in obs  # RLIMIT_NPROC is enforced (not root)
    assert "[stopped: the command ran past the wall-time limit of 2 s]" in obs
    assert 1 < max(counts) <= FAST["procs"]
    assert _processes_with(marker) == []  # the whole PID namespace is gone
    _still_works(env)


def test_endless_loop_and_sleep_are_stopped(env):
    obs, took = _timed(env, "while :; do :; done")
    assert took < FAST["wall_s"] + 3 and ("killed (CPU limit 1 s" in obs or "[stopped:" in obs)
    obs, took = _timed(env, "sleep 60")
    assert took < FAST["wall_s"] + 3 and "wall-time limit" in obs
    _still_works(env)


def test_memory_hog_is_stopped(env):
    obs, took = _timed(env, "awk 'BEGIN { s = \"x\"; while (1) s = s s }'")
    assert "out of memory" in obs and "[exit code 0]" not in obs and took < FAST["wall_s"] + 3
    _still_works(env)


def test_output_flood_is_cut_and_stopped(env):
    obs, took = _timed(env, "yes")
    assert took < FAST["wall_s"] + 3
    assert "[output cut: at least" in obs
    assert "[stopped: the command wrote more than 65536 bytes]" in obs
    assert len(obs) < 2000 + 300
    obs = run(env, "seq 1000")  # output merely long: cut, and the command finishes
    assert "[output cut: 1893 more bytes not shown]" in obs and "[exit code 0]" in obs
    _still_works(env)


def test_file_size_and_work_dir_limits(env):
    obs = run(env, "head -c 3000000 /dev/zero > big; wc -c < big")
    assert "File size limit exceeded" in obs and "1048576" in obs
    tree = env.workdir.tree
    small = make_env("os", max_files=12, **FAST)
    small.reset(env.state.task)
    before = small.workdir.tree
    obs = run(small, "touch f1 f2 f3 f4 f5 f6 f7 f8 f9")
    assert "the command's changes were undone" in obs
    assert small.workdir.tree == before == scan(small.workdir.path, small.limits)
    small.close()
    assert tree == env.workdir.tree


# --- snapshots -------------------------------------------------------------------------------
def test_restore_is_exact(env):
    assert scan(env.workdir.path, env.limits) == env.state.tree  # reset wrote the task's files
    run(env, "mkdir -p e/mpty && ln -s a.txt link && mkfifo pipe && chmod 4750 bin/run.sh && "
             "printf '\\000\\377bin' > raw && chmod 500 deep")
    snap = env.snapshot()
    listing = run(env, "ls -lR --time-style=+%F")
    assert set(re.findall(r"\d{4}-\d\d-\d\d", listing)) == {"2024-01-01"}  # stamped times
    run(env, "chmod 700 deep && rm -rf * && echo new > a.txt && chmod 600 a.txt")
    env.restore(snap)
    assert scan(env.workdir.path, env.limits) == snap.payload.tree == env.workdir.tree
    kinds = {e.path: (e.kind, oct(e.mode)) for e in env.workdir.tree}
    assert kinds["e/mpty"] == ("d", "0o755") and kinds["link"] == ("l", "0o777")
    assert kinds["pipe"][0] == "p" and kinds["bin/run.sh"] == ("f", "0o4750")
    assert kinds["deep"] == ("d", "0o500")
    assert dict((e.path, e.data) for e in env.workdir.tree)["raw"] == b"\0\xffbin"
    assert run(env, "ls -lR --time-style=+%F") == listing  # however the state was reached
    assert all(os.lstat(os.path.join(env.workdir.path, e.path)).st_mtime == STAMP
               for e in env.workdir.tree)
    fresh = make_env("os", **FAST)
    fresh.restore(snap)
    assert fresh.workdir.tree == snap.payload.tree and fresh.state_key() == snap.state_key
    assert run(fresh, "ls -lR --time-style=+%F") == listing
    fresh.close()


def test_state_key_follows_the_files(env):
    k0 = env.state_key()
    run(env, "true")
    k1 = env.state_key()
    run(env, "touch new")
    assert len({k0, k1, env.state_key()}) == 3
    a, b = make_env("os", **FAST), make_env("os", **FAST)
    for e in (a, b):
        e.reset(env.state.task)
        run(e, "echo 1 > one")
    assert a.state_key() == b.state_key()
    a.close()
    b.close()


def test_close_removes_the_work_dir_and_envs_are_cheap():
    e = make_env("os")
    assert e.workdir.path is None  # nothing on disk until reset or restore
    e.reset(OsEnv.tasks("test", limit=1)[0])
    path = e.workdir.path
    assert os.path.isdir(path)
    e.close()
    assert not os.path.exists(path)


# --- actions and episodes --------------------------------------------------------------------
@pytest.mark.parametrize("action,parsed", [
    ("bash: ls -l", ("bash", "ls -l")),
    ("BASH:ls", ("bash", "ls")),
    ("```bash\ncd bin\nls\n```", ("bash", "cd bin\nls")),
    ("```\nls\n```", ("bash", "ls")),
    ("bash\nwc -l a.txt", ("bash", "wc -l a.txt")),  # a fence the ReAct parser unwrapped
    ("answer: 42.", ("answer", "42.")),
    ("Answer:done", ("answer", "done")),
])
def test_parse_action(action, parsed):
    assert parse_action(action) == parsed


@pytest.mark.parametrize("action,why", [
    ("ls -l", "cannot parse 'ls -l'"), ("", "empty action"), ("bash:", "the command is empty"),
    ("answer:  ", "`answer:` needs a value"),
    ("bash: " + "x" * 9000, "the command must be text of at most 8000"),
])
def test_malformed_actions_explain_the_syntax(env, action, why):
    key = env.state_key()
    result = env.step(action)
    assert result.valid is False and result.info == {} and not result.done
    assert result.observation.startswith(f"Invalid action: {why}")
    assert "Actions: `bash: <command>`" in result.observation
    assert env.state_key() != key and env.state.tree is not None


def test_question_answers_and_episode_end():
    task = OsEnv.task_from_dict({"instruction": "n?", "files": {"a.txt": "x\n"}, "answer": 12})
    e = make_env("os", **FAST)
    for given, shown, ok in (("12", "12", True), ("`12.0`.", "12.0", True), (" 13 ", "13", False)):
        e.reset(task)
        r = e.step(f"answer: {given}")
        assert r.terminated and not r.truncated and r.success is ok and r.reward == float(ok)
        assert r.info["answer"] == shown
    paths = OsEnv.task_from_dict({"instruction": "which?", "files": {}, "answer": "notes/a.txt"})
    for given in ("notes/a.txt", "./notes/a.txt", f"{HOME}/notes/a.txt"):
        e.reset(paths)
        assert e.step(f"answer: {given}").success is True
    after = e.step("bash: ls")
    assert after.terminated and after.valid is False and after.success is True
    assert after.observation.startswith("Invalid action:")
    e.close()


def test_file_task_checks_contents_modes_and_extra_files():
    row = {"instruction": "fix", "files": {"s.sh": "echo\n"},
           "expected": {"s.sh": {"content": "echo", "mode": "755"}, "out.txt": "1\n"}}
    task = OsEnv.task_from_dict(row)
    e = make_env("os", **FAST)
    e.reset(task)
    e.step("bash: echo 1 > out.txt")
    r = e.step("answer: done")
    assert r.done and not r.success and "s.sh has mode 644, not 755" in r.observation
    e.reset(task)
    e.step("bash: chmod 755 s.sh && echo 1 > out.txt && touch stray")
    assert "unexpected files: stray" in e.step("answer: done").observation
    e.reset(task)
    e.step("bash: chmod 755 s.sh && printf 1 > out.txt")  # a missing final newline is fine
    r = e.step("answer: done")
    assert r.success is True and r.info["answer"].startswith("files:")
    e.close()


# --- tasks and the expert --------------------------------------------------------------------
def test_task_sets():
    test, train = OsEnv.tasks("test"), OsEnv.tasks("train")
    assert (len(test), len(train)) == (40, 400)
    assert Counter(t.data["family"] for t in test) == {f: 2 for f in _os_tasks.FAMILIES}
    assert [t.data["family"] for t in test[:20]] == list(_os_tasks.FAMILIES)  # round-robin
    content = lambda t: (t.instruction, json.dumps(t.data["files"], sort_keys=True))  # noqa: E731
    assert not {content(t) for t in train} & {content(t) for t in test}
    for t in test + train[:50]:
        spec = {"instruction": t.instruction, "files": t.data["files"]}
        assert _os_tasks.content_split(spec) == t.split
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        OsEnv.tasks("dev")


def test_expert_solves_every_test_task_with_its_solution():
    e = make_env("os")
    for task in OsEnv.tasks("test"):
        e.reset(task)
        first = e.expert_action()
        assert first == f"bash: {task.data['solution']}"
        r = e.step(first)
        assert r.info["exit_code"] == 0, (task.task_id, r.observation)
        if "answer" in task.data:
            assert r.observation.splitlines()[1] == task.data["answer"], task.task_id
        r = e.step(e.expert_action())
        assert r.done and r.success is True, (task.task_id, r.observation)
    e.close()


def test_expert_recovers_from_a_messed_up_work_dir():
    task = next(t for t in OsEnv.tasks("test") if t.data["family"] == "make_exec")
    e = make_env("os", **FAST)
    e.reset(task)
    run(e, "mv scripts old && mkdir -p scripts/sub && touch junk scripts/sub/x && "
           "chmod 000 scripts/sub")
    action = e.expert_action()
    assert action.startswith("bash: chmod u+rwx -- 'scripts/sub' && rm -rf -- ")
    e.step(action)
    assert e.expert_action() == "answer: done" and e.step("answer: done").success is True
    question = next(t for t in OsEnv.tasks("test") if t.data["family"] == "csv_sum")
    e.reset(question)
    run(e, "rm sales.csv")
    assert e.expert_action() == f"bash: {question.data['solution']}"
    run(e, question.data["solution"])
    assert e.expert_action() == f"answer: {question.data['answer']}"
    e.close()


def test_user_task_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    good = {"instruction": "Count.", "files": {"a/b.txt": "1\n2\n"}, "answer": 2,
            "solution": "wc -l < a/b.txt"}
    path.write_text(json.dumps(good) + "\n")
    (task,) = OsEnv.load_tasks(path)
    assert task.env == "os" and task.data["answer"] == "2"
    assert task.data["files"] == {"a/b.txt": ["1\n2\n", 0o644]}
    e = make_env("os", **FAST)
    e.reset(task)
    assert e.step(e.expert_action()).observation.splitlines()[1] == "2"
    assert e.step(e.expert_action()).success is True
    e.close()
    bad = [({"instruction": None}, "instruction must be"),
           ({"answer": None}, "exactly one of 'answer'"),
           ({"expected": {"a": "x"}}, "exactly one of 'answer'"),
           ({"files": {"../up": "x"}}, "not a relative path"),
           ({"files": {"/etc/x": "x"}}, "not a relative path"),
           ({"files": {"a": "x", "a/b": "y"}}, "both a file and a directory"),
           ({"files": {"a": {"content": "x", "mode": "99"}}}, "bad mode"),
           ({"files": {"a": 3}}, "needs text content"),
           ({"expected": {"a": 3}, "answer": None}, "expected: 'a' needs text content"),
           ({"solution": 5}, "solution must be")]
    for row, reason in bad:
        row = {"instruction": "x", "files": {}, "answer": 1, **row}  # None drops a field
        row = {k: v for k, v in row.items() if v is not None}
        path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(TaskFileError, match=rf"tasks\.jsonl:2: .*{reason}"):
            OsEnv.load_tasks(path)


def test_use_before_reset_raises():
    e = make_env("os")
    with pytest.raises(EnvError):
        e.step("bash: ls")
    assert e.expert_action() is None
