"""A bubblewrap sandbox around one work dir, and exact in-memory snapshots of that dir.

Each command runs in a fresh ``bwrap`` process: new user, PID, network, IPC, UTS and cgroup
namespaces (so no network at all), the system (``/usr`` and a few ``/etc`` files) mounted
read-only, a private 16 MiB ``/tmp`` that vanishes with the command, and the work dir as the only
host directory that can be written. Host paths such as ``/root`` or the project are simply not
mounted. The command never runs as root on the host: when the host process is root it drops to
``nobody`` (uid 65534) before starting ``bwrap``, which matters because the kernel does not
enforce ``RLIMIT_NPROC`` for root.

Limits (:class:`Limits`): wall time (the whole PID namespace is killed), and, set with
``ulimit`` inside the sandbox before the command runs, CPU seconds, address space, processes
and file size, each per process. Output past ``output_bytes`` is not shown; a command that
writes more than ``stop_output_bytes`` is stopped. The work dir itself has no quota (that needs
cgroups or a mount): after every command it is scanned, and if it holds more than ``max_files``
entries or ``max_bytes`` bytes the command's changes are undone.

A work dir's state is a :data:`Tree`: a sorted tuple of :class:`Entry` (path, kind, mode,
data) — contents and permission bits, nothing else. Timestamps are stamped to one fixed time
after every change so ``ls -l`` prints the same thing however the state was reached.
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import weakref
from dataclasses import dataclass
from typing import NamedTuple

from omrl_search.env import EnvError

BWRAP = "/usr/bin/bwrap"
HOME = "/home/agent"
SANDBOX_UID = 65534  # nobody: the uid commands run as when the host process is root
STAMP = 1_704_067_200  # 2024-01-01 00:00:00 UTC: every entry's atime and mtime
_ETC = ("alternatives", "passwd", "group", "nsswitch.conf", "ld.so.cache")
_WRAPPER = (  # runs inside the sandbox: report "started", set limits, run the command
    'printf ok >&{fd}; exec {fd}>&-; ulimit -c 0; ulimit -u "$2" && ulimit -v "$3" '
    '&& ulimit -t "$4" && ulimit -f "$5" || exit 126; umask 022; exec /bin/bash -c "$1"'
)
_KINDS = {stat.S_IFREG: "f", stat.S_IFDIR: "d", stat.S_IFLNK: "l", stat.S_IFIFO: "p"}


class SandboxError(EnvError):
    """The sandbox could not be started (bwrap missing, user namespaces disabled, ...)."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one command (per process where the kernel counts per process)."""

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 256
    procs: int = 32
    file_mb: int = 1
    output_bytes: int = 2000
    stop_output_bytes: int = 256 * 1024
    tmp_mb: int = 16
    max_files: int = 500
    max_bytes: int = 4 * 1024 * 1024


class RunResult(NamedTuple):
    output: str  # stdout and stderr interleaved, cut to ``output_bytes`` with a marker
    exit_code: int | None  # None when the sandbox was stopped
    stopped: str  # "" or why it was stopped: "wall" or "output"


class Entry(NamedTuple):
    path: str  # relative, "/"-separated
    kind: str  # "d" directory, "f" regular file, "l" symlink, "p" fifo
    mode: int  # permission bits (0o7777)
    data: bytes | str | None  # file bytes, symlink target, or None


Tree = tuple  # tuple[Entry, ...], sorted by path


class TooBig(Exception):
    """The work dir exceeds its entry or byte limit."""


def tree_digest(tree: Tree) -> str:
    """A short hash of a tree's paths, kinds, modes and contents."""
    h = hashlib.blake2b(digest_size=8)
    for e in tree:
        data = _bytes(e.data) if isinstance(e.data, str) else e.data or b""
        h.update(b"%s\0%s%o\0%d\0" % (_bytes(e.path), e.kind.encode(), e.mode, len(data)))
        h.update(data)
    return h.hexdigest()


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")  # file names need not be UTF-8


# --- the sandbox -----------------------------------------------------------------------------
def _argv(workdir: str, limits: Limits) -> list[str]:
    argv = [BWRAP, "--unshare-all", "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/sbin",
            "/sbin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64"]
    for name in _ETC:
        if os.path.exists(f"/etc/{name}"):
            argv += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
             "--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp",
             "--bind", workdir, HOME, "--remount-ro", "/", "--chdir", HOME, "--clearenv"]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": HOME, "USER": "agent", "LC_ALL": "C",
           "TZ": "UTC", "TERM": "dumb", "TMPDIR": "/tmp"}
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return argv


def _ulimits(limits: Limits) -> list[str]:
    """``ulimit`` values for -u -v -t -f, never above the host's own hard limits."""
    wanted = ((resource.RLIMIT_NPROC, limits.procs, 1),
              (resource.RLIMIT_AS, limits.memory_mb << 20, 1024),
              (resource.RLIMIT_CPU, limits.cpu_s, 1),
              (resource.RLIMIT_FSIZE, limits.file_mb << 20, 1024))
    out = []
    for res, value, unit in wanted:
        hard = resource.getrlimit(res)[1]
        out.append(str((value if hard == resource.RLIM_INFINITY else min(value, hard)) // unit))
    return out


def run_command(command: str, workdir: str, limits: Limits) -> RunResult:
    """Run ``bash -c command`` in a fresh sandbox on ``workdir``; never leaves a process behind."""
    if not os.path.exists(BWRAP):
        raise SandboxError(f"env 'os' needs bubblewrap at {BWRAP} (apt-get install bubblewrap)")
    info_r, info_w = os.pipe()
    ok_r, ok_w = os.pipe()
    drop = {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []} if _as_root() else {}
    argv = _argv(workdir, limits) + ["--info-fd", str(info_w), "/bin/bash", "-c",
                                     _WRAPPER.format(fd=ok_w), "bash", command, *_ulimits(limits)]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, pass_fds=(info_w, ok_w), **drop)
    finally:
        os.close(info_w)
    os.close(ok_w)
    with os.fdopen(info_r, "rb") as f:  # bwrap writes the child pid, then closes the fd
        info = f.read()
    pidfd = _pidfd(info)
    deadline = time.monotonic() + limits.wall_s
    try:
        shown, total, stopped = _read_output(proc, deadline, limits)
        if not stopped:  # EOF: every process has closed its output; wait for the exit status
            try:
                proc.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                stopped = "wall"
    finally:
        if proc.poll() is None:
            _stop(proc, pidfd)
        proc.wait()
        if pidfd is not None:
            os.close(pidfd)
    with os.fdopen(ok_r, "rb") as f:
        started = f.read() == b"ok"
    if not started:
        why = shown.decode("utf-8", "replace").strip() or f"exit status {proc.returncode}"
        raise SandboxError(f"the sandbox did not start: {why}")
    text = shown[:limits.output_bytes].decode("utf-8", "replace")
    if total > limits.output_bytes:
        more = "at least " if stopped == "output" else ""
        text += f"\n[output cut: {more}{total - limits.output_bytes} more bytes not shown]"
    return RunResult(text, None if stopped else proc.returncode, stopped)


def _pidfd(info: bytes) -> int | None:
    """A pidfd of the sandbox's PID 1: killing it kills every process in the sandbox."""
    try:
        return os.pidfd_open(int(json.loads(info)["child-pid"]))
    except (ValueError, KeyError, OSError):
        return None  # bwrap failed before starting it, or it already exited


def _read_output(proc: subprocess.Popen, deadline: float, limits: Limits) -> tuple[bytes, int, str]:
    """Read until EOF, the deadline or the output stop limit: ``(kept, total, stopped)``."""
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    kept, total = bytearray(), 0
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(kept), total, "wall"
            if not sel.select(left):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return bytes(kept), total, ""
            total += len(chunk)
            if len(kept) <= limits.output_bytes:
                kept += chunk[:limits.output_bytes + 1 - len(kept)]
            if total > limits.stop_output_bytes:
                return bytes(kept), total, "output"


def _stop(proc: subprocess.Popen, pidfd: int | None) -> None:
    """Kill the sandbox's PID 1 (the kernel then kills the whole namespace) and wait for it."""
    if pidfd is not None:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            with selectors.DefaultSelector() as sel:
                sel.register(pidfd, selectors.EVENT_READ)
                sel.select(5.0)  # readable once it has exited, i.e. the namespace is empty
        except ProcessLookupError:
            pass
    proc.kill()


# --- work dir trees --------------------------------------------------------------------------
def _as_root() -> bool:
    return os.geteuid() == 0


def scan(root: str, limits: Limits) -> Tree:
    """The tree under ``root`` (never following symlinks), stamping changed timestamps.

    Raises :class:`TooBig` past ``limits.max_files`` entries or ``limits.max_bytes`` bytes.
    Entries the host user cannot read (mode 000 as non-root) are opened up just long enough.
    """
    out: list[Entry] = []
    size = 0
    stamp_ns = STAMP * 10**9

    def walk(prefix: str, folder: str) -> None:
        nonlocal size
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            st = os.lstat(path)
            mode, kind = stat.S_IMODE(st.st_mode), _KINDS.get(stat.S_IFMT(st.st_mode))
            if kind is None:
                continue  # sockets and the like vanish with the process that made them
            data = _read(path, mode) if kind == "f" else os.readlink(path) if kind == "l" else None
            entry = Entry(prefix + name, kind, mode, data)
            size += len(data) if kind == "f" else 0
            out.append(entry)
            if len(out) > limits.max_files or size > limits.max_bytes:
                raise TooBig(f"more than {limits.max_files} entries or {limits.max_bytes} bytes")
            if st.st_mtime_ns != stamp_ns:
                os.utime(path, (STAMP, STAMP), follow_symlinks=False)
            if entry.kind == "d":
                opened = not _as_root() and mode & 0o700 != 0o700
                if opened:
                    os.chmod(path, mode | 0o700)
                try:
                    walk(entry.path + "/", path)
                finally:
                    if opened:
                        os.chmod(path, mode)

    walk("", root)
    return tuple(out)


def _read(path: str, mode: int) -> bytes:
    opened = not _as_root() and not mode & 0o400
    if opened:
        os.chmod(path, mode | 0o400)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            return f.read()
    finally:
        if opened:
            os.chmod(path, mode)


def write_tree(root: str, current: Tree, target: Tree, owner: int | None) -> None:
    """Turn the dir holding ``current`` into ``target``, touching only what differs.

    Both trees are in scan order (parents before children). ``owner`` (a uid, when the host is
    root) becomes the owner of every entry created, so the sandbox user can change it.
    """
    old = {e.path: e for e in current}
    new = {e.path: e for e in target}
    restamp = {""}  # dirs whose contents change: their mtime must be stamped again
    if not _as_root():  # let the host user edit inside dirs whose mode forbids it
        for e in current:
            if e.kind == "d" and e.mode & 0o700 != 0o700:
                os.chmod(os.path.join(root, e.path), e.mode | 0o700)
                restamp.add(e.path)
    for e in reversed(current):  # children before their parents
        t = new.get(e.path)
        if t is None or t.kind != e.kind or t.data != e.data:
            path = os.path.join(root, e.path)
            os.rmdir(path) if e.kind == "d" else os.unlink(path)
            restamp.add(e.path.rpartition("/")[0])
    changed = []  # created, or only the mode differs
    for t in target:
        e, path = old.get(t.path), os.path.join(root, t.path)
        if e is None or e.kind != t.kind or t.data != e.data:
            _create(path, t)
            if owner is not None:
                os.chown(path, owner, owner, follow_symlinks=False)
            restamp.add(t.path.rpartition("/")[0])
            changed.append(t.path)
        elif e.mode != t.mode:
            changed.append(t.path)
    final = set(changed) | (restamp & new.keys())
    for rel in sorted(final, key=lambda p: p.split("/"), reverse=True):  # dirs after their contents
        path, t = os.path.join(root, rel), new[rel]
        if t.kind != "l":
            os.chmod(path, t.mode)
        os.utime(path, (STAMP, STAMP), follow_symlinks=False)
    os.utime(root, (STAMP, STAMP))


def _create(path: str, e: Entry) -> None:
    if e.kind == "d":
        os.mkdir(path, 0o700)
    elif e.kind == "f":
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(e.data)
    elif e.kind == "l":
        os.symlink(e.data, path)
    else:
        os.mkfifo(path, 0o600)


def _wipe(folder: str) -> None:
    """Remove everything inside ``folder``, whatever the modes."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.chmod(path, 0o700)
            _wipe(path)
            os.rmdir(path)
        else:
            os.unlink(path)


class WorkDir:
    """The host dir an env's commands run on, created on first use and removed by :meth:`close`.

    ``tree`` is always what the dir holds (``None`` after an unexpected error: the next
    :meth:`load` then rewrites the dir from scratch).
    """

    def __init__(self, limits: Limits):
        self.limits = limits
        self.path: str | None = None
        self.tree: Tree | None = ()
        self._owner = SANDBOX_UID if _as_root() else None
        self._cleanup: weakref.finalize | None = None

    def _ensure(self) -> str:
        if self.path is None:
            self.path = tempfile.mkdtemp(prefix="omrl-os-")
            if self._owner is not None:
                os.chown(self.path, self._owner, self._owner)
            self._cleanup = weakref.finalize(self, _remove, self.path)
            self.tree = ()
        return self.path

    def load(self, tree: Tree) -> None:
        """Make the dir hold exactly ``tree``."""
        root = self._ensure()
        if tree is self.tree:
            return
        try:
            if self.tree is None:
                _wipe(root)
                self.tree = ()
            write_tree(root, self.tree, tree, self._owner)
        except OSError:
            self.tree = None
            raise
        self.tree = tree

    def run(self, command: str) -> tuple[RunResult, bool]:
        """Run one command; ``(result, undone)`` where ``undone`` says the work dir outgrew its
        limits and the command's changes were rolled back."""
        root = self._ensure()
        before = self.tree
        result = run_command(command, root, self.limits)
        try:
            os.chmod(root, 0o700)  # the dir itself is not state; keep it enterable
            self.tree = scan(root, self.limits)
            return result, False
        except TooBig:
            self.tree = None
            self.load(before if before is not None else ())
            return result, True
        except OSError:
            self.tree = None
            raise

    def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup()
        self.path, self.tree, self._cleanup = None, (), None


def _remove(path: str) -> None:
    if os.path.isdir(path):
        if not _as_root():
            _wipe(path)
        shutil.rmtree(path, ignore_errors=True)
