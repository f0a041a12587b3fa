"""The probe's files, declared once: their names in the probe directory, the probe file's content
(schema 1) and the allocation-history request. docs/probe.md describes every field.

Three parties use this module, and nothing else spells the format:
- the probe writes its file with `document()` and `device()` (probe.py, stats.py) and reads
  requests with `parse_request()` (history.py);
- the exporter's `allocator` source reads probe files with `parse()`
  (exporter/sources/allocator.py) and writes requests with `request()`
  (exporter/postmortem/alloc_history.py);
- the exporter's simulator writes probe files for simulated processes (exporter/sim/probes.py).

Standard library only, never torch: the exporter depends on this distribution for this module,
and the probe imports it inside the serving process. `parse()` and `parse_request()` take bytes
from another user's process: every value is type-checked and bounded, and a bad file raises
`Invalid` / `Refused`, never anything else.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

SCHEMA = 1  # the version this module writes
READABLE = frozenset({1})  # the versions parse() understands; another is `unsupported_schema`

# -- names in the probe directory ---------------------------------------------------------------
# <pid namespace inode>-<pid>: the writing process as it sees itself (docs/probe.md, "matching").
FILE_NAME = re.compile(r"gpumem-(\d{1,20})-(\d{1,10})\.json")
LEFTOVER_NAME = re.compile(r"\.?gpumem-(\d{1,20})-(\d{1,10})\.json(?:\.tmp)?")  # a file, or its temporary
REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
DUMP_NAME = re.compile(r"gpumem-\d{1,20}-\d{1,10}-" + REQUEST_ID.pattern + r"\.pickle")


def file_name(pid_ns: int, pid: int) -> str:
    return f"gpumem-{pid_ns}-{pid}.json"


def temp_name(name: str) -> str:
    """Where a file is written before it is renamed over `name` (a dot file: readers skip it)."""
    return f".{name}.tmp"


def control_name(pid_ns: int, pid: int) -> str:
    """The allocation-history request addressed to the probe whose file is file_name(pid_ns, pid)."""
    return f"gpumem-{pid_ns}-{pid}.control.json"


def dump_name(pid_ns: int, pid: int, request_id: str) -> str:
    return f"gpumem-{pid_ns}-{pid}-{request_id}.pickle"


# -- the probe file -----------------------------------------------------------------------------
MIN_INTERVAL, MAX_INTERVAL = 0.5, 300.0  # seconds between the probe's reads
MAX_DEVICES = 64
MAX_TEXT = 512  # alloc_conf values; any text a reader keeps
MAX_BACKEND = 32
MAX_VERSION = 64  # torch_version
MAX_UUID = 64
MAX_ERROR_KINDS = 64
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# Faults the probe counts in its file's `errors` object, by kind.
ERROR_KINDS = ("device_count", "memory_stats", "device_properties", "cumem", "write", "sweep", "internal",
               "control", "history", "history_unsupported")
HISTORY_STATES = ("recording", "done", "failed")
# A device entry's numbers, in file order: the key, and the torch.cuda.memory_stats() key it is
# read from (None: not from memory_stats). A number a torch does not report is null.
COUNTS: tuple[tuple[str, str | None], ...] = (
    ("allocated_bytes", "allocated_bytes.all.current"),  # held by live tensors
    ("allocated_peak_bytes", "allocated_bytes.all.peak"),
    ("reserved_bytes", "reserved_bytes.all.current"),  # taken from the driver: allocated + cached
    ("reserved_peak_bytes", "reserved_bytes.all.peak"),
    ("active_bytes", "active_bytes.all.current"),  # allocated, or freed but still used by a stream
    ("active_peak_bytes", "active_bytes.all.peak"),
    ("inactive_split_bytes", "inactive_split_bytes.all.current"),  # free pieces of split blocks
    ("inactive_split_peak_bytes", "inactive_split_bytes.all.peak"),
    ("alloc_retries", "num_alloc_retries"),  # cache flushed and cudaMalloc retried
    ("ooms", "num_ooms"),  # out-of-memory errors raised by the allocator
    ("device_allocs", "num_device_alloc"),  # cudaMalloc calls (segments created)
    ("device_frees", "num_device_free"),
    ("cumem_bytes", None),  # vLLM's sleep-mode pool on the device (CuMemAllocator); null when not in use
)
COUNT_KEYS = tuple(key for key, _ in COUNTS)
_MAX_COUNT = 1 << 63


def device(index: int, uuid: str | None, counts: Mapping[str, int | None]) -> dict[str, Any]:
    """One entry of a probe file's `devices`: every count key, null where `counts` has none."""
    unknown = set(counts) - set(COUNT_KEYS)
    if unknown:
        raise KeyError(f"not a count of the probe file: {sorted(unknown)}")
    entry: dict[str, Any] = {"index": index, "uuid": uuid}
    for key in COUNT_KEYS:
        entry[key] = counts.get(key)
    return entry


def document(*, probe_version: str, pid: int, pid_ns: int, start_ticks: int | None, start_time: float | None,
             written_at: float, interval: float, seq: int, torch_version: str, backend: str,
             alloc_conf: Mapping[str, str], errors: Mapping[str, int], devices: list[dict[str, Any]],
             history: Mapping[str, Any] | None) -> dict[str, Any]:
    """A probe file's content. `pid` and `pid_ns` as in file_name(); `start_time` is the host's
    view (btime + start_ticks / CLK_TCK); `devices` are device() entries."""
    return {
        "schema": SCHEMA, "probe_version": probe_version,
        "pid": pid, "pid_ns": pid_ns, "start_ticks": start_ticks, "start_time": start_time,
        "written_at": written_at, "interval": interval, "seq": seq,
        "torch_version": torch_version, "backend": backend, "alloc_conf": dict(alloc_conf),
        "errors": dict(errors), "devices": devices, "history": None if history is None else dict(history),
    }


def encode(doc: Mapping[str, Any]) -> bytes:
    """The bytes written for a document(): compact JSON."""
    return json.dumps(doc, separators=(",", ":")).encode()


class Invalid(ValueError):
    """A probe file that is not a valid one; `kind` is stable (bad_json, bad_schema,
    unsupported_schema) and is what the exporter counts."""

    def __init__(self, kind: str, message: str = ""):
        super().__init__(message or kind)
        self.kind = kind


class History(NamedTuple):
    """The last allocation-history request the probe acted on."""

    request_id: str
    state: str  # one of HISTORY_STATES; "" for a state this reader does not know
    file: str = ""  # the dump's name in the probe directory, once done; never a path
    bytes: int | None = None


class Device(NamedTuple):
    uuid: str | None  # as written (CUDA's 8-4-4-4-12 hex), cut to MAX_UUID characters
    counts: dict[str, int | None]  # every COUNT_KEYS key


class Report(NamedTuple):
    """A probe file, validated: only what a reader uses."""

    pid: int
    pid_ns: int  # 0: the probe could not read it
    start_time: float
    written_at: float
    interval: float  # bounded to [MIN_INTERVAL, MAX_INTERVAL]
    backend: str
    alloc_conf: tuple[tuple[str, str], ...]  # (variable, value) in ALLOC_CONF_VARS order, as set
    errors_total: int  # every kind the probe counted
    history: History | None
    devices: tuple[Device, ...]


# `type(x) is int` rather than isinstance: it refuses booleans too, and this runs ~15 times per
# file per read.
def _count(value: object) -> int:
    if type(value) is int and 0 <= value < _MAX_COUNT:
        return value
    raise Invalid("bad_schema", f"not a count: {str(value)[:40]!r}")


def _optional_count(value: object) -> int | None:
    return None if value is None else _count(value)


def _seconds(value: Any) -> float:  # Any: a decoded JSON value, checked here
    if type(value) in (int, float) and 0 <= value < math.inf:  # NaN fails every comparison
        return float(value)
    raise Invalid("bad_schema", f"not a time: {str(value)[:40]!r}")


def _text(value: object, limit: int = MAX_TEXT) -> str:
    if not isinstance(value, str):
        raise Invalid("bad_schema", "not a string")
    return value[:limit]


def parse(data: bytes) -> Report:
    """A probe file's bytes, validated. Raises Invalid. Keys it does not know are ignored (new
    fields may be added within a schema version)."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise Invalid("bad_json", str(exc)[:200]) from None
    if not isinstance(doc, dict):
        raise Invalid("bad_schema", "not an object")
    if doc.get("schema") not in READABLE:
        raise Invalid("unsupported_schema", f"schema {str(doc.get('schema'))[:20]!r}")
    try:
        devices = doc["devices"]
        if not isinstance(devices, list) or len(devices) > MAX_DEVICES:
            raise Invalid("bad_schema", "devices: not a short list")
        conf = doc.get("alloc_conf") or {}
        errors = doc.get("errors") or {}
        if not isinstance(conf, dict) or not isinstance(errors, dict) or len(errors) > MAX_ERROR_KINDS:
            raise Invalid("bad_schema", "alloc_conf/errors: not small objects")
        return Report(
            backend=_text(doc.get("backend", ""), MAX_BACKEND),
            alloc_conf=tuple((name, _text(conf[name])) for name in ALLOC_CONF_VARS if name in conf),
            errors_total=sum(_count(n) for n in errors.values()),
            written_at=_seconds(doc["written_at"]),
            pid=_count(doc["pid"]), pid_ns=_count(doc.get("pid_ns") or 0),
            history=_history(doc.get("history")),
            start_time=_seconds(doc["start_time"]),
            interval=min(max(_seconds(doc["interval"]), MIN_INTERVAL), MAX_INTERVAL),
            devices=tuple(_device(d) for d in devices))
    except (KeyError, TypeError) as exc:
        raise Invalid("bad_schema", f"missing or mistyped {str(exc)[:60]}") from None


def _history(value: object) -> History | None:
    """The file's `history` object (absent or null: never asked). A state this reader does not
    know, or a file name that is not a dump's, is dropped, never passed on."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Invalid("bad_schema", "history: not an object")
    request, state, name = value.get("request_id"), value.get("state"), value.get("file")
    request_id = _text(request, 64) if request is not None else ""
    state = state if isinstance(state, str) and state in HISTORY_STATES else ""
    if state == "done" and isinstance(name, str) and DUMP_NAME.fullmatch(name):
        return History(request_id, state, name, _optional_count(value.get("bytes")))
    return History(request_id, state)


def _device(entry: object) -> Device:
    if not isinstance(entry, dict):
        raise Invalid("bad_schema", "device: not an object")
    uuid = entry.get("uuid")
    return Device(uuid=None if uuid is None else _text(uuid, MAX_UUID),
                  counts={key: _optional_count(entry.get(key)) for key in COUNT_KEYS})


# -- the allocation-history request -------------------------------------------------------------
MAX_CONTROL_BYTES = 4096
MAX_RECORD_SECONDS = 600.0
MAX_ENTRIES = 1_000_000


def request(request_id: str, record_seconds: float, max_entries: int, reason: str) -> dict[str, Any]:
    """A control file's content: record `record_seconds` of allocation history, keeping the
    newest `max_entries` events. `reason` (the finding's kind) is for the people reading it."""
    return {"request_id": request_id, "record_seconds": record_seconds, "max_entries": max_entries,
            "reason": reason}


class Request(NamedTuple):
    request_id: str
    record_seconds: float
    max_entries: int


class Refused(Exception):
    """A control file that is not a valid request within the caps."""


def _number(doc: dict[str, Any], key: str) -> float:
    value: Any = doc.get(key)
    if type(value) not in (int, float) or not math.isfinite(value):
        raise Refused(f"{key}: not a number")
    return float(value)


def parse_request(data: bytes) -> Request:
    """A control file's bytes as a request; Refused unless valid and within the caps."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise Refused("not JSON") from None
    if not isinstance(doc, dict):
        raise Refused("not an object")
    request_id = doc.get("request_id")
    if not isinstance(request_id, str) or not REQUEST_ID.fullmatch(request_id):
        raise Refused("request_id: 1-64 characters of [A-Za-z0-9_.-]")
    seconds = _number(doc, "record_seconds")
    if not 0 < seconds <= MAX_RECORD_SECONDS:
        raise Refused(f"record_seconds: must be in (0, {MAX_RECORD_SECONDS:g}]")
    entries = doc.get("max_entries")
    if type(entries) is not int or not 0 < entries <= MAX_ENTRIES:
        raise Refused(f"max_entries: an integer in [1, {MAX_ENTRIES}]")
    return Request(request_id, seconds, entries)
