"""The os env's sandbox leaks nothing of the host's environment, refuses nested user namespaces,
shows the same listing for the same state whenever it is reached, and shows no terminal control
sequences."""
from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from envs import _sandbox
from envs._sandbox import BWRAP, BWRAP_ENV, SANDBOX_ENV, STAMP, strip_controls
from envs.os_shell import OsEnv
from omrl_search.env import make_env

pytestmark = pytest.mark.skipif(not os.path.exists(BWRAP), reason=(
    "bubblewrap is not installed (the os env's sandbox): sudo apt-get install -y bubblewrap"))
FAST = {"wall_s": 5.0, "cpu_s": 2}
TASK = OsEnv.task_from_dict({"instruction": "Look.", "files": {"a.txt": "a\n"}, "answer": "1"})


@pytest.fixture
def env():
    e = make_env("os", **FAST)
    e.reset(TASK)
    yield e
    e.close()


def bash(env, command: str) -> str:
    res = env.step(f"bash: {command}")
    assert res.valid and not res.done, res.observation
    return res.observation


def _file(env, path: str) -> bytes:
    return {e.path: e.data for e in env.workdir.tree}[path]


# --- the host's environment ------------------------------------------------------------------
def test_no_host_variable_is_readable_anywhere_under_proc(env, monkeypatch):
    name, value = f"OMRL_SECRET_{secrets.token_hex(6).upper()}", secrets.token_urlsafe(24)
    monkeypatch.setenv(name, value)
    # every environ and cmdline readable inside, of every process and thread, into one file
    # (the command names no part of the secret: it is itself in a cmdline there)
    bash(env, "for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline /proc/[0-9]*/task/*/environ "
              "/proc/[0-9]*/task/*/cmdline /proc/self/environ; do printf '%s\\n' \"== $f\"; "
              "cat \"$f\"; echo; done > dump 2>/dev/null; echo done")
    dump = _file(env, "dump")
    assert b"== /proc/1/environ\nPATH=/usr/bin:/bin\0" in dump  # bwrap itself, PID 1: read
    assert b"HOME=/home/agent\0" in dump  # the command's own environment: read
    assert name.encode() not in dump and value.encode() not in dump
    ours = {f"{k}={v}" for k, v in {**BWRAP_ENV, **SANDBOX_ENV}.items()}
    own = ("SHLVL", "PWD", "OLDPWD", "_")  # bash sets these itself
    host = [f"{k}={v}" for k, v in os.environ.items() if f"{k}={v}" not in ours and k not in own]
    assert len(host) > 3 and [pair for pair in host if pair.encode() + b"\0" in dump] == []


# --- nested user namespaces ------------------------------------------------------------------
@pytest.mark.parametrize("guard", ["disable-userns", "seccomp"])
def test_nested_user_namespaces_are_refused(monkeypatch, guard):
    if guard == "seccomp":  # as with a bwrap older than 0.8, which lacks --disable-userns
        monkeypatch.setattr(_sandbox, "_bwrap_help", lambda: "")
    elif _sandbox.userns_guard() != guard:
        pytest.skip(f"this bwrap lacks --disable-userns: {_sandbox._bwrap_help()[:60]!r}")
    assert _sandbox.userns_guard() == guard
    e = make_env("os", **FAST)
    e.reset(TASK)
    try:
        obs = bash(e, "unshare -r id -u; echo rc=$?; unshare -U true; echo rc=$?; "
                      "(echo forked | cat) & wait; id -u")
        assert "rc=1\n" in obs and "rc=0" not in obs and "\n0\n" not in obs
        assert "forked" in obs  # processes and pipes still work under the filter
    finally:
        e.close()


def test_seccomp_filter_program_is_well_formed():
    prog = _sandbox._userns_filter()
    assert len(prog) % 8 == 0 and 8 <= len(prog) // 8 <= 64
    import struct
    for i in range(len(prog) // 8):  # every jump lands inside the program, on a return at the end
        code, jt, jf, _ = struct.unpack_from("<HBBI", prog, 8 * i)
        if code & 0x07 == 0x05:
            assert i + 1 + max(jt, jf) < len(prog) // 8
    assert struct.unpack_from("<HBBI", prog, len(prog) - 8)[0] == 0x06


# --- timestamps ------------------------------------------------------------------------------
# the home (`.`), its parent (`..`, i.e. /home) and what is in it; stat first: ls sets atimes
LISTING = "stat -c '%n %Y %X' . .. d d/f x; ls -la --time-style=+%s . d"


def test_the_same_state_shows_the_same_listing_whenever_it_is_reached():
    """Second-resolution times, a bit over a second apart: a listing of the home, its parent
    and what a command made (and back-dated) is the same, and so is the state key."""
    seen = []
    for _ in range(2):
        e = make_env("os", **FAST)
        e.reset(TASK)
        bash(e, "mkdir d && touch d/f x && touch -d 2001-02-03 x")
        obs = bash(e, LISTING)
        seen.append((obs, e.state_key()))
        e.close()
        time.sleep(1.2)
    assert seen[0] == seen[1]
    times = {int(t) for t in seen[0][0].split() if t.isdigit() and len(t) == 10}
    assert times == {STAMP}


def test_a_restored_state_shows_the_same_listing(env):
    bash(env, "mkdir d && touch d/f x")
    snap = env.snapshot()
    first = bash(env, LISTING)
    time.sleep(1.1)
    bash(env, "rm -rf d x && touch y")  # the home changes (and its time with it)
    env.restore(snap)
    assert bash(env, LISTING) == first


@pytest.fixture
def tmp_dir(monkeypatch):
    """A temp dir that bwrap (run as nobody when the tests run as root) can traverse."""
    path = tempfile.mkdtemp(prefix="omrl-test-")
    os.chmod(path, 0o755)
    monkeypatch.setattr(_sandbox.tempfile, "tempdir", path)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_home_parent_is_shared_and_a_squatted_path_is_not_used(monkeypatch, tmp_dir):
    monkeypatch.setattr(_sandbox, "_home", None)
    shared = tmp_dir / f"omrl-home-{os.geteuid()}"
    assert _sandbox._home_parent() == str(shared)  # made, stamped, reused
    assert os.stat(shared).st_mtime == STAMP and os.listdir(shared) == ["agent"]
    os.utime(shared)  # someone touched it: stamped again on next use
    assert _sandbox._home_parent() == str(shared) and os.stat(shared).st_mtime == STAMP
    (shared / "planted").write_text("x")  # it would show in /home: a private one instead
    monkeypatch.setattr(_sandbox, "_home", None)
    private = _sandbox._home_parent()
    assert private != str(shared) and os.path.basename(private).startswith("omrl-home-")
    e = make_env("os", **FAST)
    e.reset(TASK)
    try:
        assert f" {STAMP} ..\n" in bash(e, "ls -la --time-style=+%s")
    finally:
        e.close()


# --- terminal control sequences --------------------------------------------------------------
@pytest.mark.parametrize("raw,clean", [
    ("plain text\twith a tab\nand lines", "plain text\twith a tab\nand lines"),
    ("\x1b[31mred\x1b[0m \x1b[1;4mbold\x1b[m", "red bold"),
    ("\x1b]0;pwned title\x07after", "after"),
    ("\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\", "link"),
    ("50%\r100%\r\n", "50%\n100%\n"),
    ("bell\x07 back\x08space \x00nul \x7fdel \x0cff", "bell backspace nul del ff"),
    ("c1 \x9b31m \x85 x", "c1 31m  x"),
    ("\x1bPdevice control\x1b\\ \x1b(B\x1b=ok", " ok"),
    ("evil\u202egnp.exe \u2066iso\u2069", "evilgnp.exe iso"),
    ("unicode: é 中文 ✓", "unicode: é 中文 ✓"),
])
def test_strip_controls(raw, clean):
    assert strip_controls(raw) == clean


def test_command_output_has_no_control_sequences(env):
    obs = bash(env, r"printf '\033[2J\033[31mred\033[0m\033]0;title\007 \302\233 ok\r\n\tend\n'")
    assert obs.split("\n", 1)[1] == "red  ok\n\tend\n[exit code 0]"  # (line 1: the command)
    assert not any(ord(ch) < 32 and ch not in "\n\t" or 0x7f <= ord(ch) <= 0x9f for ch in obs)
