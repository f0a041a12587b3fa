"""The post-mortem's one way to write a file: a new temporary file in the same directory, of an
unpredictable name `<name>.tmp.<pid>.<random>`, created with O_CREAT|O_EXCL|O_NOFOLLOW (so a
link planted in the directory is never written through), then renamed over the final name (so
a reader, or a crash, never sees half a file). The flight recorder's traces and the
allocation-history control files are written this way.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import IO


@contextlib.contextmanager
def atomic_file(path: str, mode: int = 0o600, **open_args: object) -> Iterator[IO[str]]:
    """Open a text file to write `path` through; it replaces `path` when the block ends without
    an exception, with permission bits `mode`. On an exception nothing is left behind."""
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
