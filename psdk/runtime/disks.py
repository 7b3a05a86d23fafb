"""Full, read-only and forbidden disks: one line that names the file, the error and the fix.

An ``OSError`` from a write says ``[Errno 28] No space left on device`` and
rarely which file, on which file system, or what to change. A user on a
shared host needs all three to act: free space there, or point the setting
that placed the file (``checkpoint.dir``, ``hydra.run.dir``) somewhere else.
:class:`WriteError` carries that line; :func:`probe_folder` finds out before
a run starts whether its folder can be written at all, by writing to it (root
ignores mode bits, so reading them would say nothing).
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path
from typing import TypeGuard

from psdk.errors import PsdkError

WRITE_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EFBIG,
        errno.EROFS,
        errno.EACCES,
        errno.EPERM,
        errno.ENOTDIR,
        errno.EEXIST,
        errno.EISDIR,
    }
)
"""What a write can fail with because of where it goes (not a bug, not the network): the user's to fix."""

ELSEWHERE = "<a writable folder>"


class WriteError(PsdkError):
    """A file could not be written: names it, the error, and what to change (exit 2, no traceback)."""

    def __init__(self, path: Path | str, error: OSError, key: str | None = None, what: str = "write") -> None:
        self.path = Path(path)
        self.error = error
        self.key = key
        super().__init__(f"cannot {what} {self.path}: {describe(error)}; {advice(self.path, error, key)}")


def is_write_failure(exc: BaseException | None) -> TypeGuard[OSError]:
    """Whether ``exc`` is a write refused by the file system (full, read-only, forbidden, a file in the way)."""
    return isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS


def naming(path: Path | str, error: OSError) -> OSError:
    """``error`` as the write of ``path`` (a write through a descriptor, or to a temporary file, names another)."""
    return OSError(error.errno, error.strerror, str(path)) if error.errno is not None else error


def describe(error: OSError) -> str:
    """``No space left on device (ENOSPC)``: the C library's words and the name to search for."""
    code = error.errno
    name = errno.errorcode.get(code, str(code)) if code is not None else "?"
    return f"{os.strerror(code) if code is not None else error} ({name})"


def existing_ancestor(path: Path) -> Path:
    """``path`` itself, or the nearest folder above it that exists (where a write would land first)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_point(path: Path) -> Path:
    """The mount point of the file system ``path`` (or its nearest existing ancestor) is on."""
    path = existing_ancestor(path)
    if not path.is_dir():
        path = path.parent
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def free_space(path: Path) -> str:
    """``0 B of 2.0 MiB free``, for the file system of ``path``; empty when it cannot be read."""
    try:
        stat = os.statvfs(mount_point(path))
    except OSError:
        return ""
    return f"{_size(stat.f_bavail * stat.f_frsize)} of {_size(stat.f_blocks * stat.f_frsize)} free"


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def file_in_the_way(path: Path) -> Path | None:
    """The nearest ancestor of ``path`` that exists and is not a folder (a file where a folder must be)."""
    for parent in Path(os.path.abspath(path)).parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def advice(path: Path, error: OSError, key: str | None) -> str:
    """What to do about ``error`` writing ``path``; ``key`` is the setting that placed it."""
    setting = f"set {key}={ELSEWHERE}" if key else "choose a writable folder"
    code = error.errno
    if code in (errno.ENOSPC, errno.EFBIG):
        free = free_space(path)
        where = f"{mount_point(path)}" + (f" ({free})" if free else "")
        other = f"set {key}=<a folder on another file system>" if key else "choose a folder on another file system"
        return f"free space on {where} or {other}"
    if code == errno.EDQUOT:
        return f"free space within your quota on {mount_point(path)} or {setting}"
    if code == errno.EROFS:
        return f"{mount_point(path)} is mounted read-only: {setting}"
    if code in (errno.EACCES, errno.EPERM):
        folder = existing_ancestor(path.parent)
        return f"this user may not write in {folder}: change its permissions or {setting}"
    if code == errno.EISDIR or (code == errno.EEXIST and path.is_dir()):
        return f"{path} is a folder where a file must be: move it or {setting}"
    if code in (errno.ENOTDIR, errno.EEXIST):
        blocker = file_in_the_way(path) or path
        return f"{blocker} is a file where a folder must be: move it or {setting}"
    return setting


def probe_folder(folder: Path | str, key: str) -> None:
    """Whether ``folder`` can be written, or created: a WriteError naming it and the fix if not.

    It writes and removes a file in ``folder``, or where ``folder`` would be
    created (its nearest existing ancestor), and creates nothing that stays:
    writing is the only test that holds for root (who ignores mode bits), for
    read-only mounts, for full disks and for quotas alike.
    """
    folder = Path(os.path.abspath(folder))
    there = existing_ancestor(folder)
    if not there.is_dir():
        code = errno.ENOTDIR if there != folder else errno.EEXIST
        error = OSError(code, os.strerror(code))
        raise WriteError(folder, error, key, what="create the folder")
    try:
        fd, name = tempfile.mkstemp(dir=there, prefix=".psdk-probe-")
    except OSError as exc:
        raise WriteError(
            folder, exc, key, what="create the folder" if there != folder else "write in the folder"
        ) from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
