"""Output directories written as a whole, and results streamed into them task by task.

``omrl search --out DIR`` and ``omrl bench --out DIR`` write into a hidden sibling of DIR
(``.DIR.omrl-tmp-PID-XXXX``) and move it into place only once everything is written, so a reader
sees the old output or the new one, never a mix. An existing output is swapped in one step
(``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere two renames, and a crash between them is
undone by the next run) and the old one is deleted only after. Each task's result is appended to
its file as it finishes (:class:`ResultLog`); when the run raises, what it wrote is kept in
``DIR.partial`` and the exception's note says where. A run killed outright (SIGKILL, OOM) leaves
its hidden sibling, which the next run over the same DIR deletes. See docs/design.md §5.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

from .specs import UsageError

TMP, OLD = ".omrl-tmp-", ".omrl-old-"
#: files that mark a directory as an omrl output, which a rerun may replace
MARKERS = ("summary.json", "results.jsonl")


class OutDir:
    """``with OutDir.open(final) as out:`` write under ``out.path``; on leaving the block the
    directory replaces ``final`` (success) or is kept as ``final.partial`` (an exception, when
    something was written; the exception gets a note naming it) or removed (nothing written)."""

    def __init__(self, final: Path, path: Path) -> None:
        self.final, self.path = final, path
        self.finished = 0  #: tasks whose results were written (counted by ResultLog)
        self.main_file = ""  #: the file the partial-results note points at
        self.created: list[Path] = []  #: parent folders open() made (removed if nothing is kept)

    @classmethod
    def open(cls, final: "str | Path", flag: str = "--out") -> "OutDir":
        """Check ``final`` (a new, empty or omrl output directory whose parent can be created
        and written), clear what killed runs left beside it, and make the temporary sibling."""
        final = Path(os.path.abspath(final))  # "." has no name to make a sibling of
        if final.is_symlink():
            final = Path(os.path.realpath(final))
        if not final.name:
            raise UsageError(f"{flag} {final}: the root directory cannot be an output")
        if final.exists():
            if not final.is_dir():
                raise UsageError(f"{flag} {final} exists and is not a directory")
            if any(final.iterdir()) and not any((final / m).exists() for m in MARKERS):
                raise UsageError(f"{flag} {final} is a non-empty directory with no omrl output in it "
                                 f"({' or '.join(MARKERS)}); it would be replaced: name a new or empty one")
        parent = final.parent
        check_out_path(parent, flag, label=final)
        created = make_dirs(parent)
        _recover(final)
        try:
            path = Path(tempfile.mkdtemp(prefix=f".{final.name}{TMP}{os.getpid()}-", dir=parent))
        except OSError as exc:
            remove_dirs(created)
            raise UsageError(f"{flag} {final} is not writable (cannot create a directory in {parent}: "
                             f"{exc.strerror or exc})") from None
        out = cls(final, path)
        out.created = created
        return out

    @property
    def partial(self) -> Path:
        return self.final.with_name(self.final.name + ".partial")

    def commit(self) -> None:
        """Move the finished directory into place (replacing an older output in one step)."""
        _default_mode(self.path)
        if self.final.is_dir():
            if _exchange(self.path, self.final):
                shutil.rmtree(self.path, ignore_errors=True)  # now holds the old output
            else:
                old = Path(tempfile.mkdtemp(prefix=f".{self.final.name}{OLD}{os.getpid()}-",
                                            dir=self.final.parent))
                os.replace(self.final, old)  # onto the empty placeholder
                os.replace(self.path, self.final)
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.path, self.final)
        shutil.rmtree(self.partial, ignore_errors=True)  # a failed run's leftovers, superseded

    def abort(self) -> Path | None:
        """After a failure: keep what was written as ``final.partial`` (replacing an older one)
        and return it, or remove the temporary directory when it holds nothing."""
        if not any(p.is_file() and p.stat().st_size for p in self.path.rglob("*")):
            shutil.rmtree(self.path, ignore_errors=True)
            remove_dirs(self.created)
            return None
        shutil.rmtree(self.partial, ignore_errors=True)
        _default_mode(self.path)
        os.replace(self.path, self.partial)
        return self.partial

    def __enter__(self) -> "OutDir":
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.commit()
            return
        kept = self.abort()
        if kept is not None:
            where = kept / self.main_file if self.main_file else kept
            exc.add_note(f"{self.finished} finished task{'s' * (self.finished != 1)} kept in {where}")


class ResultLog:
    """A JSONL file each line of which is appended (and flushed) as a task finishes; closing it
    puts the lines in the order of their keys (completion order differs from task order)."""

    def __init__(self, path: Path, outdir: OutDir | None = None) -> None:
        self.path, self.outdir = Path(path), outdir
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab")
        self._index: list[tuple[Any, int, int, int]] = []  # (key, seq, offset, length)

    def add(self, key: Any, line: str) -> None:
        data = (line.rstrip("\n") + "\n").encode("utf-8")
        offset = self._file.tell()
        self._file.write(data)
        self._file.flush()
        self._index.append((key, len(self._index), offset, len(data)))
        if self.outdir is not None:
            self.outdir.finished += 1

    def close(self) -> None:
        self._file.close()
        order = sorted(self._index)
        if order == self._index:
            return
        tmp = self.path.with_name(self.path.name + ".sorting")
        try:
            with self.path.open("rb") as src, tmp.open("wb") as dst:
                for _, _, offset, length in order:
                    src.seek(offset)
                    dst.write(src.read(length))
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> "ResultLog":
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        """Sorted when the block ends normally; after an exception the lines stay as written."""
        if exc is None:
            self.close()
        else:
            self._file.close()


def write_file_atomic(path: "str | Path", text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder renamed into place;
    the temporary file is removed if writing fails (nothing half-written, no ``.tmp`` left)."""
    path = Path(path)
    created = make_dirs(path.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except BaseException:
        remove_dirs(created)
        raise
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        remove_dirs(created)
        raise


def check_writable_file(path: "str | Path", flag: str = "--out") -> Path:
    """Before any work: ``path`` is not a directory and its folder exists or can be made, and can
    be written (:func:`check_out_path`; nothing is created)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory")
    check_out_path(path.parent, flag, label=path)
    return path


def check_out_path(path: "str | Path", flag: str = "--out", *, label: "str | Path | None" = None) -> Path:
    """Before any work, creating nothing: something can be written at ``path``. An existing
    folder must let a file be made in it; an existing file, its folder; a missing path, the
    nearest folder above it, and nothing on the way may be a file. The place is probed by
    making and removing a temporary folder (root passes a plain permission check even where
    nothing can be written, e.g. ``/proc``). A problem is a :class:`UsageError` naming
    ``flag`` and ``label`` (default ``path``)."""
    label = path if label is None else label
    path = Path(os.path.abspath(path))
    where = path if path.is_dir() else path.parent if path.exists() else None
    if where is None:
        where = path.parent
        while not where.exists() and where != where.parent:
            where = where.parent
        if not where.is_dir():
            raise UsageError(f"{flag} {label} is not writable (cannot create it: {where} is not a directory)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".omrl-probe-", dir=where))
    except OSError as exc:
        raise UsageError(f"{flag} {label} is not writable (cannot create anything in {where}: "
                         f"{exc.strerror or exc})") from None
    return path


def make_dirs(path: "str | Path") -> list[Path]:
    """``mkdir -p path``, returning the folders it made (outermost first) for :func:`remove_dirs`."""
    path = Path(path)
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        p.mkdir(exist_ok=True)
    return missing[::-1]


def remove_dirs(created: list[Path]) -> None:
    """Remove folders :func:`make_dirs` made, innermost first, where they are still empty."""
    for p in reversed(created):
        try:
            p.rmdir()
        except OSError:
            return


# --- helpers -------------------------------------------------------------------------------------
def _siblings(final: Path, kind: str) -> Iterable[tuple[Path, int]]:
    """Temporary siblings of ``final`` of one kind (TMP or OLD) with the pid that made them."""
    prefix = f".{final.name}{kind}"
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return []
    out = []
    for p in entries:
        if p.name.startswith(prefix) and p.is_dir() and not p.is_symlink():
            pid = p.name[len(prefix):].split("-", 1)[0]
            out.append((p, int(pid) if pid.isdigit() else -1))
    return out


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # another output this process is writing now
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _recover(final: Path) -> None:
    """Undo what a killed run left: an old output moved aside but not yet replaced goes back
    (when ``final`` is missing), then dead runs' temporary siblings are deleted."""
    for p, pid in _siblings(final, OLD):
        if _alive(pid):
            continue
        if not final.exists() and any(p.iterdir()):
            os.replace(p, final)
        else:
            shutil.rmtree(p, ignore_errors=True)
    for p, pid in _siblings(final, TMP):
        if not _alive(pid):
            shutil.rmtree(p, ignore_errors=True)


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2``); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the file system cannot; rename instead
        return False
    raise OSError(err, os.strerror(err), str(b))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _default_mode(path: Path) -> None:
    """mkdtemp makes 0700 directories; an output gets the mode a plain mkdir would give it."""
    try:
        os.chmod(path, 0o777 & ~_umask())
    except OSError:
        pass
