"""Reading a parsed scenario document: typed values whose errors name their key path.

Every reader takes (value, path) and returns the value or raises ScenarioError with a message
that starts with the path ("processes[2].memory: ..."), so a mistake in a 500-line file is found
at once. Sizes, rates and durations go through exporter.units, the project's one unit parser.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from ... import units


class ScenarioError(ValueError):
    """A scenario that cannot be used; the message names the key path and the problem."""


class Node:
    """A mapping being read: remembers which keys were used so unknown ones can be rejected."""

    def __init__(self, data: Any, path: str):
        if not isinstance(data, Mapping):
            raise ScenarioError(f"{path or '<top>'}: expected a mapping, got {type_name(data)}")
        for key in data:
            if not isinstance(key, str):
                raise ScenarioError(f"{path or '<top>'}: keys must be strings, got {key!r}")
        self.data = data
        self.path = path
        self.used: set[str] = set()

    def sub(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def get(self, key: str, parse: Callable[[Any, str], Any], default: Any = ...) -> Any:
        self.used.add(key)
        if key not in self.data or self.data[key] is None:
            if default is ...:
                raise ScenarioError(f"{self.sub(key)}: required key is missing")
            return default
        return parse(self.data[key], self.sub(key))

    def raw(self, key: str, default: Any = None) -> Any:
        """The value as written (for values read later, e.g. curves that need other keys first)."""
        return self.get(key, lambda v, p: v, default)

    def done(self) -> None:
        unknown = [k for k in self.data if k not in self.used]
        if unknown:
            allowed = ", ".join(sorted(self.used))
            raise ScenarioError(f"{self.sub(unknown[0])}: unknown key (allowed: {allowed})")


def type_name(value: Any) -> str:
    return type(value).__name__


def number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ScenarioError(f"{path}: expected a number, got {value!r}")
    return float(value)


def nonneg(value: Any, path: str) -> float:
    v = number(value, path)
    if v < 0:
        raise ScenarioError(f"{path}: must not be negative, got {value!r}")
    return v


def positive(value: Any, path: str) -> float:
    v = number(value, path)
    if v <= 0:
        raise ScenarioError(f"{path}: must be positive, got {value!r}")
    return v


def plain_number(value: Any, path: str) -> float:
    """Values of non-byte curves (ratios, counts, percent) may not carry byte units."""
    if isinstance(value, str):
        raise ScenarioError(f"{path}: expected a number, got {value!r}")
    return number(value, path)


def integer(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(f"{path}: expected an integer, got {value!r}")
    return value


def string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ScenarioError(f"{path}: expected a string, got {value!r}")
    return value


def boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ScenarioError(f"{path}: expected true or false, got {value!r}")
    return value


def listed(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise ScenarioError(f"{path}: expected a list, got {type_name(value)}")
    return value


def _units(parse: Callable[[Any], float], value: Any, path: str) -> float:
    try:
        return parse(value)
    except units.UnitError as exc:
        raise ScenarioError(f"{path}: {exc}") from None


def parse_size(value: Any, path: str = "size") -> float:
    """Bytes from a number or a string like "80GiB", "512MiB", "1.5GB", "-2GiB"."""
    return _units(lambda v: units.parse_size(v, allow_negative=True), value, path)


def parse_rate(value: Any, path: str = "rate") -> float:
    """Units per second from a number or a string like "2MiB/min", "100MiB/h", "12/min"."""
    return _units(units.parse_rate, value, path)


def parse_duration(value: Any, path: str = "duration") -> float:
    """Seconds from a number or a string like "90s", "30m", "6h", "1d"."""
    return _units(units.parse_duration, value, path)


def size_nonneg(value: Any, path: str) -> float:
    v = parse_size(value, path)
    if v < 0:
        raise ScenarioError(f"{path}: must not be negative, got {value!r}")
    return v
