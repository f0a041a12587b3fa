"""On-demand allocation history: when asked through a control file, record PyTorch's allocation
history for a bounded time and dump it where the probe file is, for PyTorch's memory
visualiser (https://pytorch.org/memory_viz).

The request is a small JSON file addressed to this process by the probe file's own identity,
`gpumem-<pid namespace inode>-<pid>.control.json`, written (by the exporter, see
docs/probe.md) into GPUMEM_PROBE_DIR:

    {"request_id": "1700000000-57", "record_seconds": 120, "max_entries": 100000}

Each poll looks at it with one `lstat` (nothing there: the usual case, nothing else done).
A request is read bounded, never through a link, validated, and refused unless within the
hard caps below; a refused one is counted in the probe file's `errors` and not looked at
again until it changes. Recording is `torch.cuda.memory._record_memory_history(max_entries=N)`
with Python stacks only; after `record_seconds` the probe takes `torch.cuda.memory._snapshot()`,
stops recording and pickles the snapshot (what `torch.cuda.memory._dump_snapshot` writes) to
`gpumem-<pid namespace inode>-<pid>-<request_id>.pickle`, mode 0600, atomically. At most one
recording per MIN_GAP_SECONDS per process, whoever asks. The outcome is the probe file's
`history` object. Nothing here raises into the process.
"""
from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

from .files import ProbeFile
from .schema import MAX_CONTROL_BYTES, Refused, Request, control_name, dump_name, parse_request

ENV_HISTORY = "GPUMEM_PROBE_HISTORY"  # "0": refuse every request
MIN_GAP_SECONDS = 900.0  # between the starts of two recordings of one process
MAX_DUMP_BYTES = 1 << 30  # a dump that would be larger is abandoned
KEEP_DUMPS = 2  # this process's own dumps kept; older ones are removed when a new one is written


def enabled_from(text: str | None) -> bool:
    return (text or "").strip().lower() not in ("0", "false", "no", "off")


class _TooLarge(Exception):
    pass


class _BoundedWriter:
    """A binary file object over a descriptor that refuses to grow past `limit` bytes."""

    def __init__(self, fd: int, limit: int):
        self.fd, self.left = fd, limit

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        if view.nbytes > self.left:
            raise _TooLarge()
        self.left -= view.nbytes
        while view:
            view = view[os.write(self.fd, view):]
        return len(data)


class History:
    """The probe's allocation-history state: `step()` once per poll, after CUDA is up and
    under the probe's lock; `state` goes into the probe file."""

    def __init__(self, enabled: bool, clock: Callable[[], float], errors: dict[str, int],
                 max_dump_bytes: int = MAX_DUMP_BYTES):
        self.enabled = enabled
        self.state: dict[str, Any] | None = None  # the probe file's `history`
        self._clock = clock
        self._errors = errors
        self._max_dump_bytes = max_dump_bytes
        self._active: tuple[Request, float] | None = None  # recording: (request, started at)
        self._last_start: float | None = None
        self._seen: tuple[int, int, int] | None = None  # the control file last acted on
        self._handled: str | None = None  # its request id
        self._dumps: list[str] = []

    def step(self, file: ProbeFile, pid_ns: int, pid: int, cuda: Any) -> None:
        try:
            if self._active is not None:
                request, started = self._active
                if self._clock() - started >= request.record_seconds:
                    self._finish(file, pid_ns, pid, cuda)
                return  # one recording at a time: a new request waits
            self._look(file, control_name(pid_ns, pid), cuda)
        except Exception:
            self._errors["history"] += 1

    # -- the control file -----------------------------------------------------------------
    def _look(self, file: ProbeFile, control: str, cuda: Any) -> None:
        signature = file.signature(control)  # the one lstat of the usual poll
        if signature is None or signature == self._seen:
            return
        self._seen = signature
        try:
            data = file.read_small(control, MAX_CONTROL_BYTES)
            if data is None:
                return
            request = parse_request(data)
        except (OSError, Refused) as exc:
            self._errors["control"] += 1
            self.state = {"state": "failed", "reason": "invalid_request",
                          "detail": str(getattr(exc, "strerror", None) or exc)[:120]}
            self._remove(file, control)
            return
        if request.request_id == self._handled:
            return  # done already; its writer has not removed it yet
        self._handled = request.request_id
        self._remove(file, control)
        now = self._clock()
        if not self.enabled:
            self._fail(request, "disabled")
        elif self._last_start is not None and now - self._last_start < MIN_GAP_SECONDS:
            self._fail(request, "too_soon")
        else:
            self._start(request, now, cuda)

    def _remove(self, file: ProbeFile, control: str) -> None:
        try:
            file.unlink(control)
        except OSError:  # another user's file in a sticky directory: its writer removes it
            pass

    # -- recording ------------------------------------------------------------------------
    def _start(self, request: Request, now: float, cuda: Any) -> None:
        record = getattr(getattr(cuda, "memory", None), "_record_memory_history", None)
        if record is None or not callable(getattr(cuda.memory, "_snapshot", None)):
            self._errors["history_unsupported"] += 1
            self._fail(request, "unsupported")
            return
        try:
            # torch >= 2.1. Python stacks only: C++ stacks cost more per allocation and take
            # long to symbolise at the snapshot.
            record(enabled="all", context="all", stacks="python", max_entries=request.max_entries)
        except TypeError:  # torch 2.0's record_memory_history(enabled: bool, ...) differs
            self._errors["history_unsupported"] += 1
            self._fail(request, "unsupported")
            return
        except Exception:
            self._errors["history"] += 1
            self._stop(cuda)
            self._fail(request, "record_failed")
            return
        self._last_start = now
        self._active = (request, now)
        self.state = {"request_id": request.request_id, "state": "recording", "started_at": now,
                      "record_seconds": request.record_seconds, "max_entries": request.max_entries}

    def _stop(self, cuda: Any) -> None:
        try:
            cuda.memory._record_memory_history(enabled=None)
        except Exception:
            self._errors["history"] += 1

    def _finish(self, file: ProbeFile, pid_ns: int, pid: int, cuda: Any) -> None:
        assert self._active is not None
        request, started = self._active
        self._active = None
        try:
            snapshot = cuda.memory._snapshot()
        except Exception:
            self._errors["history"] += 1
            self._stop(cuda)
            self._fail(request, "snapshot_failed", started)
            return
        self._stop(cuda)  # before pickling: the dump is what was recorded, nothing more
        name = dump_name(pid_ns, pid, request.request_id)
        try:
            size = file.write_as(name, lambda fd: pickle.dump(snapshot, _BoundedWriter(fd, self._max_dump_bytes)),
                                 0o600)  # holds the serving process's stack traces
        except _TooLarge:
            self._errors["history"] += 1
            self._fail(request, "too_large", started)
            return
        except Exception:
            self._errors["history"] += 1
            self._fail(request, "write_failed", started)
            return
        self._dumps = [d for d in self._dumps if d != name] + [name]
        while len(self._dumps) > KEEP_DUMPS:
            try:
                file.unlink(self._dumps.pop(0))
            except OSError:
                pass
        self.state = {"request_id": request.request_id, "state": "done", "started_at": started,
                      "finished_at": self._clock(), "record_seconds": request.record_seconds,
                      "max_entries": request.max_entries, "file": name, "bytes": size}

    def _fail(self, request: Request, reason: str, started: float | None = None) -> None:
        self.state = {"request_id": request.request_id, "state": "failed", "reason": reason,
                      "started_at": started, "finished_at": self._clock()}
