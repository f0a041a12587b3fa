"""Follow server log files and report the out-of-memory messages in them (OomMessages).

`LogTailer` follows one file like `tail -F`: complete new lines since the last poll, surviving
rotation (a new inode: the rest of the old file is read, then the new one from its start),
truncation (copytruncate: back to offset 0), deletion (quietly waits for the file to come back)
and unreadable files (reported on `error`/`error_kind`, never raised). Each poll reads at most
`max_read_bytes` of lines, so a burst of logging cannot stall a sampling tick; the rest comes next
poll. Over-long lines are cut to `max_line_bytes`, and the rest of such a line is skipped without
being kept or decoded, at up to `max_skip_bytes` a poll: a 100 MiB line costs one poll, not
twenty-five, so the lines after it (and an OOM among them) are not held back until a rotation or
truncation loses them.

`LogSource`, the `logs` source, tails several files, feeding each through its own `OomParser`
(which keeps the context a multi-line message needs) and reports messages and faults for one
tick, stamped with the tick's time. What a
message means is for the analysis (analysis/oom.classify).
"""
from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import replace
from typing import BinaryIO

from ..boundedio import open_regular
from ..model import OomMessage, Snapshot, SourceError
from ..units import counted
from .oom_messages import OomParser
from .source import LOG_EVENTS, Reading

DEFAULT_MAX_LINE_BYTES = 64 * 1024
DEFAULT_MAX_READ_BYTES = 4 * 1024 * 1024
# The rest of an over-long line is looked through for its end at up to this much a poll (only a
# newline search on 1 MiB chunks: the text is never kept).
DEFAULT_MAX_SKIP_BYTES = 64 * DEFAULT_MAX_READ_BYTES
SKIP_CHUNK_BYTES = 1024 * 1024
# OOM messages one tick keeps, every file together: an incident logs a handful; a flood of
# distinct OOM lines must not become a tick, a history and a trace of thousands.
MAX_EVENTS_PER_TICK = 64
SOURCE = "logs"


class _LineSplitter:
    """Bytes in, complete lines out; a line longer than the cap is cut and its rest dropped."""

    def __init__(self, max_line_bytes: int):
        self.max_line_bytes = max(1, int(max_line_bytes))
        self._partial = bytearray()
        self._discarding = False  # inside the dropped rest of an over-long line
        self.cut_lines = 0  # lines cut at max_line_bytes (the caller reads and resets it)

    @property
    def discarding(self) -> bool:
        return self._discarding

    def reset(self) -> None:
        self._partial.clear()
        self._discarding = False

    def feed(self, data: bytes) -> list[bytes]:
        lines: list[bytes] = []
        start = 0
        while True:
            newline = data.find(b"\n", start)
            if newline < 0:
                break
            if self._discarding:
                self._discarding = False
            else:
                room = self.max_line_bytes - len(self._partial)
                lines.append(bytes(self._partial) + data[start:min(newline, start + room)])
            self._partial.clear()
            start = newline + 1
        if not self._discarding:
            rest = data[start:]
            room = self.max_line_bytes - len(self._partial)
            if len(rest) >= room:
                # Emit the cut line now rather than buffering an unbounded one.
                lines.append(bytes(self._partial) + rest[:room])
                self._partial.clear()
                self._discarding = True
                self.cut_lines += 1
            else:
                self._partial += rest
        return lines

    def finish(self) -> list[bytes]:
        """The last line of a file that does not end in a newline."""
        tail = [bytes(self._partial)] if self._partial else []
        self.reset()
        return tail


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").rstrip("\r")


def _classify_os_error(exc: OSError) -> str:
    if isinstance(exc, PermissionError):
        return "permission"
    if isinstance(exc, IsADirectoryError):
        return "not_a_file"
    if exc.errno == errno.ENOENT:
        return "missing"
    return "io"


class LogTailer:
    """Follows one log file; `poll()` returns the complete lines added since the last poll."""

    def __init__(self, path: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                 start_at_end: bool = True, max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
                 max_skip_bytes: int = DEFAULT_MAX_SKIP_BYTES):
        self.path = str(path)
        self.start_at_end = start_at_end
        self.max_read_bytes = max(1, int(max_read_bytes))
        self.max_skip_bytes = max(0, int(max_skip_bytes))
        self.error = ""  # why the last poll could not read the file ("" when fine)
        self.error_kind = ""  # permission | not_a_file | io
        self._splitter = _LineSplitter(max_line_bytes)
        self._fh: BinaryIO | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the open file
        self._offset = 0
        self._line_no = 0  # lines returned from the open file so far (numbers are 1-based)
        # Where "the end" was when tailing began: only that file's history is skipped.
        self._skip: tuple[int, int, int] | None = None  # (st_dev, st_ino, size)
        if start_at_end:
            try:
                st = os.stat(self.path)
                if stat.S_ISREG(st.st_mode):
                    self._skip = (st.st_dev, st.st_ino, st.st_size)
            except OSError:
                pass
        self._open()  # hold the file from now on, so lines written before a deletion survive
        self.error = self.error_kind = ""  # faults are reported by poll()

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
        self._fh = None
        self._identity = None

    def take_cut_lines(self) -> int:
        """Lines cut at max_line_bytes since the last call."""
        n, self._splitter.cut_lines = self._splitter.cut_lines, 0
        return n

    def poll(self) -> list[tuple[int, str]]:
        self.error = ""
        self.error_kind = ""
        out: list[tuple[int, str]] = []
        try:
            self._poll(out)
        except OSError as exc:  # the file went bad between checks: report, keep what was read
            self._fail(exc)
        except Exception as exc:  # never let a tailer bug stop sampling
            self.error, self.error_kind = f"{self.path}: {exc}", "io"
        return out

    # -- internals

    def _fail(self, exc: OSError) -> None:
        kind = _classify_os_error(exc)
        if kind == "missing":  # deleted: not an error, wait for it to come back
            return
        reason = exc.strerror or type(exc).__name__
        self.error, self.error_kind = f"{self.path}: {reason}", kind
        self.close()

    def _open(self) -> bool:
        try:
            fh = open_regular(self.path)
        except OSError as exc:
            self._fail(exc)
            return False
        st = os.fstat(fh.fileno())
        self._fh = fh
        self._identity = (st.st_dev, st.st_ino)
        self._splitter.reset()
        self._line_no = 0
        # Skip the history only of the file found at start-up; a file that appears later
        # (created, rotated in) is all new.
        skip, self._skip = self._skip, None
        same = skip is not None and skip[:2] == self._identity and skip[2] <= st.st_size
        self._offset = skip[2] if skip is not None and same else 0
        fh.seek(self._offset)
        return True

    def _poll(self, out: list[tuple[int, str]]) -> None:
        budget = self.max_read_bytes
        if self._fh is None and not self._open():
            return
        assert self._fh is not None
        if os.fstat(self._fh.fileno()).st_size < self._offset:  # truncated in place
            self._restart_at_zero()
        budget -= self._read(out, budget)
        if budget <= 0:
            return  # more to read; rotation is looked at once this file is drained
        try:
            st = os.stat(self.path)
            current = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            current = None
        if current == self._identity:
            return
        # Rotated or deleted, and the old file is drained: its unterminated last line is complete.
        for raw in self._splitter.finish():
            self._line_no += 1
            out.append((self._line_no, _decode(raw)))
        self.close()
        if current is not None and self._open():
            self._read(out, budget)

    def _restart_at_zero(self) -> None:
        assert self._fh is not None
        self._fh.seek(0)
        self._offset = 0
        self._line_no = 0
        self._splitter.reset()

    def _read(self, out: list[tuple[int, str]], budget: int) -> int:
        """Read up to `budget` bytes of the open file into `out`; returns bytes read (the
        skipped rest of an over-long line is not counted: it is never kept)."""
        assert self._fh is not None
        total = 0
        while total < budget:
            if self._splitter.discarding:
                self._skip_rest_of_line()
            # In chunks, so that a line cut early in one is skipped, not read through the budget.
            data = self._fh.read(min(budget - total, SKIP_CHUNK_BYTES)) or b""
            self._offset += len(data)
            total += len(data)
            for raw in self._splitter.feed(data):
                self._line_no += 1
                out.append((self._line_no, _decode(raw)))
            if not data:
                break
        return total

    def _skip_rest_of_line(self) -> None:
        """Move past the rest of a cut line up to its newline (left for the splitter to end the
        line with), looking at most max_skip_bytes this poll, one bounded chunk at a time."""
        assert self._fh is not None
        left = self.max_skip_bytes
        while left > 0:
            chunk = self._fh.read(min(SKIP_CHUNK_BYTES, left)) or b""
            if not chunk:
                return
            newline = chunk.find(b"\n")
            if newline >= 0:
                self._offset += newline
                self._fh.seek(self._offset)
                return
            self._offset += len(chunk)
            left -= len(chunk)


def iter_file_lines(fh: BinaryIO, max_bytes: int, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                    chunk_bytes: int = 1024 * 1024) -> Iterator[tuple[int, str]]:
    """(line number, text) of a whole file, reading at most `max_bytes` of it; over-long lines
    are cut. The caller can compare fh.tell() with max_bytes to know whether it stopped early."""
    splitter = _LineSplitter(max_line_bytes)
    line_no = 0
    left = max(0, int(max_bytes))
    while left > 0:
        data = fh.read(min(chunk_bytes, left))
        if not data:
            break
        left -= len(data)
        for raw in splitter.feed(data):
            line_no += 1
            yield line_no, _decode(raw)
    for raw in splitter.finish():
        line_no += 1
        yield line_no, _decode(raw)


class LogSource:
    """The `logs` source: tails server logs and reports the OOM messages found in each tick's
    new lines."""

    name = SOURCE
    needs: tuple[str, ...] = ()
    gives = (LOG_EVENTS,)

    def __init__(self, paths: list[str] | tuple[str, ...], *,
                 max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, start_at_end: bool = True,
                 max_read_bytes: int = DEFAULT_MAX_READ_BYTES, max_events: int = MAX_EVENTS_PER_TICK):
        self.paths = tuple(dict.fromkeys(str(p) for p in paths))  # unique, in order
        self._tailers = {p: LogTailer(p, max_line_bytes, start_at_end, max_read_bytes)
                         for p in self.paths}
        self._parsers = {p: OomParser(p) for p in self.paths}
        self.max_events = max(1, int(max_events))
        self._dropped: dict[str, int] = {}  # budget -> count, for the tick being sampled

    def collect(self, snapshot: Snapshot) -> Reading:
        events, errors = self.sample(now=snapshot.timestamp)
        dropped = tuple((budget, n) for budget, n in self._dropped.items() if n)
        return Reading(replace(snapshot, log_events=events), up=not errors, errors=errors, dropped=dropped)

    def sample(self, now: float | None = None) -> tuple[tuple[OomMessage, ...], tuple[SourceError, ...]]:
        """New messages since the last call (stamped with `now` when given; at most max_events,
        the first ones) and this tick's faults."""
        events: list[OomMessage] = []
        errors: list[SourceError] = []
        found = cut = 0
        for path in self.paths:
            tailer, parser = self._tailers[path], self._parsers[path]
            lines = tailer.poll()
            for line_no, text in lines:
                new = parser.feed(line_no, text)
                found += len(new)
                events += new[:self.max_events - len(events)]
            if not lines:
                # The log went quiet: a message still open (waiting for a continuation line
                # that may never come) is finished now rather than held back.
                new = parser.flush()
                found += len(new)
                events += new[:self.max_events - len(events)]
            cut += tailer.take_cut_lines()
            if tailer.error:
                errors.append(SourceError(SOURCE, tailer.error_kind, tailer.error))
            if parser.faults:
                errors.append(SourceError(SOURCE, "parse_error",
                                          f"{path}: {counted(parser.faults, 'line')} could not be parsed"))
                parser.faults = 0
        self._dropped = {"log_events": found - len(events), "log_lines": cut}
        if now is not None:
            events = [replace(e, timestamp=now) for e in events]
        return tuple(events), tuple(errors)

    def close(self) -> None:
        for tailer in self._tailers.values():
            tailer.close()
