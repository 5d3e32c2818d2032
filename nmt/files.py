"""Files written whole or not at all: a temporary file beside the target, moved over it once
complete, so a crash or an interruption leaves the target as it was (and no temporary file)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from nmt import NMTError


def write_atomic(path: Path, content: str | bytes) -> None:
    """Write `content` (text as UTF-8) to `path`: temporary file, fsync, rename. A symbolic
    link stays one: the file it points to is replaced."""
    path = _through_link(Path(path))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    data = content.encode("utf-8") if isinstance(content, str) else content
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _keep_attributes(tmp, path)
        os.replace(tmp, path)
        sync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _through_link(path: Path) -> Path:
    """The file a symbolic link points to (what a write through it changes), else `path`."""
    return path.resolve() if path.is_symlink() else path


def _keep_attributes(tmp: Path, path: Path) -> None:
    """Give the temporary file that replaces `path` the permissions (and, where allowed, the
    owner) `path` has: a private file stays private; a new file gets the umask's mode."""
    try:
        st = os.stat(path)
    except OSError:
        return
    os.chmod(tmp, stat.S_IMODE(st.st_mode))
    with contextlib.suppress(OSError):
        os.chown(tmp, st.st_uid, st.st_gid)


def alive(pid: int) -> bool:
    """Whether a process `pid` runs on this machine (one of another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_temporary(name: str) -> bool:
    """Whether `name` is a temporary file's, as `write_atomic`, `replacing` and checkpoint
    saves name them: `.NAME.tmp-PID`."""
    return name.startswith(".") and name.rpartition(".tmp-")[2].isdecimal()


def remove_stale_temporaries(folder: Path) -> None:
    """The temporary files (`is_temporary`) in `folder` whose process is gone: killed while
    it wrote them."""
    for leftover in Path(folder).glob(".*.tmp-*"):
        pid = leftover.name.rpartition(".tmp-")[2]
        if is_temporary(leftover.name) and int(pid) != os.getpid() and not alive(int(pid)):
            if leftover.is_file() and not leftover.is_symlink():
                leftover.unlink(missing_ok=True)


def sync_dir(directory: Path) -> None:
    """fsync a directory, so that a rename into it survives a crash (where it can be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_lines(path: Path, lines: list[str]) -> None:
    """One line per entry (each ended by a newline), written atomically; folders created."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(line + "\n" for line in lines))


@contextlib.contextmanager
def replacing(path: Path, what: str = "--output") -> Iterator[TextIO]:
    """A text file to stream into, moved over `path` once the scope ends without an error;
    on an error (or Ctrl-C) `path` stays as it was. `what` names the path in errors. A
    symbolic link stays one (the file it points to is replaced); what is not a file (/dev/null,
    /dev/stdout, a named pipe) is written to as it is, never replaced by a file. A file we may
    not write (read-only to us) is refused, as a shell's `>` would, instead of replaced; the
    file replaced keeps its permissions."""
    path = _through_link(Path(path))
    if path.is_file() and not os.access(path, os.W_OK):
        raise NMTError(
            f"cannot write {what} {path}: it is read-only; make it writable or write elsewhere"
        )
    if path.exists() and not path.is_file():
        try:
            f = open(path, "w", encoding="utf-8")  # noqa: SIM115
        except OSError as e:
            raise NMTError(f"cannot write {what} {path}: {e.strerror}") from None
        with f:
            yield f
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # two writers: one file each
    try:
        f = open(tmp, "w", encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        raise NMTError(f"cannot write {what} {path}: {e.strerror}") from None
    try:
        with f:
            yield f
        try:
            _keep_attributes(tmp, path)
            os.replace(tmp, path)
        except OSError as e:  # named for the user: the target, not the temporary file
            raise NMTError(f"cannot write {what} {path}: {e.strerror}") from None
        sync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
