"""Allocation history on demand (`allocator.history`, off by default; docs/probe.md).

When a leak or fragmentation finding is first raised for a process that has the allocator
probe, ask that probe to record PyTorch's allocation history for a while and dump it into the
probe directory, where an engineer opens it in https://pytorch.org/memory_viz. Like the flight
recorder this is a reaction, outside the analysis: `observe()` looks at each published State
after the tick and never raises into the daemon.

The request is the probe's control file, `gpumem-<pid namespace inode>-<pid>.control.json`
(the probe file's own identity), written the way post-mortem traces are (postmortem/atomic.py): a new
temporary file (O_EXCL|O_NOFOLLOW) renamed over the name, mode 0644 for the probe's user, in the
directory opened without following a link (a probe directory that is a symlink is refused:
`symlink`).
At most one request per process (PID and start time) per `min_interval_seconds`. The probe
bounds and validates what it reads and records at most once per 15 minutes whoever asks;
what it did comes back in its file (`AllocatorStats.history_*`). The exporter removes its
control file once the probe answered, or after the recording should have ended (the probe
cannot remove another user's file in a sticky directory).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import MappingProxyType

from gpumem_probe.schema import control_name, request

from ..model import AllocHistoryStats, ProcessSample, State
from ..postmortem.atomic import atomic_file
from .recorder import error_kind

log = logging.getLogger("exporter.reactions.alloc_history")

KINDS = frozenset({"leak", "fragmentation"})  # findings that ask for a recording
MAX_TRACKED = 4096  # processes remembered for the interval; requests pending an answer
ANSWER_GRACE_SECONDS = 300.0  # after record_seconds, a control file nobody answered is removed


@dataclass
class _Pending:
    request_id: str
    name: str
    deadline: float


class HistoryRequester:
    def __init__(self, directory: str, record_seconds: float = 120.0, max_entries: int = 100_000,
                 min_interval_seconds: float = 3600.0, now: Callable[[], float] | None = None):
        self.directory = str(directory)
        self.record_seconds = float(record_seconds)
        self.max_entries = int(max_entries)
        self.min_interval = float(min_interval_seconds)
        self._now = now
        # Active findings already acted on (asked, or refused by the interval): each is acted on
        # once, at the first tick it is active for a probed process.
        self._handled: set[tuple[str, str | None, int | None, str]] = set()
        self._asked: dict[tuple[int, float | None], float] = {}  # process identity -> last request
        self._pending: dict[str, _Pending] = {}  # request id -> its control file
        self._requests: Counter[str] = Counter()
        self._results: Counter[str] = Counter()

    def stats(self) -> AllocHistoryStats:
        return AllocHistoryStats(requests_total=MappingProxyType(dict(self._requests)),
                                 results_total=MappingProxyType(dict(self._results)))

    def observe(self, state: State | None) -> None:
        """After a tick: request for findings raised at it, collect the probes' answers."""
        try:
            self._observe(state)
        except Exception:
            log.exception("allocation history: failed to observe a tick")
            self._requests["error"] += 1

    def _observe(self, state: State | None) -> None:
        if state is None or state.snapshot is None or state.analysis is None:
            return
        now = self._now() if self._now is not None else state.snapshot.timestamp
        processes = {(g.index, p.pid): p for g in state.snapshot.gpus for p in g.processes}
        self._collect(processes.values(), now)
        handled = set()
        for f in state.analysis.findings:
            if f.kind not in KINDS or f.pid is None:
                continue
            if f.key in self._handled:
                handled.add(f.key)
                continue
            p = processes.get((f.gpu or "", f.pid))
            if p is not None and p.allocator is not None and p.allocator.probe_pid is not None:
                self._request(p, f.kind, now)
                handled.add(f.key)
        self._handled = handled  # a finding that clears and is raised again is new

    def _request(self, p: ProcessSample, why: str, now: float) -> None:
        last = self._asked.get(p.identity)
        if last is not None and now - last < self.min_interval:
            self._requests["rate_limited"] += 1
            return
        if len(self._asked) >= MAX_TRACKED:  # forget the processes asked longest ago
            self._asked = {k: t for k, t in self._asked.items() if now - t < self.min_interval}
            if len(self._asked) >= MAX_TRACKED:
                self._requests["rate_limited"] += 1
                return
        self._asked[p.identity] = now
        stats = p.allocator
        assert stats is not None and stats.probe_pid is not None
        request_id = f"{int(now)}-{p.pid}"
        name = control_name(stats.probe_pid_ns, stats.probe_pid)
        body = request(request_id, self.record_seconds, self.max_entries, why)
        try:
            dir_fd = self._open_directory()
            try:
                with atomic_file(name, mode=0o644, dir_fd=dir_fd, encoding="utf-8") as fh:
                    fh.write(json.dumps(body))
            finally:
                os.close(dir_fd)
        except OSError as exc:
            kind = error_kind(exc)
            log.warning("allocation history: cannot ask pid %d (%s): %s", p.pid, kind, exc.strerror or exc)
            self._requests[kind] += 1
            return
        log.warning("allocation history: asked pid %d (%s) to record %g s (%s finding)", p.pid, p.name,
                    self.record_seconds, why)
        self._requests["written"] += 1
        if len(self._pending) < MAX_TRACKED:
            self._pending[request_id] = _Pending(request_id, name,
                                                 now + self.record_seconds + ANSWER_GRACE_SECONDS)

    def _collect(self, processes: Iterable[ProcessSample], now: float) -> None:
        """Count the probes' answers to our requests; remove answered or overdue control files."""
        if not self._pending:
            return
        answered: dict[str, str] = {}
        for p in processes:
            a = p.allocator
            if a is not None and a.history_request in self._pending and a.history_state in ("done", "failed"):
                answered[a.history_request] = a.history_state
        for request_id, pending in list(self._pending.items()):
            state = answered.get(request_id)
            if state is None and now < pending.deadline:
                continue
            self._results[state or "unanswered"] += 1
            del self._pending[request_id]
            self._remove(pending.name)

    def _open_directory(self) -> int:
        """The probe directory, never through a link: a path that is (or was swapped for) a
        symlink is refused (ELOOP), so a control file never lands in a link's target."""
        try:
            return os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except NotADirectoryError:  # what Linux says of a link opened with both flags
            if os.path.islink(self.directory):
                raise OSError(errno.ELOOP, "is a symbolic link", self.directory) from None
            raise

    def _remove(self, name: str) -> None:
        """Our control file, if still there and still a plain file (never a link's target)."""
        path = os.path.join(self.directory, name)
        try:
            dir_fd = self._open_directory()
            try:
                if stat.S_ISREG(os.lstat(name, dir_fd=dir_fd).st_mode):
                    os.unlink(name, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
        except FileNotFoundError:
            pass  # the probe took it
        except OSError as exc:
            log.warning("allocation history: cannot remove %s: %s", path, exc.strerror or exc)
