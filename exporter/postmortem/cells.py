"""The JSON cells of a trace CSV (`vllm`, `oom_events`, `allocator`): model dataclasses by
field name, and back.

Encoding writes only the fields that differ from their defaults, so a cell stays short and a
field added later costs old traces nothing. Decoding is strict about types (a trace is outside
input: a wrong type is a ValueError naming the field, never a crash deeper in the analysis)
and lenient about names: an unknown field is ignored and a missing one takes its default, so
a trace written by an older or newer version still loads. Control characters are taken out of
every string read.
"""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Iterable, Iterator
from functools import cache
from typing import Any, TypeVar

from .tracerow import clean_text

_D = TypeVar("_D")
MAX_DEPTH = 8


def encode(value: object) -> str:
    """One cell: a dataclass (or a list of them) as compact JSON."""
    return json.dumps(_plain(value), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode_items(values: Iterable[object]) -> list[str]:
    """Each item as `encode` writes it, for a caller that keeps only as many as fit."""
    return [encode(v) for v in values]


def _plain(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if f.default is not dataclasses.MISSING and v == f.default:
                continue
            if f.default_factory is not dataclasses.MISSING and v == f.default_factory():
                continue
            out[f.name] = _plain(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def decode_one(cls: type[_D], value: object, where: str) -> _D:
    return typing.cast(_D, _decode(cls, value, where, 0))


def decode_list(cls: type[_D], value: object, where: str) -> Iterator[_D]:
    if not isinstance(value, list):
        raise ValueError(f"{where} is not a JSON list")
    for i, item in enumerate(value):
        yield decode_one(cls, item, f"{where}[{i}]")


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _decode(tp: Any, value: object, where: str, depth: int) -> object:
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: nested too deeply")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _decode(arg, value, where, depth + 1)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if errors else f"{where}: unexpected {type(value).__name__}")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ValueError(f"{where}: expected {len(args)} items")
        return tuple(_decode(a, v, f"{where}[{i}]", depth + 1)
                     for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object")
        hints = _hints(tp)
        known = {f.name for f in dataclasses.fields(tp) if f.init}
        kwargs = {name: _decode(hints[name], v, f"{where}.{name}", depth + 1)
                  for name, v in value.items() if name in known}
        try:
            return tp(**kwargs)
        except TypeError as exc:  # a required field missing
            raise ValueError(f"{where}: {exc}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return clean_text(value)
    else:
        raise ValueError(f"{where}: cannot read a {tp!r}")
    raise ValueError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")


__all__ = ["decode_list", "decode_one", "encode", "encode_items"]
