"""When a log line was written, from its own prefix, for the OOM events `analyze --log` lists.

Read formats (the first one a line matches):
- a date with the year: `2025-11-22 10:20:00,100` (Python logging), `2025-11-22T10:20:00.1Z`
  (RFC 3339, an offset honoured), as most loggers and `kubectl logs --timestamps` write;
- vLLM's own formatter: `INFO 11-22 10:05:14` (`%m-%d %H:%M:%S`, no year);
- syslog / journal: `Nov 22 10:30:01` (no year).
A time without an offset is taken as UTC (vLLM logs the server's local time: on a host not
on UTC, compare with the offset in mind). A time without a year gets the year that puts it
nearest `reference` (the trace's time, else the log file's modification time). A line with
no time of its own takes the nearest earlier line's within `LOOKBACK_LINES` (a traceback's
lines follow the log line that carries the time). The kernel's `[12345.678]` is seconds since
boot, not a time: not used.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone

LOOKBACK_LINES = 200

_ISO = re.compile(r"(?<!\d)(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2}):(\d{2})(?:[.,](\d{1,9}))?"
                  r"\s*(Z|[+-]\d{2}:?\d{2})?")
_VLLM = re.compile(r"\b(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+(\d{2})-(\d{2}) "
                   r"(\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,6}))?\b")
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_SYSLOG = re.compile(r"^(?:<\d+>)?(" + "|".join(m.title() for m in _MONTHS)
                     + r")\s+(\d{1,2}) (\d{2}):(\d{2}):(\d{2})\b")


def _fraction(text: str | None) -> float:
    return float("0." + text) if text else 0.0


def _nearest_year(month: int, day: int, hms: tuple[int, int, int], frac: float,
                  reference: float) -> float | None:
    ref_year = datetime.fromtimestamp(reference, timezone.utc).year
    best: float | None = None
    for year in (ref_year - 1, ref_year, ref_year + 1):
        try:
            t = datetime(year, month, day, *hms, tzinfo=timezone.utc).timestamp() + frac
        except ValueError:  # 02-29 in a year without it
            continue
        if best is None or abs(t - reference) < abs(best - reference):
            best = t
    return best


def line_time(text: str, reference: float) -> float | None:
    """Unix seconds of a log line's own time stamp, or None when it has none."""
    head = text[:400]
    m = _ISO.search(head)
    if m:
        try:
            year, month, day, hh, mm, ss = (int(g) for g in m.groups()[:6])
            when = datetime(year, month, day, hh, mm, ss, tzinfo=timezone.utc)
        except ValueError:
            return None
        offset = m.group(8)
        if offset and offset != "Z":
            sign = 1 if offset[0] == "+" else -1
            digits = offset[1:].replace(":", "")
            when -= sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
        return when.timestamp() + _fraction(m.group(7))
    m = _VLLM.search(head)
    if m:
        month, day, hh, mm, ss = (int(g) for g in m.groups()[:5])
        return _nearest_year(month, day, (hh, mm, ss), _fraction(m.group(6)), reference)
    m = _SYSLOG.search(head)
    if m:
        month = _MONTHS.index(m.group(1).lower()) + 1
        day, hh, mm, ss = (int(g) for g in m.groups()[1:])
        return _nearest_year(month, day, (hh, mm, ss), 0.0, reference)
    return None


def times_of_lines(lines: Iterable[tuple[int, str]], wanted: Iterable[int],
                   reference: float) -> dict[int, float]:
    """line number -> time, for the `wanted` line numbers of (number, text) pairs: each line's
    own time, else the nearest earlier line's within LOOKBACK_LINES."""
    want = set(wanted)
    out: dict[int, float] = {}
    last: tuple[int, float] | None = None
    if not want:
        return out
    top = max(want)
    for number, text in lines:
        t = line_time(text, reference)
        if t is not None:
            last = (number, t)
        if number in want and last is not None and number - last[0] <= LOOKBACK_LINES:
            out[number] = last[1]
        if number >= top:
            break
    return out


__all__ = ["LOOKBACK_LINES", "line_time", "times_of_lines"]
