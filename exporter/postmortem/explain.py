"""`explain LOGFILE...`: find every out-of-memory event in server logs and explain it.

The parser (sources/oom_messages) finds the messages, the analysis (analysis/oom) classifies
them. The JSON form (a public interface, described in README.md): {"events": [{"file", "line", "kind", "class",
"requested_bytes", "total_bytes", "free_bytes", "reserved_unallocated_bytes",
"other_processes": [{"pid", "bytes"}], "advice": [...], "verdict", "shortfall_bytes",
"causes": [{"cause", "bytes"}], ...}], "files": [...]}.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from ..analysis.oom import classify
from ..boundedio import open_regular
from ..model import OomEvent, OomMessage
from ..sources.logs import DEFAULT_MAX_LINE_BYTES, iter_file_lines
from ..sources.oom_messages import OomParser, parse_lines
from ..units import counted, format_bytes

MAX_FILE_BYTES = 256 * 1024 * 1024
FORMATS = ("text", "json")


class ExplainError(Exception):
    """A log could not be read, or the request was invalid; the message says which and why."""


def read_events(path: str, max_bytes: int = MAX_FILE_BYTES,
                max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> tuple[list[OomEvent], dict[str, Any]]:
    """The OOM events of one log file, and what was read of it. Raises ExplainError."""
    try:
        fh = open_regular(path)
    except FileNotFoundError:
        raise ExplainError(f"{path}: no such file") from None
    except PermissionError:
        raise ExplainError(f"{path}: permission denied") from None
    except IsADirectoryError:
        raise ExplainError(f"{path}: is a directory, not a log file") from None
    except OSError as exc:
        raise ExplainError(f"{path}: cannot read: {exc.strerror or exc}") from None
    parser = OomParser(path)
    messages: list[OomMessage] = []
    lines = 0
    try:
        with fh:
            for line_no, text in iter_file_lines(fh, max_bytes, max_line_bytes):
                lines = line_no
                messages += parser.feed(line_no, text)
            messages += parser.flush()
            truncated = fh.tell() >= max_bytes and bool(fh.read(1))
    except OSError as exc:
        raise ExplainError(f"{path}: read failed: {exc.strerror or exc}") from None
    return [classify(m) for m in messages], {"file": path, "lines": lines, "truncated": truncated}


def events_in_lines(lines: Iterable[str], source: str = "") -> list[OomEvent]:
    """The classified OOM events of some log lines (line numbers 1-based)."""
    return [classify(m) for m in parse_lines(lines, source)]


# Fields the JSON names differently; every other field keeps its name.
_RENAMED = {"source": "file", "klass": "class"}


def event_to_dict(event: OomEvent) -> dict[str, Any]:
    """The `explain --format json` shape of one event: every field, sizes in bytes."""
    out: dict[str, Any] = {}
    for f in fields(event):
        value = getattr(event, f.name)
        if f.name == "other_processes":
            value = [{"pid": pid, "bytes": b} for pid, b in value]
        elif f.name == "causes":
            value = [{"cause": name, "bytes": b} for name, b in value]
        elif f.name == "settings":
            value = value.stated()  # what the server's log said of its settings
        elif isinstance(value, tuple):
            value = list(value)
        out[_RENAMED.get(f.name, f.name)] = value
    return out


def explain(paths: list[str], fmt: str = "text", *, max_bytes_per_file: int = MAX_FILE_BYTES,
            max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> str:
    """The OOM events of all `paths`, explained as `fmt` ("text" or "json"), newline-ended.
    Raises ExplainError (nothing printed yet) when a file cannot be read."""
    if fmt not in FORMATS:
        raise ExplainError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    if not paths:
        raise ExplainError("no log file given")
    events: list[OomEvent] = []
    files: list[dict[str, Any]] = []
    for path in paths:
        found, info = read_events(str(path), max_bytes_per_file, max_line_bytes)
        events += found
        files.append(info)
    if fmt == "json":
        return json.dumps({"events": [event_to_dict(e) for e in events], "files": files},
                          indent=2) + "\n"
    return render_text(events, files, max_bytes_per_file)


def _numbers(e: OomEvent) -> str:
    parts = [
        ("requested", e.requested_bytes), ("total", e.total_bytes), ("free", e.free_bytes),
        ("allocated by PyTorch", e.allocated_bytes),
        ("reserved but unallocated", e.reserved_unallocated_bytes),
        ("killed process resident" if e.klass == "host" else "this process", e.process_bytes),
        ("shortfall", e.shortfall_bytes if e.shortfall_bytes and e.shortfall_bytes > 0 else None),
    ]
    return ", ".join(f"{name} {format_bytes(v)}" for name, v in parts if v is not None)


def render_text(events: list[OomEvent], files: list[dict[str, Any]], max_bytes: int = MAX_FILE_BYTES) -> str:
    out: list[str] = []
    for e in events:
        where = f" on GPU {e.gpu}" if e.gpu is not None else ""
        out.append(f"{e.source}:{e.line}: {e.kind} ({e.klass}){where}")
        numbers = _numbers(e)
        if numbers:
            out.append(f"  {numbers}")
        if e.other_processes:
            others = ", ".join(f"pid {pid} {format_bytes(b)}" for pid, b in e.other_processes)
            out.append(f"  other processes: {others}")
        if not e.settings.empty:
            stated = ", ".join(f"{k} {v}" for k, v in e.settings.stated().items() if k != "source")
            # Not "non-default args" even where that line began them: the engine's own lines
            # (its config, the CPU backend's KV cache) add defaults and facts to it.
            out.append(f"  server settings, from its log: {stated}")
        if e.verdict:
            out.append(f"  why: {e.verdict}")
        out.extend(f"  - {a}" for a in e.advice)
        out.append("")
    for info in files:
        if info["truncated"]:
            out.append(f"note: {info['file']}: only the first {format_bytes(max_bytes)} were read")
    count = len(events)
    noun = "event" if count == 1 else "events"
    out.append(f"{count or 'No'} out-of-memory {noun} in {counted(len(files), 'file')}.")
    return "\n".join(out) + "\n"
