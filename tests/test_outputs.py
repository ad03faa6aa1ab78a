"""Outputs written as a whole (omrl_search.outdir): ``--out`` checked before any work, a rerun
swaps the old output for the new in one step, a run that raises keeps its finished tasks in
``OUT.partial`` and says so, a run killed with SIGKILL leaves the old output intact and its
temporary sibling is cleared by the next run; no ``.tmp`` is ever left behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import omrl_search.cli as cli
from omrl_search import outdir
from omrl_search.cli import main
from omrl_search.outdir import OutDir, ResultLog

SEARCH = ["search", "--env", "game24", "--policy", "scripted:oracle:p=0.3", "--seed", "0", "--no-progress"]


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _leftovers(parent: Path) -> list[str]:
    """Temporary siblings and temp files anywhere under ``parent``."""
    return [p.relative_to(parent).as_posix() for p in parent.rglob("*")
            if ".omrl-tmp-" in p.name or ".omrl-old-" in p.name or p.name.endswith((".tmp", ".sorting"))]


def _unwritable() -> Path:
    for p in (Path("/sys"), Path("/proc")):
        if p.is_dir() and not _can_mkdir(p):
            return p
    pytest.skip("no unwritable directory to test with")


def _can_mkdir(p: Path) -> bool:
    try:
        (p / "omrl-probe").mkdir()
    except OSError:
        return False
    (p / "omrl-probe").rmdir()
    return True


# --- checked before any work -----------------------------------------------------------------------
@pytest.mark.parametrize("command", ["search", "bench"])
def test_unwritable_out_is_one_line_before_any_model_loads(tmp_path, capsys, command):
    """The policy named cannot load (it would fail after the check if the check came late)."""
    ro = _unwritable()
    extra = ["--budgets", "tokens=100", "--strategies", "react"] if command == "bench" else []
    for out, needle in [(ro / "omrl-run", "is not writable"), (ro / "omrl-sub" / "run", "cannot create")]:
        rc = main([command, "--env", "game24", "--limit", "2", "--policy", "hf:/nonexistent/model",
                   *extra, "--out", str(out), "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and needle in err and str(out) in err, err
    f = tmp_path / "file"
    f.write_text("x")
    rc = main([command, "--env", "game24", "--policy", "hf:/nonexistent/model", *extra,
               "--out", str(f / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "cannot create" in err and len(err.splitlines()) == 1


def test_a_directory_that_is_not_an_omrl_output_is_not_replaced(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    rc = main([*SEARCH, "--limit", "2", "--out", str(mine)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "no omrl output" in err and len(err.splitlines()) == 1
    assert _files(mine) == {"notes.txt": b"keep me"} and not _leftovers(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*SEARCH, "--limit", "2", "--out", str(empty)]) == 0  # an empty one is fine
    assert {"results.jsonl", "summary.json"} == set(_files(empty))


def test_relative_and_symlinked_outputs(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(run)
    assert main([*SEARCH, "--limit", "1", "--out", "."]) == 0  # the working directory itself
    assert {"results.jsonl", "summary.json"} == set(_files(run))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link").symlink_to(run)
    assert main([*SEARCH, "--limit", "2", "--out", "link"]) == 0  # replaces the target, keeps the link
    assert (tmp_path / "link").is_symlink() and json.loads((run / "summary.json").read_text())["react"]["tasks"] == 2
    assert main([*SEARCH, "--limit", "1", "--out", "/"]) == 2


def test_bad_argument_after_the_check_leaves_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*SEARCH[:-5], "--policy", "hf:/nonexistent/model", "--out", str(out), "--no-progress"]) == 2
    assert "/nonexistent/model" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# --- a rerun replaces the output as a whole ---------------------------------------------------------
@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_rerun_replaces_the_whole_output(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(outdir, "_exchange", lambda a, b: False)
    out = tmp_path / "bench"
    assert main(["bench", "--env", "game24", "--limit", "3", "--strategies", "react,beam", "--budgets",
                 "lm_calls=4", "--out", str(out), "--save-trees", "--no-progress"]) == 0
    assert (out / "trees").is_dir()
    (out / "report.html").write_text("old report")
    assert main(["bench", "--env", "game24", "--limit", "4", "--strategies", "react", "--budgets",
                 "lm_calls=5", "--out", str(out), "--no-progress"]) == 0
    new = _files(out)
    assert set(new) == {"summary.json", "table.md", "outcomes.jsonl", "scaling.png", "scaling_env_steps.png"}
    summary = json.loads(new["summary.json"])
    assert summary["config"]["tasks"] == 4 and list(summary["strategies"]) == ["react"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~outdir._umask())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench"] and not _leftovers(tmp_path)


def test_crash_between_the_two_renames_is_undone_by_the_next_run(tmp_path):
    """Without renameat2 the old output is moved aside, then the new one into place: a run killed
    between the two leaves no DIR; the next run puts the old one back before it starts."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "run"
    old = tmp_path / f".run.omrl-old-{dead.pid}-abcd"
    old.mkdir()
    (old / "summary.json").write_text("{}")
    stale = tmp_path / f".run.omrl-tmp-{dead.pid}-efgh"
    stale.mkdir()
    (stale / "results.jsonl").write_text("half")
    od = OutDir.open(out)
    assert _files(out) == {"summary.json": b"{}"}  # restored
    assert not old.exists() and not stale.exists() and od.path.is_dir()
    od.abort()
    assert not _leftovers(tmp_path)


def test_a_live_runs_temporary_directory_is_left_alone(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        theirs = tmp_path / f".run.omrl-tmp-{live.pid}-abcd"
        theirs.mkdir()
        with OutDir.open(tmp_path / "run") as od:
            (od.path / "summary.json").write_text("{}")
        assert theirs.is_dir() and (tmp_path / "run" / "summary.json").is_file()
    finally:
        live.kill()
        live.wait()


# --- a run that raises keeps its finished tasks ------------------------------------------------------
def _failing_after(monkeypatch, n: int, exc: BaseException) -> None:
    """search_many raises ``exc`` once ``n`` tasks have finished (and been reported)."""
    real = cli.search_many
    seen = [0]

    def search_many(tasks, *, on_result=None, **kw):
        def report(r):
            on_result(r)
            seen[0] += 1
            if seen[0] == n:
                raise exc
        return real(tasks, on_result=report, **kw)

    monkeypatch.setattr(cli, "search_many", search_many)


@pytest.mark.parametrize("exc", [RuntimeError("engine blew up"), MemoryError()], ids=["RuntimeError", "MemoryError"])
def test_exception_mid_run_keeps_old_output_and_finished_tasks(tmp_path, monkeypatch, exc):
    out = tmp_path / "run"
    assert main([*SEARCH, "--limit", "3", "--out", str(out)]) == 0
    old = _files(out)
    _failing_after(monkeypatch, 7, exc)  # react's 6 tasks, then one of beam's
    with pytest.raises(type(exc)) as info:
        main([*SEARCH, "--limit", "6", "--strategy", "react", "--strategy", "beam", "--out", str(out)])
    partial = tmp_path / "run.partial"
    assert info.value.__notes__ == [f"7 finished tasks kept in {partial / 'results.jsonl'}"]
    assert _files(out) == old  # the old output, untouched
    kept = [json.loads(line) for line in (partial / "results.jsonl").read_text().splitlines()]
    assert len(kept) == 7 and [r["strategy"].split(":")[0] for r in kept] == ["react"] * 6 + ["beam"]
    assert not (partial / "summary.json").exists() and not _leftovers(tmp_path)
    # the next good run replaces the output and clears the partial one
    monkeypatch.undo()
    assert main([*SEARCH, "--limit", "2", "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert json.loads((out / "summary.json").read_text())["react"]["tasks"] == 2


def test_user_error_mid_run_is_one_line_that_says_where_the_tasks_are(tmp_path, monkeypatch, capsys):
    _failing_after(monkeypatch, 2, ValueError("bad thing in a task"))
    out = tmp_path / "run"
    assert main([*SEARCH, "--limit", "4", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"omrl: error: bad thing in a task; 2 finished tasks kept in {tmp_path / 'run.partial' / 'results.jsonl'}"
    assert not out.exists() and len((tmp_path / "run.partial" / "results.jsonl").read_text().splitlines()) == 2


def test_ctrl_c_mid_run_is_one_line_exit_130_and_keeps_finished_tasks(tmp_path, monkeypatch, capsys):
    _failing_after(monkeypatch, 3, KeyboardInterrupt())
    out = tmp_path / "run"
    assert main([*SEARCH, "--limit", "5", "--out", str(out)]) == 130
    partial = tmp_path / "run.partial"
    assert capsys.readouterr().err.strip() == \
        f"omrl: interrupted; 3 finished tasks kept in {partial / 'results.jsonl'}"
    assert len((partial / "results.jsonl").read_text().splitlines()) == 3 and not out.exists()
    assert not _leftovers(tmp_path)


def test_bench_exception_keeps_outcomes_and_trees(tmp_path, monkeypatch):
    import omrl_search.bench as bench_mod

    real, seen = bench_mod.search_many, [0]

    def search_many(tasks, *, on_result=None, **kw):
        def report(r):
            on_result(r)
            seen[0] += 1
            if seen[0] == 5:
                raise RuntimeError("late failure")
        return real(tasks, on_result=report, **kw)

    monkeypatch.setattr(bench_mod, "search_many", search_many)
    out = tmp_path / "bench"
    with pytest.raises(RuntimeError) as info:
        main(["bench", "--env", "game24", "--limit", "3", "--strategies", "react,beam", "--budgets",
              "lm_calls=4", "--out", str(out), "--save-trees", "--no-progress"])
    partial = tmp_path / "bench.partial"
    assert info.value.__notes__ == [f"5 finished tasks kept in {partial / 'outcomes.jsonl'}"]
    assert not out.exists() and not _leftovers(tmp_path)
    assert len((partial / "outcomes.jsonl").read_text().splitlines()) == 5
    assert len((partial / "trees" / "react@lm_calls=4.jsonl").read_text().splitlines()) == 3
    assert len((partial / "trees" / "beam@lm_calls=4.jsonl").read_text().splitlines()) == 2


# --- SIGKILL mid-run -----------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["search", "bench"])
def test_sigkill_mid_run_leaves_old_output_intact_and_next_run_cleans_up(tmp_path, command):
    out = tmp_path / "run"
    small = (["bench", "--env", "game24", "--limit", "2", "--strategies", "react", "--budgets", "lm_calls=3"]
             if command == "bench" else [*SEARCH[:-1], "--limit", "2"])
    assert main([*small, "--out", str(out), "--no-progress"]) == 0
    old = _files(out)
    big = (["bench", "--env", "game24", "--strategies", "mcts,beam,tot", "--budgets", "tokens=20000,40000",
            "--save-trees"] if command == "bench"
           else [*SEARCH[:-1], "--strategy", "mcts", "--strategy", "tot", "--budget", "tokens=40000"])
    proc = subprocess.Popen([sys.executable, "-m", "omrl_search.cli", *big, "--out", str(out), "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    name = "outcomes.jsonl" if command == "bench" else "results.jsonl"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:  # kill once a few tasks are on disk
            tmp = [p for p in tmp_path.iterdir() if ".omrl-tmp-" in p.name]
            if tmp and (tmp[0] / name).is_file() and len((tmp[0] / name).read_bytes().splitlines()) >= 5:
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        else:
            pytest.fail("no task finished in time")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _files(out) == old  # intact: nothing of the new run beside it
    (left,) = [p for p in tmp_path.iterdir() if ".omrl-tmp-" in p.name]
    assert str(proc.pid) in left.name and (left / name).is_file()  # readable until the next run
    assert main([*small, "--out", str(out), "--no-progress"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and not _leftovers(tmp_path)


# --- the streaming log --------------------------------------------------------------------------------
def test_result_log_appends_at_once_and_closes_in_key_order(tmp_path):
    od = OutDir.open(tmp_path / "o")
    log = ResultLog(od.path / "r.jsonl", od)
    for key in (2, 0, 3, 1):
        log.add((0, key), json.dumps({"k": key}))
        # on disk (flushed) before the next task: a crash now keeps it
        assert json.loads((od.path / "r.jsonl").read_text().splitlines()[-1]) == {"k": key}
    log.close()
    assert [json.loads(x)["k"] for x in (od.path / "r.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    assert od.finished == 4
    od.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"] and _files(tmp_path / "o").keys() == {"r.jsonl"}


def test_write_file_atomic_leaves_no_temp_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "report.html"
    outdir.write_file_atomic(target, "one")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outdir.os, "replace", boom)
    with pytest.raises(OSError):
        outdir.write_file_atomic(target, "two")
    assert target.read_text() == "one" and os.listdir(tmp_path) == ["report.html"]
