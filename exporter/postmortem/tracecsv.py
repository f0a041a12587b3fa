"""The trace CSV, read and written: one bounded reader, one writer, so whatever is written reads back.

The format (a public interface: a change is a CHANGELOG entry): header
`timestamp,gpu,pid,process,used_bytes` plus optional columns (`total_bytes`, `host_rss_bytes`,
`role`, `uuid`, `start_time`, ...). A row with an empty `pid` is a GPU-level row giving the GPU's
own used/total; unknown columns are ignored, so a five-column trace and traces of older and
newer versions load. What the detectors read beyond memory rides in optional columns too, so a
trace replays everything the live daemon saw:
    gpu_error    on a GPU-level row: why the GPU was down (NVML's error token); empty = up
    vllm         on the first GPU-level row of a tick: a JSON list of the tick's vLLM servers
                 (endpoint, up, engines with KV usage / running / waiting / preemptions /
                 sleep state, cache_config with gpu_memory_utilization / kv_cache_memory_bytes /
                 blocks, pids, start-up memory profile): model.VllmSample's fields by name
    oom_events   on the same row: a JSON list of the tick's out-of-memory messages
                 (model.OomMessage's fields by name)
    allocator    on a process row: the allocator probe's numbers (model.AllocatorStats) as JSON
    trigger      on the GPU-level rows of a tick that triggered the flight recorder: the
                 trigger(s), `+`-joined (oom, critical, vllm_exit)
    hostname, boot_id, exporter_run
                 on the first GPU-level row of a tick: the run that wrote it (runs.py)
    dropped      on the same row: what did not fit in this tick's cells, `name=count` joined
                 by `;` (e.g. `oom_events=312`)
JSON fields are read by name (cells.py): unknown names are ignored and missing ones take their
defaults.

Safe to open: every text cell is written without control characters, and one that a
spreadsheet would take for a formula (starting with = + - @) or that starts with a quote gets a
leading `'`, which the reader takes off again. Every cell is bounded (text to MAX_TEXT_CHARS, a
JSON cell to MAX_JSON_CELL_BYTES, keeping as many whole items as fit and counting the rest in
`dropped`), so a tick with hundreds of OOM lines still gives a trace that reads back.
"""
from __future__ import annotations

import csv
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from ..model import (
    AllocatorStats,
    GpuSample,
    HostMemory,
    OomMessage,
    ProcessSample,
    Snapshot,
    VllmSample,
)
from .atomic import atomic_file
from .cells import decode_list, decode_one, encode, encode_items
from .runs import RunIdentity, local_identity
from .tracerow import (
    MAX_ROWS,
    MAX_TICKS,
    TraceError,
    TraceRow,
    clean_text,
    optional,
    parse_bool,
    parse_bytes,
    parse_float,
    parse_pid,
)

log = logging.getLogger("exporter.postmortem.trace")

# Bounds on outside input (with tracerow.MAX_ROWS and MAX_TICKS, which the writer keeps too).
MAX_CSV_BYTES = 256 << 20
# The csv module refuses a field over 131,072 characters; what is written stays under it.
MAX_JSON_CELL_BYTES = 64 << 10
MAX_TEXT_CHARS = 1024

REQUIRED_COLUMNS = ("timestamp", "gpu", "pid", "process", "used_bytes")
# The columns write_csv produces; the reader understands all of them and ignores any other.
CSV_COLUMNS = REQUIRED_COLUMNS + (
    "total_bytes", "host_rss_bytes", "role", "uuid", "start_time", "unified",
    "container", "pod", "namespace", "endpoint",
    "host_total_bytes", "host_available_bytes", "host_psi_some_avg10", "host_oom_kills",
    "gpu_error", "trigger", "vllm", "oom_events", "allocator",
    "hostname", "boot_id", "exporter_run", "dropped",
)
_COL = {c: i for i, c in enumerate(CSV_COLUMNS)}
_FORMULA_START = ("=", "+", "-", "@", "'")

_T = TypeVar("_T")


# ---------------------------------------------------------------- reading

def _bounded_lines(handle: Iterable[str], limit: int, path: str) -> Iterator[str]:
    """Yield lines, failing once more than `limit` bytes have been read (files may grow)."""
    total = 0
    for line in handle:
        total += len(line)
        if total > limit:
            raise TraceError(f"{path}: larger than the {limit} byte limit for a trace")
        yield line


def read_csv_rows(path: str, max_bytes: int = MAX_CSV_BYTES,
                  max_rows: int | None = None) -> Iterator[TraceRow]:
    """Stream the rows of a trace CSV, validating each (at most max_rows, default MAX_ROWS)."""
    max_rows = MAX_ROWS if max_rows is None else max_rows
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as handle:
        reader = csv.reader(_bounded_lines(handle, max_bytes, path), strict=True)
        try:
            header = _header(path, next(reader, None))
            count = 0
            for cells in reader:
                if not cells or all(not c.strip() for c in cells):
                    continue  # blank line
                line = reader.line_num
                if len(cells) != len(header):
                    raise TraceError(f"{path}:{line}: {len(cells)} fields, the header has "
                                     f"{len(header)}")
                count += 1
                if count > max_rows:
                    raise TraceError(f"{path}:{line}: more than {max_rows} rows; split the trace")
                yield _row(f"{path}:{line}", dict(zip(header, cells, strict=True)))
        except csv.Error as exc:
            raise TraceError(f"{path}:{reader.line_num}: malformed CSV: {exc}") from None


def _header(path: str, header: list[str] | None) -> list[str]:
    if header is None:
        raise TraceError(f"{path}:1: empty file, expected a header {','.join(REQUIRED_COLUMNS)}")
    header = [h.strip() for h in header]
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise TraceError(f"{path}:1: header lacks column(s) {', '.join(missing)} "
                         f"(need {','.join(REQUIRED_COLUMNS)})")
    dupes = sorted({h for h in header if h and header.count(h) > 1})
    if dupes:
        raise TraceError(f"{path}:1: duplicate column(s) {', '.join(dupes)}")
    return header


def _text_in(cell: str | None, strip: bool = True) -> str:
    """A text cell as written: controls removed, the formula guard's quote taken off."""
    if not cell:
        return ""  # most optional cells: quickly
    text = clean_text(cell)
    text = text[1:] if text.startswith("'") else text
    return text.strip() if strip else text


def _row(origin: str, cells: dict[str, str]) -> TraceRow:
    try:
        gpu = _text_in(cells["gpu"])
        if not gpu:
            raise ValueError("gpu is empty")
        pid_text = cells["pid"].strip()
        host = None
        host_total = optional(cells.get("host_total_bytes"), parse_bytes, "host_total_bytes")
        host_avail = optional(cells.get("host_available_bytes"), parse_bytes, "host_available_bytes")
        if host_total is not None and host_avail is not None:
            host = HostMemory(
                total_bytes=host_total, available_bytes=host_avail,
                psi_some_avg10=optional(cells.get("host_psi_some_avg10"), parse_float,
                                        "host_psi_some_avg10"),
                oom_kills=optional(cells.get("host_oom_kills"), parse_bytes, "host_oom_kills"))
        return TraceRow(
            origin=origin, timestamp=parse_float(cells["timestamp"].strip(), "timestamp"),
            gpu=gpu, pid=parse_pid(pid_text) if pid_text else None,
            process=_text_in(cells["process"], strip=False),
            used_bytes=optional(cells["used_bytes"], parse_bytes, "used_bytes"),
            total_bytes=optional(cells.get("total_bytes"), parse_bytes, "total_bytes"),
            host_rss_bytes=optional(cells.get("host_rss_bytes"), parse_bytes, "host_rss_bytes"),
            role=_text_in(cells.get("role")), uuid=_text_in(cells.get("uuid")),
            start_time=optional(cells.get("start_time"), parse_float, "start_time"),
            unified=optional(cells.get("unified"), parse_bool, "unified"),
            container=_text_in(cells.get("container"), strip=False),
            pod=_text_in(cells.get("pod"), strip=False),
            namespace=_text_in(cells.get("namespace"), strip=False),
            endpoint=_text_in(cells.get("endpoint"), strip=False),
            host=host, gpu_error=_text_in(cells.get("gpu_error")),
            trigger=_text_in(cells.get("trigger")),
            vllm=_json_cell(cells, "vllm", lambda v: tuple(decode_list(VllmSample, v, "vllm"))),
            oom_events=_json_cell(cells, "oom_events",
                                  lambda v: tuple(decode_list(OomMessage, v, "oom_events"))) or (),
            allocator=_json_cell(cells, "allocator",
                                 lambda v: decode_one(AllocatorStats, v, "allocator")),
            hostname=_text_in(cells.get("hostname")), boot_id=_text_in(cells.get("boot_id")),
            exporter_run=_text_in(cells.get("exporter_run")),
            dropped=_dropped(cells.get("dropped")))
    except ValueError as exc:
        raise TraceError(f"{origin}: {exc}") from None


def _json_cell(cells: dict[str, str], name: str, decode: Callable[[object], _T]) -> _T | None:
    text = (cells.get(name) or "").strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc.msg}") from None
    except RecursionError:
        raise ValueError(f"{name} is nested too deeply") from None
    return decode(value)


def _dropped(cell: str | None) -> tuple[tuple[str, int], ...]:
    if not cell:
        return ()
    out = []
    for part in (cell or "").split(";"):
        name, sep, count = part.strip().partition("=")
        if not sep:
            continue  # empty, or a note this version does not know
        out.append((clean_text(name.strip())[:64], parse_bytes(count.strip(), "dropped")))
    return tuple(out)


# ---------------------------------------------------------------- writing

@dataclass
class _Fitted:
    """A JSON cell as it fits, and how many of its items did not."""

    text: str = ""
    dropped: int = 0


def write_csv(snapshots: Iterable[Snapshot], path: str,
              triggers: Mapping[float, Sequence[str]] | None = None,
              identity: RunIdentity | None = None) -> None:
    """Write snapshots as a trace CSV that `trace.read_trace` reads back to the same snapshots.
    `triggers`: snapshot timestamp -> the flight-recorder triggers of that tick (the
    `trigger` column). `identity`: the run the rows name (default: this process's).

    A trace holds at most MAX_TICKS ticks and MAX_ROWS rows, the limits `analyze` reads: past
    them the oldest ticks are left out (an incident's last moments matter most), counted as
    `ticks=N` in the first tick's `dropped` cell. Each GPU gets a GPU-level row (empty pid)
    carrying its used/total and the host's memory, then one row per process. Written to a
    temporary file and renamed, so a reader (or a crash) never sees half a trace. The
    temporary file, `<path>.tmp.<pid>.<random>`, is made new (O_CREAT|O_EXCL|O_NOFOLLOW, mode
    0600): a link planted in the directory is never written through.
    """
    triggers = triggers or {}
    run = identity if identity is not None else local_identity()
    snaps, left_out = _within_limits(list(snapshots))
    dropped_total: dict[str, int] = {"ticks": left_out} if left_out else {}
    # errors="replace": a name that is not valid Unicode must not lose the whole trace
    with atomic_file(path, encoding="utf-8", errors="replace", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for k, snap in enumerate(snaps):
            ts = repr(float(snap.timestamp))
            trigger = "+".join(triggers.get(snap.timestamp, ()))
            for i, g in enumerate(snap.gpus):
                row = _gpu_cells(ts, g, snap.host, trigger)
                if i == 0:  # the tick's own data, once
                    _tick_cells(row, snap, run, dropped_total, left_out if k == 0 else 0)
                writer.writerow(row)
                for p in g.processes:
                    writer.writerow(_process_cells(ts, g, p, dropped_total))
    if dropped_total:
        log.warning("trace %s: left out what did not fit in its cells: %s", path,
                    ", ".join(f"{n} {c}" for n, c in sorted(dropped_total.items())))


def _within_limits(snaps: list[Snapshot]) -> tuple[list[Snapshot], int]:
    """The newest ticks that fit in MAX_TICKS and MAX_ROWS, and how many older ones do not."""
    rows = 0
    for i in range(len(snaps) - 1, -1, -1):
        rows += sum(1 + len(g.processes) for g in snaps[i].gpus)
        if rows > MAX_ROWS or len(snaps) - i > MAX_TICKS:
            return snaps[i + 1:], i + 1
    return snaps, 0


def _tick_cells(row: list[str], snap: Snapshot, run: RunIdentity,
                dropped_total: dict[str, int], ticks_left_out: int) -> None:
    dropped = [("ticks", ticks_left_out)] if ticks_left_out else []
    for name, items in (("vllm", list(snap.vllm)),
                        ("oom_events", [_as_message(e) for e in snap.log_events])):
        if items:
            fitted = _fit(items)
            row[_COL[name]] = fitted.text
            if fitted.dropped:
                dropped.append((name, fitted.dropped))
    for name, count in dropped[1 if ticks_left_out else 0:]:
        dropped_total[name] = dropped_total.get(name, 0) + count
    row[_COL["dropped"]] = ";".join(f"{n}={c}" for n, c in dropped)
    row[_COL["hostname"]] = _text(run.hostname)
    row[_COL["boot_id"]] = _text(run.boot_id)
    row[_COL["exporter_run"]] = _text(run.exporter_run)


def _fit(items: list[Any], limit: int = MAX_JSON_CELL_BYTES) -> _Fitted:
    """As many whole items, first first, as fit in `limit` bytes of JSON."""
    parts = encode_items(items)
    size, kept = 2, 0  # the brackets
    for part in parts:
        step = len(part.encode("utf-8")) + (1 if kept else 0)
        if size + step > limit:
            break
        size += step
        kept += 1
    return _Fitted("[" + ",".join(parts[:kept]) + "]" if kept else "", len(items) - kept)


def _text(value: object) -> str:
    """One cell: text without controls, bounded, guarded against spreadsheet formulas."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if not isinstance(value, str):
        return str(value)
    text = clean_text(value)[:MAX_TEXT_CHARS]
    return "'" + text if text.lstrip().startswith(_FORMULA_START) else text


def _as_message(event: OomMessage) -> OomMessage:
    """The message as parsed (an OomEvent's verdict is the analysis's, redone on replay)."""
    if type(event) is OomMessage:
        return event
    return OomMessage(**{f.name: getattr(event, f.name) for f in fields(OomMessage)})


def _gpu_cells(ts: str, g: GpuSample, host: HostMemory | None, trigger: str = "") -> list[str]:
    row = dict.fromkeys(CSV_COLUMNS, "")
    row.update(timestamp=ts, gpu=_text(g.index), used_bytes=_text(g.used_bytes),
               total_bytes=_text(g.total_bytes), uuid=_text(g.uuid), unified=_text(g.unified),
               gpu_error=_text(g.error or ("" if g.up else "down")), trigger=_text(trigger))
    if host is not None:
        row.update(host_total_bytes=_text(host.total_bytes),
                   host_available_bytes=_text(host.available_bytes),
                   host_psi_some_avg10=_text(host.psi_some_avg10),
                   host_oom_kills=_text(host.oom_kills))
    return [row[c] for c in CSV_COLUMNS]


def _process_cells(ts: str, g: GpuSample, p: ProcessSample,
                   dropped_total: dict[str, int]) -> list[str]:
    row = dict.fromkeys(CSV_COLUMNS, "")
    row.update(timestamp=ts, gpu=_text(g.index), pid=str(p.pid), process=_text(p.name),
               used_bytes=_text(p.used_bytes), total_bytes=_text(g.total_bytes),
               host_rss_bytes=_text(p.host_rss_bytes), role=_text(p.role), uuid=_text(g.uuid),
               start_time=_text(p.start_time), unified=_text(g.unified),
               container=_text(p.container), pod=_text(p.pod), namespace=_text(p.namespace),
               endpoint=_text(p.endpoint))
    if p.allocator is not None:
        cell = encode(p.allocator)
        if len(cell.encode("utf-8")) <= MAX_JSON_CELL_BYTES:
            row["allocator"] = cell
        else:
            row["dropped"] = "allocator=1"
            dropped_total["allocator"] = dropped_total.get("allocator", 0) + 1
    return [row[c] for c in CSV_COLUMNS]


__all__ = [
    "CSV_COLUMNS",
    "MAX_CSV_BYTES",
    "MAX_JSON_CELL_BYTES",
    "REQUIRED_COLUMNS",
    "read_csv_rows",
    "write_csv",
]
