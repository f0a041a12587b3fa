"""Bounded reads of files the exporter does not control: configuration, tokens, PID files,
server logs and /proc entries. Never more than asked for, and never a hang on a FIFO."""
from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO


def open_regular(path: str, *, dir_fd: int | None = None, follow_symlinks: bool = True) -> BinaryIO:
    """Open a regular file for reading without ever blocking (a FIFO would hang `open`).
    Raises IsADirectoryError / OSError(EINVAL) for anything that is not a regular file, and
    OSError(ELOOP) for a symlink when `follow_symlinks` is False (a shared directory where
    others may plant links). `dir_fd`: `path` is relative to that open directory."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_head(path: str, max_bytes: int, *, dir_fd: int | None = None,
              follow_symlinks: bool = True) -> tuple[bytes, bool]:
    """At most `max_bytes` from the start of a regular file, and whether it holds more.
    OSError propagates: the caller says what the file was for."""
    chunks, size = [], 0
    with open_regular(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks) as fh:
        while size <= max_bytes:
            chunk = fh.read(max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    data = b"".join(chunks)
    return data[:max_bytes], len(data) > max_bytes
