"""The post-mortem's one way to write a file: a new temporary file in the same directory, of an
unpredictable name `<name>.tmp.<pid>.<random>`, created with O_CREAT|O_EXCL|O_NOFOLLOW (so a
link planted in the directory is never written through), then renamed over the final name (so
a reader, or a crash, never sees half a file). The flight recorder's traces and the
allocation-history control files are written this way.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import Iterator
from typing import IO


@contextlib.contextmanager
def atomic_file(path: str, mode: int = 0o600, *, dir_fd: int | None = None,
                **open_args: object) -> Iterator[IO[str]]:
    """Open a text file to write `path` through; it replaces `path` when the block ends without
    an exception, with permission bits `mode`. On an exception nothing is left behind.
    `dir_fd`: `path` is a name in that open directory (opened by the caller without following
    a link, so a directory swapped for a link is never written into)."""
    if dir_fd is not None:
        with _atomic_in(dir_fd, path, mode, **open_args) as handle:
            yield handle
        return
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{name}.tmp.{os.getpid()}.", dir=directory or ".")
    try:
        if mode != 0o600:  # mkstemp's
            os.fchmod(fd, mode)
        with open(fd, "w", **open_args) as handle:  # type: ignore[call-overload]
            yield handle
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def _atomic_in(dir_fd: int, name: str, mode: int, **open_args: object) -> Iterator[IO[str]]:
    """atomic_file() for a name in an open directory."""
    if os.sep in name:
        raise ValueError(f"not a name in the directory: {name!r}")
    tmp = f"{name}.tmp.{os.getpid()}.{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                 0o600, dir_fd=dir_fd)
    try:
        if mode != 0o600:
            os.fchmod(fd, mode)
        with open(fd, "w", **open_args) as handle:  # type: ignore[call-overload]
            yield handle
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
