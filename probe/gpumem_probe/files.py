"""The probe's one file, written so a reader never sees half of it and no link is followed.

Every write goes to a temporary file created with O_CREAT|O_EXCL|O_NOFOLLOW in the same
directory (through a directory descriptor opened once), then `rename`s over the final name:
rename is atomic and replaces whatever entry has the name (a planted symlink included)
without following it.
"""
from __future__ import annotations

import errno
import os
import re

_NAME = re.compile(r"\.?gpumem-(\d{1,20})-(\d{1,10})\.json(?:\.tmp)?")
MAX_SWEEP_ENTRIES = 4096
PID_MAX_LIMIT = 1 << 22  # Linux's highest possible PID
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class ProbeFile:
    def __init__(self, directory: str, name: str):
        self.name = name
        self._temp = f".{name}.tmp"
        self._dir = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))

    def write(self, data: bytes) -> None:
        """Replace the file's content with `data` atomically. OSError propagates."""
        fd = self._create_temp()
        try:
            # The exporter may run as another user; the file holds no secret.
            os.fchmod(fd, 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            self._unlink(self._temp)
            raise
        os.close(fd)
        os.rename(self._temp, self.name, src_dir_fd=self._dir, dst_dir_fd=self._dir)

    def _create_temp(self) -> int:
        try:
            return os.open(self._temp, _CREATE, 0o644, dir_fd=self._dir)
        except FileExistsError:
            # Left by a crash mid-write, or planted: unlink removes the entry itself, never
            # what a symlink points at.
            self._unlink(self._temp)
            return os.open(self._temp, _CREATE, 0o644, dir_fd=self._dir)

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir)
        except FileNotFoundError:
            pass

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
                match = _NAME.fullmatch(entry.name)
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError as exc:  # EPERM: alive, another user's
        return exc.errno == errno.EPERM
    return True
