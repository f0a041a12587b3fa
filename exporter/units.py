"""Sizes, rates and durations: the one place where units are parsed and printed.

One unit table serves configuration files, scenarios and log messages. The only difference
between them is a deliberate one: tools that print "MB" or "GB" in their messages (PyTorch,
NCCL, vLLM) mean MiB and GiB, while a person writing "8MB" in a configuration file means SI
megabytes, as Kubernetes and Prometheus read it.
"""
from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from typing import Any

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
MAX_BYTES = 1 << 62  # anything bigger is garbage, not a size

_BINARY = {"kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB, "k": KiB, "m": MiB, "g": GiB, "t": TiB}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_PLAIN = {"": 1, "b": 1, "byte": 1, "bytes": 1}
_SECONDS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60,
            "h": 3600, "hour": 3600, "d": 86400, "day": 86400}

MAX_TEXT = 64  # longer text is no size or duration: refused before any matching
_AMOUNT = re.compile(r"^\s*([+-]?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d)?\s*$")


class UnitError(ValueError):
    """A value that is not a size, rate or duration; the message says what was expected."""


def _factor(unit: str, tool_printed: bool) -> int | None:
    unit = unit.strip().lower()
    if unit in _PLAIN:
        return 1
    if unit in _BINARY:
        return _BINARY[unit]
    if unit in _DECIMAL:
        return _BINARY[unit[0] + "ib"] if tool_printed else _DECIMAL[unit]
    return None


def _show(value: Any) -> str:
    return repr(str(value)[:64])  # never the repr of a huge value


def parse_size(value: Any, *, allow_negative: bool = False) -> float:
    """Bytes from a number or a string like '8MiB', '1.5GB' (SI), '512k' (binary).

    Raises UnitError. A float comes back; callers that need whole bytes round it."""
    if isinstance(value, bool):
        raise UnitError(f"expected a size like 8MiB, got {_show(value)}")
    if isinstance(value, (int, float)):
        size = float(value) if abs(value) <= MAX_BYTES else math.inf  # no OverflowError on 10**400
    else:
        if isinstance(value, str) and len(value) > MAX_TEXT:
            raise UnitError(f"{_show(value)} is too large")
        m = _AMOUNT.match(value) if isinstance(value, str) else None
        factor = _factor(m.group(2), tool_printed=False) if m else None
        if m is None or factor is None:
            raise UnitError(f"expected a size like 8MiB or 1048576, got {_show(value)}")
        size = float(m.group(1)) * factor
    if not math.isfinite(size) or abs(size) > MAX_BYTES:
        raise UnitError(f"{_show(value)} is too large")
    if size < 0 and not allow_negative:
        raise UnitError(f"must not be negative, got {_show(value)}")
    return size


def parse_rate(value: Any) -> float:
    """Units per second from a number or a string like '2MiB/min', '100MiB/h', '12/min'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return parse_size(value, allow_negative=True)
    if isinstance(value, str) and value.count("/") == 1:
        amount, per = value.split("/")
        seconds = _SECONDS.get(per.strip().lower())
        if seconds is not None:
            try:
                return parse_size(amount, allow_negative=True) / seconds
            except UnitError:
                pass
    raise UnitError(f"expected a rate like '2MiB/min', got {_show(value)}")


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string like '90s', '30m', '6h', '1d'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0:
            raise UnitError(f"expected a non-negative duration, got {_show(value)}")
        return float(value)
    m = _DURATION.match(value) if isinstance(value, str) and len(value) <= MAX_TEXT else None
    if m is None:
        raise UnitError(f"expected seconds or a duration like '30m', got {_show(value)}")
    return float(m.group(1)) * _SECONDS[m.group(2) or "s"]


def bytes_in_message(number: str, unit: str) -> int | None:
    """A size as a tool printed it in a message ('2.00', 'GiB'; 'MB' meaning MiB), in whole
    bytes; None for nonsense (unknown unit, negative or absurd size)."""
    factor = _factor(unit, tool_printed=True)
    try:
        value = float(number) * factor if factor is not None else math.nan
    except ValueError:
        return None
    if not math.isfinite(value) or value < 0 or value > MAX_BYTES:
        return None
    return round(value)


def format_bytes(n: float | None) -> str:
    """Bytes as PyTorch prints them: two decimals in binary units ('2.00 GiB', '512 bytes')."""
    if n is None:
        return "?"
    if n < 0:
        return "-" + format_bytes(-n)
    for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{n:.0f} bytes"


def format_duration(seconds: float, hours_from: float = 3600) -> str:
    """A duration as people say it: '12 min', or from `hours_from` seconds on '1.5 h' (a finding
    that tells how long something has lasted passes 5400: '79 min' reads better than '1.3 h');
    thousands separated, as a gap between traces months apart is: '1,799.9 h'."""
    return f"{seconds / 3600:,.1f} h" if seconds >= hours_from else f"{seconds / 60:,.0f} min"


def format_time(ts: float | None) -> str:
    """A Unix time as `2024-11-22 13:19:50 UTC` ("" for None)."""
    if ts is None:
        return ""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def counted(n: float, noun: str, plural: str = "") -> str:
    """A count with its noun as people write it: '1 time', '3 times', '0 events'."""
    return f"{n:.0f} {noun if round(n) == 1 else plural or noun + 's'}"
