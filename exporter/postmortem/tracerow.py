"""What both trace formats become: `TraceRow`s (one observation each), the value parsers they
share, and `TraceError`, the one error a bad trace gives (its message names file:line or the
JSON result, and what is wrong).

The formats: tracecsv.py (the trace CSV, read and written), promtrace.py (Prometheus range-query
JSON); trace.py groups the rows of one or more files into Snapshots.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..model import AllocatorStats, HostMemory, OomMessage, VllmSample

_T = TypeVar("_T")

# What `analyze` takes from its trace files together, and what one trace the daemon writes may
# hold (tracecsv.write_csv keeps the newest ticks that fit): rows, and distinct sampling times.
# What analyze costs at these limits is measured by bench/trace_cost.py (bench/README.md).
MAX_ROWS = 1_000_000
MAX_TICKS = 100_000


class TraceError(ValueError):
    """A trace file that cannot be read as a trace; the message names file:line."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One observation: a process on a GPU (pid set) or a GPU itself (pid None)."""

    origin: str  # "file:line" for error messages
    timestamp: float
    gpu: str
    pid: int | None = None
    process: str = ""
    used_bytes: int | None = None
    total_bytes: int | None = None
    host_rss_bytes: int | None = None
    role: str = ""
    uuid: str = ""
    start_time: float | None = None
    unified: bool | None = None
    container: str = ""
    pod: str = ""
    namespace: str = ""
    endpoint: str = ""
    host: HostMemory | None = None
    gpu_error: str = ""
    trigger: str = ""
    vllm: tuple[VllmSample, ...] | None = None  # None: the row does not say
    oom_events: tuple[OomMessage, ...] = ()
    allocator: AllocatorStats | None = None
    # Which run of which exporter on which host wrote the row (tracecsv.py); "" = not said.
    hostname: str = ""
    boot_id: str = ""
    exporter_run: str = ""
    dropped: tuple[tuple[str, int], ...] = ()  # (cell, count) the writer left out of this tick


# ---------------------------------------------------------------- text

# C0 and C1 controls and DEL: terminal escapes, and bytes no report or spreadsheet should get.
_CONTROLS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def clean_text(text: str) -> str:
    """Text from outside with its control characters removed (a tab becomes a space)."""
    if text.isprintable():  # the usual case, checked in C
        return text
    return _CONTROLS.sub("", text.replace("\t", " "))


# ---------------------------------------------------------------- values

def parse_float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} is not a number: {text[:40]!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{what} is not finite: {text[:40]!r}")
    return value


def parse_bytes(text: str, what: str) -> int:
    """A non-negative integer byte count; "1.5e9" is accepted when it is a whole number."""
    try:
        value = int(text)
    except ValueError:
        f = parse_float(text, what)
        if f != int(f):
            raise ValueError(f"{what} is not a whole number of bytes: {text[:40]!r}") from None
        value = int(f)
    if value < 0:
        raise ValueError(f"{what} is negative: {text[:40]!r}")
    return value


def parse_pid(text: str) -> int:
    try:
        pid = int(text)
    except ValueError:
        raise ValueError(f"pid is not an integer: {text[:40]!r}") from None
    if pid <= 0:
        raise ValueError(f"pid must be positive: {text[:40]!r}")
    return pid


_TRUE = {"1", "true", "yes", "y", "t"}
_FALSE = {"0", "false", "no", "n", "f"}


def parse_bool(text: str, what: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{what} is not a boolean: {text[:40]!r}")


def optional(cell: str | None, parse: Callable[[str, str], _T], what: str) -> _T | None:
    cell = (cell or "").strip()
    return None if cell == "" else parse(cell, what)


__all__ = ["MAX_ROWS", "MAX_TICKS", "TraceError", "TraceRow", "clean_text", "optional",
           "parse_bool", "parse_bytes", "parse_float", "parse_pid"]
