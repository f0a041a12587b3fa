"""The probe's files, written so a reader never sees half of one and no link is followed: its
JSON file and, on request, an allocation-history dump (history.py).

Every write goes to a temporary file created with O_CREAT|O_EXCL|O_NOFOLLOW in the same
directory (through a directory descriptor opened once), then `rename`s over the final name:
rename is atomic and replaces whatever entry has the name (a planted symlink included)
without following it.
"""
from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

from .schema import LEFTOVER_NAME, temp_name

MAX_SWEEP_ENTRIES = 4096
PID_MAX_LIMIT = 1 << 22  # Linux's highest possible PID
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class ProbeFile:
    def __init__(self, directory: str, name: str):
        self.name = name
        self._temp = temp_name(name)
        self._dir = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))

    def write(self, data: bytes) -> None:
        """Replace the file's content with `data` atomically. OSError propagates."""
        # The exporter may run as another user; the file holds no secret.
        self.write_as(self.name, lambda fd: _write_all(fd, data), 0o644)

    def write_as(self, name: str, fill: Callable[[int], None], mode: int) -> int:
        """Write another file of this directory the same way (temporary file created new, then
        renamed over `name`): `fill(fd)` writes the content. Returns its size. Whatever `fill`
        raises propagates, and the temporary file is removed."""
        temp = temp_name(name)
        fd = self._create_temp(temp, mode)
        try:
            os.fchmod(fd, mode)
            fill(fd)
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            self._unlink(temp)
            raise
        os.close(fd)
        os.rename(temp, name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        return size

    def _create_temp(self, temp: str, mode: int) -> int:
        try:
            return os.open(temp, _CREATE, mode, dir_fd=self._dir)
        except FileExistsError:
            # Left by a crash mid-write, or planted: unlink removes the entry itself, never
            # what a symlink points at.
            self._unlink(temp)
            return os.open(temp, _CREATE, mode, dir_fd=self._dir)

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir)
        except FileNotFoundError:
            pass

    def unlink(self, name: str) -> None:
        """Remove another entry of this directory (never what a link points at). OSError
        other than "not there" propagates."""
        self._unlink(name)

    def read_small(self, name: str, limit: int) -> bytes | None:
        """A small file of this directory that somebody else writes (the control file): None
        when there is none; OSError (ELOOP for a link, EINVAL for anything not a regular file,
        EFBIG over `limit` bytes) when it is not a small regular file. One stat when absent;
        never follows a link, never blocks on a FIFO, never reads more than `limit` + 1 bytes."""
        try:
            st = os.stat(name, dir_fd=self._dir, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            raise OSError(errno.ELOOP, "a symbolic link", name)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", name)
        if st.st_size > limit:
            raise OSError(errno.EFBIG, "too large", name)
        fd = os.open(name, _READ, dir_fd=self._dir)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the stat and the open
                raise OSError(errno.EINVAL, "not a regular file", name)
            data = os.read(fd, limit + 1)
        finally:
            os.close(fd)
        if len(data) > limit:
            raise OSError(errno.EFBIG, "too large", name)
        return data

    def signature(self, name: str) -> tuple[int, int, int] | None:
        """(inode, size, mtime) of an entry, not following links; None when absent. A file
        renamed into place by its writer gets a new inode."""
        try:
            st = os.stat(name, dir_fd=self._dir, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def remove(self) -> None:
        for name in (self.name, self._temp):
            self._unlink(name)

    def close(self) -> None:
        os.close(self._dir)

    def sweep(self, pid_ns: int, own_pid: int) -> int:
        """Remove the files that processes of our own PID namespace left when they were killed
        (SIGKILL, the OOM killer: no exit handler ran). Other namespaces' files are never
        touched: their PIDs mean nothing here. Returns how many were removed."""
        if not pid_ns:
            return 0
        removed = 0
        with os.scandir(self._dir) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_SWEEP_ENTRIES:
                    break
                match = LEFTOVER_NAME.fullmatch(entry.name)
                if not match or int(match.group(1)) != pid_ns:
                    continue
                pid = int(match.group(2))
                if 0 < pid <= PID_MAX_LIMIT and pid != own_pid and not _alive(pid):
                    try:
                        self._unlink(entry.name)
                        removed += 1
                    except PermissionError:
                        pass  # another user's file in a sticky directory: the exporter ignores it once stale
        return removed


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError as exc:  # EPERM: alive, another user's
        return exc.errno == errno.EPERM
    return True
