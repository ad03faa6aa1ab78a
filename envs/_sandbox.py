"""A bubblewrap sandbox around one work dir, and exact in-memory snapshots of that dir.

Each command runs in a fresh ``bwrap`` process: new user, PID, network, IPC, UTS and cgroup
namespaces (so no network at all), the system (``/usr`` and a few ``/etc`` files) mounted
read-only, a private 16 MiB ``/tmp`` that vanishes with the command, and the work dir as the only
host directory that can be written. Host paths such as ``/root`` or the project are simply not
mounted. The command never runs as root on the host: when the host process is root it drops to
``nobody`` (uid 65534) before starting ``bwrap``, which matters because the kernel does not
enforce ``RLIMIT_NPROC`` for root. Nothing of the host's environment gets in: ``bwrap`` itself
(which is PID 1 inside, its environment readable at ``/proc/1/environ``) starts with
:data:`BWRAP_ENV` only, and the command with :data:`SANDBOX_ENV`. Nested user namespaces are
refused (``--disable-userns``; with a bwrap older than 0.8, a seccomp filter that fails
``unshare``/``clone`` asking for one), so ``unshare -r`` cannot give a root shell inside.

Limits (:class:`Limits`): wall time (the whole PID namespace is killed), and, set with
``ulimit`` inside the sandbox before the command runs, CPU seconds, address space, processes
and file size, each per process. Output past ``output_bytes`` is not shown; a command that
writes more than ``stop_output_bytes`` is stopped. The work dir itself has no quota (that needs
cgroups or a mount): after every command it is scanned, and if it holds more than ``max_files``
entries or ``max_bytes`` bytes the command's changes are undone.

A work dir's state is a :data:`Tree`: a sorted tuple of :class:`Entry` (path, kind, mode,
data) — contents and permission bits, nothing else. Timestamps are stamped to one fixed time
(:data:`STAMP`) after every change, the work dir itself and its parent ``/home`` included, so
``ls -la`` prints the same thing however and whenever the state was reached. The clock itself is
real: ``date``, a file's times within the command that made it, ctimes and inode numbers are
the host's. Output has its terminal control sequences removed (:func:`strip_controls`).
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import re
import resource
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import tempfile
import threading
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
#: the whole environment of ``bwrap`` itself (PID 1 inside: its environ is readable there)
BWRAP_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}
#: the whole environment of the command (``--clearenv`` first)
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": HOME, "USER": "agent", "LC_ALL": "C",
               "TZ": "UTC", "TERM": "dumb", "TMPDIR": "/tmp"}
# Escape sequences (CSI, OSC, DCS/SOS/PM/APC strings, two-byte escapes), C0 controls but tab and
# newline, DEL, C1 controls and the bidi overrides that reorder what a reader sees.
_CONTROLS = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]?|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
                       r"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?|\x1b[ -/]*[0-~]?"
                       "|[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


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
def strip_controls(text: str) -> str:
    """``text`` without terminal control sequences: printable text, newlines and tabs stay
    (``\\r`` becomes a newline, so text a progress bar overwrote stays readable)."""
    return _CONTROLS.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))


def _argv(workdir: str, limits: Limits, seccomp_fd: int | None) -> list[str]:
    argv = [BWRAP, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
            "--symlink", "usr/sbin", "/sbin", "--symlink", "usr/lib", "/lib", "--symlink",
            "usr/lib64", "/lib64"]
    for name in _ETC:
        if os.path.exists(f"/etc/{name}"):
            argv += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
             "--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp",
             "--ro-bind", _home_parent(), os.path.dirname(HOME), "--bind", workdir, HOME,
             "--remount-ro", "/", "--chdir", HOME, "--clearenv"]
    argv += ["--disable-userns"] if seccomp_fd is None else ["--seccomp", str(seccomp_fd)]
    for key, value in SANDBOX_ENV.items():
        argv += ["--setenv", key, value]
    return argv


@functools.lru_cache(maxsize=1)
def _bwrap_help() -> str:
    try:
        out = subprocess.run([BWRAP, "--help"], capture_output=True, text=True, env=BWRAP_ENV,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout + out.stderr


def userns_guard() -> str:
    """How nested user namespaces are refused: ``"disable-userns"`` (bwrap >= 0.8) or
    ``"seccomp"`` (older bwrap: :func:`_userns_filter`)."""
    return "disable-userns" if "--disable-userns" in _bwrap_help() else "seccomp"


# (AUDIT_ARCH, unshare, clone, clone3) of the machines a seccomp filter is written for
_ARCHES = {"x86_64": (0xC000003E, 272, 56, 435), "aarch64": (0xC00000B7, 97, 220, 435)}


def _userns_filter() -> bytes:
    """A classic-BPF seccomp program: ``unshare``/``clone`` with ``CLONE_NEWUSER`` fail with EPERM,
    ``clone3`` (whose flags a filter cannot read) with ENOSYS so libc falls back to ``clone``;
    any other ABI (x32, 32-bit) fails with EPERM. Everything else is allowed."""
    arch = _ARCHES.get(os.uname().machine)
    if arch is None:
        raise SandboxError(f"bwrap lacks --disable-userns and no seccomp filter is written for "
                           f"{os.uname().machine}: install bubblewrap >= 0.8")
    audit, unshare, clone, clone3 = arch
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    prog = [(ld, 0, 0, 4),                  # 0: A = arch
            (jeq, 0, 9, audit),             # 1: another ABI -> 11
            (ld, 0, 0, 0),                  # 2: A = syscall number
            (jge, 7, 0, 0x40000000),        # 3: x32 -> 11
            (jeq, 3, 0, unshare),           # 4: -> 8
            (jeq, 2, 0, clone),             # 5: -> 8
            (jeq, 5, 0, clone3),            # 6: -> 12
            (ret, 0, 0, allow),             # 7
            (ld, 0, 0, 16),                 # 8: A = low 32 bits of the flags (args[0])
            (jset, 1, 0, 0x10000000),       # 9: CLONE_NEWUSER -> 11
            (ret, 0, 0, allow),             # 10
            (ret, 0, 0, eperm),             # 11
            (ret, 0, 0, enosys)]            # 12
    return b"".join(struct.pack("<HBBI", *ins) for ins in prog)


_home_lock = threading.Lock()
_home: str | None = None


def _home_parent() -> str:
    """A host dir holding an empty ``agent`` dir, both stamped, mounted read-only as ``/home``:
    so the home's parent shows :data:`STAMP`, not the time bwrap made it. One per user, shared
    by every process and never removed (``$TMPDIR/omrl-home-UID``); a private one (removed at
    exit) if that path is not a plain dir of this user's."""
    global _home
    with _home_lock:
        if _home is not None and _home_ok(_home):
            return _home
        shared = os.path.join(tempfile.gettempdir(), f"omrl-home-{os.geteuid()}")
        for path in (shared, None):
            if path is None:
                path = tempfile.mkdtemp(prefix="omrl-home-")
                atexit.register(shutil.rmtree, path, True)
            try:
                inner = os.path.join(path, os.path.basename(HOME))
                os.makedirs(inner, exist_ok=True)
                if _home_ok(path, check=False) and os.listdir(path) == [os.path.basename(HOME)]:
                    for p in (inner, path):  # bwrap may run as nobody: 0755
                        os.chmod(p, 0o755)
                        os.utime(p, (STAMP, STAMP))
                    _home = path
                    return path
            except OSError:
                pass
        raise SandboxError(f"cannot make the sandbox's /home under {tempfile.gettempdir()}")


def _home_ok(path: str, check: bool = True) -> bool:
    """``path`` and its ``agent`` are real dirs of this user's (and, with ``check``, still
    0755 and stamped)."""
    try:
        for p in (path, os.path.join(path, os.path.basename(HOME))):
            st = os.lstat(p)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                return False
            if check and (stat.S_IMODE(st.st_mode) != 0o755 or st.st_mtime != STAMP):
                return False
    except OSError:
        return False
    return True


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
        raise SandboxError(f"env 'os' needs bubblewrap at {BWRAP} (sudo apt-get install -y "
                           "bubblewrap)")
    program = _userns_filter() if userns_guard() == "seccomp" else None
    info_r, info_w = os.pipe()
    ok_r, ok_w = os.pipe()
    passed = [info_w, ok_w]  # bwrap's ends: closed here once it has them
    if program is not None:
        seccomp_r, seccomp_w = os.pipe()
        passed.append(seccomp_r)
        os.write(seccomp_w, program)  # a few hundred bytes: fits in the pipe
        os.close(seccomp_w)
    drop = {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []} if _as_root() else {}
    argv = _argv(workdir, limits, passed[2] if program is not None else None)
    argv += ["--info-fd", str(info_w), "/bin/bash", "-c", _WRAPPER.format(fd=ok_w), "bash",
             command, *_ulimits(limits)]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, pass_fds=passed, env=BWRAP_ENV, **drop)
    except BaseException:
        os.close(info_r)
        os.close(ok_r)
        raise
    finally:
        for fd in passed:
            os.close(fd)
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
    text = strip_controls(shown[:limits.output_bytes].decode("utf-8", "replace"))
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
    """The tree under ``root`` (never following symlinks), stamping every atime and mtime.

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
            if entry.kind == "d":
                opened = not _as_root() and mode & 0o700 != 0o700
                if opened:
                    os.chmod(path, mode | 0o700)
                try:
                    walk(entry.path + "/", path)
                finally:
                    if opened:
                        os.chmod(path, mode)
            # listing a dir or reading a link sets its atime (files are read with O_NOATIME)
            if kind in "dl" or st.st_mtime_ns != stamp_ns or st.st_atime_ns != stamp_ns:
                os.utime(path, (STAMP, STAMP), follow_symlinks=False)

    walk("", root)
    return tuple(out)


def _read(path: str, mode: int) -> bytes:
    opened = not _as_root() and not mode & 0o400
    if opened:
        os.chmod(path, mode | 0o400)
    try:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(path, flags | os.O_NOATIME)
        except PermissionError:  # O_NOATIME needs the file's owner (or CAP_FOWNER)
            fd = os.open(path, flags)
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
            os.utime(root, (STAMP, STAMP))  # and `ls -la` shows the same `.` whenever it runs
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
