"""Flight recorder: when something goes wrong, keep the last hour of samples on disk.

The daemon calls `FlightRecorder.observe(state, window)` after every tick. The analysis has
already decided what changed at that tick (`Analysis.transitions`, see
analysis/transitions.py); each transition is a trigger:
  oom        the tick read an out-of-memory event from a log
  critical   a finding became critical
  vllm_exit  a serving process left a GPU that stayed up

A recording is the raw snapshots of the last `window_seconds` before the trigger
(`window(since)`: the analysis history's raw tier) and of the `tail_seconds` after it, written
as a trace CSV (`trace.write_csv`, readable by `analyze`), named
`gpumem-<UTC time of the trigger's tick>-<trigger>.csv`. The tail is the aftermath the live
detectors need to conclude: the memory a dead server leaves behind (stale memory), a restart
that gets less, the OOM that follows a leak. A trigger that arrives during the tail joins the
recording (the file names both) and extends the tail to `tail_seconds` after it, but never
past `max(tail_seconds, window_seconds)` after the first trigger, so a flapping trigger
cannot postpone the file forever. On close (shutdown) a recording still in its tail is written
as it stands. In the file, the GPU-level rows of each triggering tick carry the trigger in the
`trigger` column, so the file states its triggers and their times (`analyze` prints them).

Writing happens on one background thread so sampling never waits for the disk: observe() only
collects references to immutable snapshots. There is at most one write in progress and one
pending; a recording finished while one is pending merges into it (its file then names both
triggers). Each trigger kind records at most once per `debounce_seconds` of clock time. Old
recordings are deleted, oldest first, to stay within `max_files` and `max_total_bytes` (the
file just written is kept).

The directory should belong to the exporter's user and be writable by nobody else (mode 0700,
or 0750 for a group that reads the traces); the recorder creates it 0700 when it is missing.
Even so nothing planted in it is followed: each trace is written to a new temporary file of
an unpredictable name opened with O_CREAT|O_EXCL|O_NOFOLLOW and renamed over a name that did
not exist, and rotation only deletes regular files (never link targets) with our names.

Nothing here raises into the daemon: failures (disk full, no permission, the directory is
not a directory) are counted by kind in `stats()` for the exposition.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from types import MappingProxyType

from ..model import TRANSITIONS, RecorderStats, Snapshot, State
from ..postmortem.trace import write_csv

log = logging.getLogger("exporter.reactions.recorder")

TRIGGERS = TRANSITIONS
# Our own file names only: rotation never deletes anything else in the directory.
RECORDING = re.compile(r"^gpumem-\d{8}T\d{6}Z-[a-z_+]+(?:-\d+)?\.csv$")
# trace.write_csv's temporary files: <name>.tmp.<pid>.<random>
LEFTOVER = re.compile(r"^gpumem-\d{8}T\d{6}Z-[a-z_+]+(?:-\d+)?\.csv\.tmp\.(\d+)\.\w+$")

_ERRNO_KINDS = {
    errno.ENOSPC: "disk_full", errno.EDQUOT: "disk_full", errno.EFBIG: "disk_full",
    errno.EACCES: "permission", errno.EPERM: "permission", errno.EROFS: "read_only",
    errno.ENOTDIR: "not_a_directory", errno.EEXIST: "not_a_directory",
    errno.ENOENT: "not_found", errno.EIO: "io", errno.ELOOP: "symlink",
}


# A recording in its tail holds references to at most this many snapshots; past it, it is
# written at once (a tail of days at a short interval must not grow memory without bound).
MAX_RECORDING_SAMPLES = 100_000


@dataclass
class _Job:
    triggers: list[str]
    at: float  # clock time of the first tick that triggered
    snapshots: list[Snapshot]
    marks: dict[float, list[str]] = field(default_factory=dict)  # tick time -> its triggers
    until: float = 0.0  # the tail ends at the first tick at or after this time

    def mark(self, at: float, fired: list[str]) -> None:
        self.triggers += [t for t in fired if t not in self.triggers]
        have = self.marks.setdefault(at, [])
        have += [t for t in fired if t not in have]

    def merge(self, newer: _Job) -> None:
        """Fold a later recording into this one (a write still queued): both files' samples
        and triggers in one file, named after the later one (the `trigger` column keeps
        each tick's time)."""
        self.at = newer.at
        for at, fired in newer.marks.items():
            self.mark(at, fired)
        by_time = {s.timestamp: s for s in self.snapshots}
        by_time.update((s.timestamp, s) for s in newer.snapshots)
        self.snapshots = [by_time[t] for t in sorted(by_time)]


def error_kind(exc: BaseException) -> str:
    """A short stable token for a failure, for the errors counter."""
    if isinstance(exc, OSError):
        return _ERRNO_KINDS.get(exc.errno or 0, "io")
    return "exception"


class FlightRecorder:
    def __init__(self, directory: str, window_seconds: float = 3600.0, max_files: int = 20,
                 max_total_bytes: int = 512 << 20, debounce_seconds: float = 300.0,
                 now: Callable[[], float] = time.time,
                 writer: Callable[[Iterable[Snapshot], str], None] | None = None,
                 tail_seconds: float = 0.0):
        """tail_seconds: how long to keep recording after a trigger (the configuration's
        `recorder.tail_seconds`, default 300; 0 here writes at the trigger). writer: None
        writes with trace.write_csv, marking the triggering ticks; a replacement (tests make
        writing slow) is called as writer(snapshots, path)."""
        if window_seconds <= 0 or debounce_seconds < 0 or tail_seconds < 0:
            raise ValueError("recorder: window_seconds must be positive, debounce_seconds and "
                             "tail_seconds >= 0")
        if max_files < 1 or max_total_bytes < 1:
            raise ValueError("recorder: max_files and max_total_bytes must be at least 1")
        self.directory = str(directory)
        self.window_seconds = float(window_seconds)
        self.max_files = int(max_files)
        self.max_total_bytes = int(max_total_bytes)
        self.debounce_seconds = float(debounce_seconds)
        self.tail_seconds = float(tail_seconds)
        self.now = now  # stamps last_write_timestamp (pass the daemon clock's now)
        self.writer = writer  # None: trace.write_csv; replaceable so tests can make writing slow

        # Trigger state, touched only by the sampling thread (observe).
        self._last_timestamp: float | None = None
        self._last_fired: dict[str, float] = {}

        # Shared with the worker, under _lock.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: _Job | None = None
        self._recording: _Job | None = None  # triggered, collecting its tail
        self._busy = False
        self._closed = False
        self._writes = 0
        self._errors: Counter[str] = Counter()
        self._triggers: Counter[str] = Counter()
        self._debounced: Counter[str] = Counter()
        self._coalesced = 0
        self._rotated = 0
        self._last_write: float | None = None
        self._last_file = ""
        self._thread = threading.Thread(target=self._work, name="flight-recorder", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ sampling thread
    def observe(self, state: State | None, window: Callable[[float], Sequence[Snapshot]]) -> None:
        """Look at a published State; on a transition, queue a recording of `window(since)`
        (the raw snapshots with timestamp >= since, oldest first). Never raises, never waits
        for the disk."""
        try:
            self._observe(state, window)
        except Exception:  # a bug here must not stop sampling; it shows in errors_total
            log.exception("flight recorder failed to observe a tick")
            with self._lock:
                self._errors["observe"] += 1

    def _observe(self, state: State | None,
                 window: Callable[[float], Sequence[Snapshot]]) -> None:
        if state is None or state.snapshot is None or state.analysis is None:
            return  # nothing sampled or analysed yet: nothing can have changed
        snapshot, analysis = state.snapshot, state.analysis
        now = snapshot.timestamp
        if self._last_timestamp is not None and now <= self._last_timestamp:
            return  # the same State again (a failed tick republishes the old one)
        self._last_timestamp = now
        fired = [t for t in analysis.transitions if self._admit(t, now)]
        with self._lock:
            job = self._recording
        if job is not None:  # in the tail: take the ticks since the last one taken
            last = job.snapshots[-1].timestamp if job.snapshots else job.at
            job.snapshots = job.snapshots + [s for s in window(last) if s.timestamp > last]
        elif fired:
            job = _Job([], now, list(window(now - self.window_seconds)), until=now + self.tail_seconds)
        else:
            return
        if fired:
            job.mark(now, fired)
            job.until = max(job.until, min(now + self.tail_seconds,
                                           job.at + max(self.tail_seconds, self.window_seconds)))
        done = now >= job.until or len(job.snapshots) >= MAX_RECORDING_SAMPLES
        with self._lock:
            for t in fired:
                self._triggers[t] += 1
            if self._closed:
                self._recording = None
                return
            self._recording = None if done else job
            if done:
                self._queue(job)

    def _queue(self, job: _Job) -> None:
        """Hand a finished recording to the worker (under _lock)."""
        if self._pending is not None:
            # A write is queued but not started: one file with both triggers and the
            # samples of both instead of two nearly identical files.
            self._pending.merge(job)
            self._coalesced += len(job.triggers)
        else:
            self._pending = job
        self._wake.notify_all()  # the worker and any flush() share this condition

    def _admit(self, trigger: str, now: float) -> bool:
        """Debounce: at most one recording per trigger kind per debounce_seconds."""
        last = self._last_fired.get(trigger)
        if last is not None and now - last < self.debounce_seconds:
            with self._lock:
                self._debounced[trigger] += 1
            return False
        self._last_fired[trigger] = now
        return True

    # ------------------------------------------------------------------ worker thread
    def _work(self) -> None:
        while True:
            with self._lock:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                if self._pending is None:
                    return  # closed and nothing left to write
                job, self._pending = self._pending, None
                self._busy = True
            try:
                self._write(job)
            finally:
                with self._lock:
                    self._busy = False
                    self._wake.notify_all()

    def _write(self, job: _Job) -> None:
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            path = self._path_for(job)
            if self.writer is None:
                write_csv(job.snapshots, path, triggers=job.marks)
            else:
                self.writer(job.snapshots, path)
        except Exception as exc:
            kind = error_kind(exc)
            log.warning("flight recorder could not write to %s (%s): %s", self.directory, kind,
                        getattr(exc, "strerror", None) or exc)
            with self._lock:
                self._errors[kind] += 1
            return
        with self._lock:
            self._writes += 1
            self._last_write = self.now()
            self._last_file = path
        log.warning("flight recorder wrote %s (%d samples, trigger %s at %s)", path,
                    len(job.snapshots), "+".join(job.triggers),
                    datetime.fromtimestamp(job.at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        self._rotate(keep=os.path.basename(path))

    def _path_for(self, job: _Job) -> str:
        stamp = datetime.fromtimestamp(job.at, timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        base = f"gpumem-{stamp}-{'+'.join(job.triggers)}"
        path = os.path.join(self.directory, base + ".csv")
        n = 1
        while os.path.lexists(path):  # same second, same trigger (debounce 0): never overwrite
            path = os.path.join(self.directory, f"{base}-{n}.csv")
            n += 1
        return path

    def _rotate(self, keep: str) -> None:
        """Delete the oldest recordings beyond max_files / max_total_bytes, and temporary
        files a crashed process left behind."""
        try:
            files = []
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    leftover = LEFTOVER.match(entry.name)
                    if leftover and int(leftover.group(1)) != os.getpid():
                        if not entry.is_dir(follow_symlinks=False):  # a file or a link; never a directory
                            _remove(entry.path)
                    elif RECORDING.match(entry.name) and entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        files.append((st.st_mtime, entry.name, st.st_size))
            files.sort()  # oldest first (name breaks ties: it holds the time)
            count, total = len(files), sum(size for _, _, size in files)
            removed = 0
            for _, name, size in files:
                if count <= self.max_files and total <= self.max_total_bytes:
                    break
                if name == keep:
                    continue
                os.unlink(os.path.join(self.directory, name))
                count -= 1
                total -= size
                removed += 1
        except OSError as exc:
            log.warning("flight recorder could not rotate %s: %s", self.directory,
                        exc.strerror or exc)
            with self._lock:
                self._errors["rotate"] += 1
            return
        with self._lock:
            self._rotated += removed

    # ------------------------------------------------------------------ any thread
    def stats(self) -> RecorderStats:
        with self._lock:
            return RecorderStats(
                writes_total=self._writes, errors_total=MappingProxyType(dict(self._errors)),
                triggers_total=MappingProxyType(dict(self._triggers)),
                debounced_total=MappingProxyType(dict(self._debounced)),
                coalesced_total=self._coalesced, rotated_total=self._rotated,
                last_write_timestamp=self._last_write, last_file=self._last_file)

    @property
    def recording(self) -> bool:
        """A trigger fired and its tail is still being collected."""
        with self._lock:
            return self._recording is not None

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until nothing is pending or being written; False on timeout. A recording
        still in its tail is not waited for (close() writes it)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._wake.wait(left)
            return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is pending, a recording still in its tail included (a recording of the
        last moments is worth the wait), then stop the worker."""
        with self._lock:
            if self._recording is not None and not self._closed:
                self._queue(self._recording)
                self._recording = None
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout)


def _remove(path: str) -> None:
    """A leftover temporary file (or a link: unlink never follows it); one that cannot be
    removed is left, never a reason to stop rotating."""
    try:
        os.unlink(path)
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):
            log.warning("flight recorder could not remove leftover %s: %s", path, exc.strerror or exc)


__all__ = ["TRIGGERS", "FlightRecorder", "RecorderStats", "error_kind"]
