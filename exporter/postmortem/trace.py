"""Recorded traces: read them into Snapshots for offline replay, and write them back.

Two input formats:
- the trace CSV (a public interface: a change is a CHANGELOG entry): header
  `timestamp,gpu,pid,process,used_bytes` plus optional columns (`total_bytes`, `host_rss_bytes`,
  `role`, `uuid`, `start_time`, ...). A row with an empty `pid` is a GPU-level row giving the
  GPU's own used/total; unknown columns are ignored.
  What the detectors read beyond memory rides in optional columns too, so a trace replays
  everything the live daemon saw (a reader that ignores them still gets the memory):
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
  JSON fields are read by name: unknown names are ignored and missing ones take their defaults,
  so traces of older and newer versions load.
- Prometheus `/api/v1/query_range` JSON of the exporter's own metrics
  (`gpumem_process_memory_used_bytes`, `gpumem_gpu_memory_total_bytes`,
  `gpumem_gpu_memory_used_bytes`, `gpumem_process_host_rss_bytes`, and for the vLLM findings
  the VLLM_PROMETHEUS_METRICS: up, KV usage, running/waiting, preemptions, cache config,
  sleep state, and each server's memory per GPU, which tells whose processes are whose): one
  response, or a list of responses, per file.

Both become `TraceRow`s first; rows are then grouped by timestamp into Snapshots, so several
files (say, one per GPU, or process and GPU series exported separately) merge into one replay.
Every problem in the input is a `TraceError` naming file:line (or the JSON result) and what is
wrong; nothing is silently guessed.
"""
from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypedDict, TypeVar

from ..boundedio import read_head
from ..model import (
    AllocatorStats,
    CacheConfig,
    GpuSample,
    HostMemory,
    OomMessage,
    ProcessSample,
    Snapshot,
    VllmEngineStats,
    VllmSample,
)
from .atomic import atomic_file
from .cells import decode_list, decode_one, encode

# Bounds on outside input: a trace is read whole into memory, so cap what we accept.
MAX_CSV_BYTES = 1 << 30
MAX_JSON_BYTES = 256 << 20  # JSON is parsed in one piece, hence the smaller cap
MAX_ROWS = 5_000_000

REQUIRED_COLUMNS = ("timestamp", "gpu", "pid", "process", "used_bytes")
# The columns write_csv produces; the reader understands all of them and ignores any other.
CSV_COLUMNS = REQUIRED_COLUMNS + (
    "total_bytes", "host_rss_bytes", "role", "uuid", "start_time", "unified",
    "container", "pod", "namespace", "endpoint",
    "host_total_bytes", "host_available_bytes", "host_psi_some_avg10", "host_oom_kills",
    "gpu_error", "trigger", "vllm", "oom_events", "allocator",
)
MAX_JSON_CELL_BYTES = 1 << 20  # one vllm / oom_events / allocator cell

_T = TypeVar("_T")

PROMETHEUS_METRICS = {
    "gpumem_process_memory_used_bytes": "process_used",
    "gpumem_process_host_rss_bytes": "process_rss",
    "gpumem_gpu_memory_total_bytes": "gpu_total",
    "gpumem_gpu_memory_used_bytes": "gpu_used",
}

# The vLLM series the detectors need (budget, preemption-based fragmentation, sleep), as
# the exporter names them; what each becomes (see _VllmPoints).
VLLM_PROMETHEUS_METRICS = {
    "gpumem_vllm_up": "up",
    "gpumem_vllm_kv_cache_usage_ratio": "kv_cache_usage_ratio",
    "gpumem_vllm_requests_running": "requests_running",
    "gpumem_vllm_requests_waiting": "requests_waiting",
    "gpumem_vllm_preemptions_total": "preemptions_total",
    "gpumem_vllm_cache_config_info": "cache_config",
    "gpumem_vllm_engine_sleep_state": "sleep_state",
    "gpumem_vllm_memory_used_bytes": "server_gpu",  # {endpoint, gpu}: the server's processes
}


class TraceError(ValueError):
    """A trace file that cannot be read as a trace; the message names file:line."""


@dataclass(frozen=True)
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


# ---------------------------------------------------------------- value parsing

def _parse_float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} is not a number: {text[:40]!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{what} is not finite: {text[:40]!r}")
    return value


def _parse_bytes(text: str, what: str) -> int:
    """A non-negative integer byte count; "1.5e9" is accepted when it is a whole number."""
    try:
        value = int(text)
    except ValueError:
        f = _parse_float(text, what)
        if f != int(f):
            raise ValueError(f"{what} is not a whole number of bytes: {text[:40]!r}") from None
        value = int(f)
    if value < 0:
        raise ValueError(f"{what} is negative: {text[:40]!r}")
    return value


def _parse_pid(text: str) -> int:
    try:
        pid = int(text)
    except ValueError:
        raise ValueError(f"pid is not an integer: {text[:40]!r}") from None
    if pid <= 0:
        raise ValueError(f"pid must be positive: {text[:40]!r}")
    return pid


_TRUE = {"1", "true", "yes", "y", "t"}
_FALSE = {"0", "false", "no", "n", "f"}


def _parse_bool(text: str, what: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{what} is not a boolean: {text[:40]!r}")


def _opt(cell: str | None, parse: Callable[[str, str], _T], what: str) -> _T | None:
    cell = (cell or "").strip()
    return None if cell == "" else parse(cell, what)


# ---------------------------------------------------------------- CSV

def _bounded_lines(handle: Iterable[str], limit: int, path: str) -> Iterator[str]:
    """Yield lines, failing once more than `limit` bytes have been read (files may grow)."""
    total = 0
    for line in handle:
        total += len(line)
        if total > limit:
            raise TraceError(f"{path}: larger than the {limit} byte limit for a trace")
        yield line


def _csv_row(path: str, line: int, cells: dict[str, str]) -> TraceRow:
    origin = f"{path}:{line}"
    try:
        timestamp = _parse_float(cells["timestamp"].strip(), "timestamp")
        gpu = cells["gpu"].strip()
        if not gpu:
            raise ValueError("gpu is empty")
        pid_text = cells["pid"].strip()
        pid = _parse_pid(pid_text) if pid_text else None
        host = None
        host_total = _opt(cells.get("host_total_bytes"), _parse_bytes, "host_total_bytes")
        host_avail = _opt(cells.get("host_available_bytes"), _parse_bytes, "host_available_bytes")
        if host_total is not None and host_avail is not None:
            host = HostMemory(
                total_bytes=host_total, available_bytes=host_avail,
                psi_some_avg10=_opt(cells.get("host_psi_some_avg10"), _parse_float,
                                    "host_psi_some_avg10"),
                oom_kills=_opt(cells.get("host_oom_kills"), _parse_bytes, "host_oom_kills"))
        return TraceRow(
            origin=origin, timestamp=timestamp, gpu=gpu, pid=pid,
            process=cells["process"],
            used_bytes=_opt(cells["used_bytes"], _parse_bytes, "used_bytes"),
            total_bytes=_opt(cells.get("total_bytes"), _parse_bytes, "total_bytes"),
            host_rss_bytes=_opt(cells.get("host_rss_bytes"), _parse_bytes, "host_rss_bytes"),
            role=(cells.get("role") or "").strip(),
            uuid=(cells.get("uuid") or "").strip(),
            start_time=_opt(cells.get("start_time"), _parse_float, "start_time"),
            unified=_opt(cells.get("unified"), _parse_bool, "unified"),
            container=cells.get("container") or "", pod=cells.get("pod") or "",
            namespace=cells.get("namespace") or "", endpoint=cells.get("endpoint") or "",
            host=host, gpu_error=(cells.get("gpu_error") or "").strip(),
            trigger=(cells.get("trigger") or "").strip(),
            vllm=_json_cell(cells, "vllm", lambda v: tuple(decode_list(VllmSample, v, "vllm"))),
            oom_events=_json_cell(cells, "oom_events",
                                  lambda v: tuple(decode_list(OomMessage, v, "oom_events"))) or (),
            allocator=_json_cell(cells, "allocator",
                                 lambda v: decode_one(AllocatorStats, v, "allocator")))
    except ValueError as exc:
        raise TraceError(f"{origin}: {exc}") from None


def _json_cell(cells: dict[str, str], name: str, decode: Callable[[object], _T]) -> _T | None:
    text = (cells.get(name) or "").strip()
    if not text:
        return None
    if len(text) > MAX_JSON_CELL_BYTES:
        raise ValueError(f"{name} is over the {MAX_JSON_CELL_BYTES} byte limit for a cell")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc.msg}") from None
    return decode(value)


def read_csv_rows(path: str, max_bytes: int = MAX_CSV_BYTES,
                  max_rows: int = MAX_ROWS) -> Iterator[TraceRow]:
    """Stream the rows of a trace CSV, validating each."""
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as handle:
        reader = csv.reader(_bounded_lines(handle, max_bytes, path), strict=True)
        try:
            header = next(reader, None)
            if header is None:
                raise TraceError(f"{path}:1: empty file, expected a header "
                                 f"{','.join(REQUIRED_COLUMNS)}")
            header = [h.strip() for h in header]
            missing = [c for c in REQUIRED_COLUMNS if c not in header]
            if missing:
                raise TraceError(f"{path}:1: header lacks column(s) {', '.join(missing)} "
                                 f"(need {','.join(REQUIRED_COLUMNS)})")
            dupes = sorted({h for h in header if h and header.count(h) > 1})
            if dupes:
                raise TraceError(f"{path}:1: duplicate column(s) {', '.join(dupes)}")
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
                yield _csv_row(path, line, dict(zip(header, cells, strict=True)))
        except csv.Error as exc:
            raise TraceError(f"{path}:{reader.line_num}: malformed CSV: {exc}") from None


def write_csv(snapshots: Iterable[Snapshot], path: str,
              triggers: Mapping[float, Sequence[str]] | None = None) -> None:
    """Write snapshots as a trace CSV that `read_trace` reads back to the same snapshots.
    `triggers`: snapshot timestamp -> the flight-recorder triggers of that tick (the
    `trigger` column).

    Each GPU gets a GPU-level row (empty pid) carrying its used/total and the host's memory,
    then one row per process. Written to a temporary file and renamed, so a reader (or a
    crash) never sees half a trace. The temporary file, `<path>.tmp.<pid>.<random>`, is made
    new (O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600): a link planted in the directory is never
    written through.
    """
    triggers = triggers or {}
    # errors="replace": a name that is not valid Unicode must not lose the whole trace
    with atomic_file(path, encoding="utf-8", errors="replace", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for snap in snapshots:
            ts = repr(float(snap.timestamp))
            host = snap.host
            trigger = "+".join(triggers.get(snap.timestamp, ()))
            for i, g in enumerate(snap.gpus):
                row = _gpu_cells(ts, g, host, trigger)
                if i == 0:  # the tick's own data, once
                    if snap.vllm:
                        row[_COL["vllm"]] = encode(list(snap.vllm))
                    if snap.log_events:
                        row[_COL["oom_events"]] = encode(
                            [_as_message(e) for e in snap.log_events])
                writer.writerow(row)
                for p in g.processes:
                    writer.writerow(_process_cells(ts, g, p))


def _text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value.replace("\x00", "")  # a NUL breaks CSV readers; names never hold one
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


_COL = {c: i for i, c in enumerate(CSV_COLUMNS)}


def _as_message(event: OomMessage) -> OomMessage:
    """The message as parsed (an OomEvent's verdict is the analysis's, redone on replay)."""
    if type(event) is OomMessage:
        return event
    return OomMessage(**{f.name: getattr(event, f.name) for f in fields(OomMessage)})


def _gpu_cells(ts: str, g: GpuSample, host: HostMemory | None, trigger: str = "") -> list[str]:
    row = dict.fromkeys(CSV_COLUMNS, "")
    row.update(timestamp=ts, gpu=_text(g.index), used_bytes=_text(g.used_bytes),
               total_bytes=_text(g.total_bytes), uuid=_text(g.uuid), unified=_text(g.unified),
               gpu_error=_text(g.error or ("" if g.up else "down")), trigger=trigger)
    if host is not None:
        row.update(host_total_bytes=_text(host.total_bytes),
                   host_available_bytes=_text(host.available_bytes),
                   host_psi_some_avg10=_text(host.psi_some_avg10),
                   host_oom_kills=_text(host.oom_kills))
    return [row[c] for c in CSV_COLUMNS]


def _process_cells(ts: str, g: GpuSample, p: ProcessSample) -> list[str]:
    row = dict.fromkeys(CSV_COLUMNS, "")
    row.update(timestamp=ts, gpu=_text(g.index), pid=str(p.pid), process=_text(p.name),
               used_bytes=_text(p.used_bytes), total_bytes=_text(g.total_bytes),
               host_rss_bytes=_text(p.host_rss_bytes), role=_text(p.role), uuid=_text(g.uuid),
               start_time=_text(p.start_time), unified=_text(g.unified),
               container=_text(p.container), pod=_text(p.pod), namespace=_text(p.namespace),
               endpoint=_text(p.endpoint),
               allocator=encode(p.allocator) if p.allocator is not None else "")
    return [row[c] for c in CSV_COLUMNS]


# ---------------------------------------------------------------- Prometheus JSON

def read_prometheus_rows(path: str, max_bytes: int = MAX_JSON_BYTES,
                         max_rows: int = MAX_ROWS) -> list[TraceRow]:
    """Rows from a `/api/v1/query_range` response (or a list of them) of gpumem_* series."""
    raw, more = read_head(path, max_bytes)
    if more:
        raise TraceError(f"{path}: over the {max_bytes} byte limit for JSON")
    text = raw.decode("utf-8-sig", errors="replace")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    responses = doc if isinstance(doc, list) else [doc]
    rows, known = prometheus_rows(
        ((f"{path}: response {i}" if isinstance(doc, list) else path, response, None)
         for i, response in enumerate(responses)), max_rows)
    if known == 0:
        raise TraceError(f"{path}: no gpumem_process_memory_used_bytes or gpumem_gpu_memory_* "
                         "series with a __name__ label (query the metric names directly)")
    return rows


def prometheus_rows(responses: Iterable[tuple[str, object, str | None]],
                    max_rows: int = MAX_ROWS) -> tuple[list[TraceRow], int]:
    """(rows, how many gpumem series were used) from (where, query_range response, name)
    triples; `name` stands in for a series without a __name__ label (None: skip such series).
    Shared by saved JSON files and live queries (exporter.postmortem.promquery)."""
    rows: list[TraceRow] = []
    rss_rows: list[TraceRow] = []
    vllm = _VllmPoints()
    known = 0
    for where, response, default_name in responses:
        for s_index, metric, values in _matrix(response, where):
            if default_name:
                metric.setdefault("__name__", default_name)
            vllm_kind = VLLM_PROMETHEUS_METRICS.get(metric.get("__name__", ""))
            if vllm_kind is not None:
                s_where = f"{where}: result {s_index} ({metric['__name__']})"
                for ts, value in _points(values, s_where):
                    vllm.add(vllm_kind, metric, ts, value)
                continue
            kind = PROMETHEUS_METRICS.get(metric.get("__name__", ""))
            if kind is None:
                continue  # a series we do not use, like an unknown CSV column
            known += 1
            s_where = f"{where}: result {s_index} ({metric['__name__']})"
            for v_index, (ts, value) in enumerate(_points(values, s_where)):
                origin = f"{s_where}: value {v_index}"
                if len(rows) + len(rss_rows) >= max_rows:
                    raise TraceError(f"{origin}: more than {max_rows} points; split the query "
                                     "(a larger step or a shorter range)")
                row = _series_row(kind, metric, ts, value, origin)
                (rss_rows if kind == "process_rss" else rows).append(row)
    return vllm.attach(_attach_rss(rows, rss_rows)), known


class _VllmPoints:
    """The vLLM series of a range query, gathered per timestamp and endpoint, then given to
    the rows: each timestamp's servers ride on its first row (as the CSV's `vllm` cell does),
    and a serving process (role vllm) gets the endpoint whose memory series names its GPU
    when exactly one does (the process series carries no endpoint label)."""

    def __init__(self) -> None:
        # ts -> endpoint -> {"up": bool, "engines": {(model, engine): {field: value}},
        #                    "cache": CacheConfig}
        self.servers: dict[float, dict[str, dict[str, Any]]] = {}
        self.on_gpu: dict[tuple[float, str], set[str]] = {}

    def add(self, kind: str, metric: dict[str, str], ts: float, value: float) -> None:
        endpoint = metric.get("endpoint", "")
        if not endpoint:
            return
        if kind == "server_gpu":
            if metric.get("gpu"):
                self.on_gpu.setdefault((ts, metric["gpu"]), set()).add(endpoint)
            return
        server = self.servers.setdefault(ts, {}).setdefault(
            endpoint, {"up": None, "engines": {}, "cache": None, "sleep": {}})
        if kind == "up":
            server["up"] = value >= 1
        elif kind == "cache_config":
            server["cache"] = _cache_config(metric)
        elif kind == "sleep_state":  # the exporter's level per {endpoint, engine}; no model label
            if value in _SLEEP_LEVELS:
                server["sleep"][metric.get("engine", "")] = _SLEEP_LEVELS[value]
        elif math.isfinite(value) and value >= 0 and not (kind == "kv_cache_usage_ratio" and value > 1):
            self._engine(server, metric)[kind] = value

    @staticmethod
    def _engine(server: dict[str, Any], metric: dict[str, str]) -> dict[str, Any]:
        engines: dict[tuple[str, str], dict[str, Any]] = server["engines"]
        return engines.setdefault((metric.get("model", ""), metric.get("engine", "")), {})

    def attach(self, rows: list[TraceRow]) -> list[TraceRow]:
        if not self.servers and not self.on_gpu:
            return rows
        given: set[float] = set()
        out = []
        for r in rows:
            if r.pid is not None and r.role == "vllm" and not r.endpoint:
                names = self.on_gpu.get((r.timestamp, r.gpu), set())
                if len(names) == 1:
                    r = replace(r, endpoint=next(iter(names)))
            if r.timestamp not in given and r.timestamp in self.servers:
                given.add(r.timestamp)
                r = replace(r, vllm=self._samples(self.servers[r.timestamp]))
            out.append(r)
        return out

    @staticmethod
    def _samples(servers: dict[str, dict[str, Any]]) -> tuple[VllmSample, ...]:
        out = []
        for endpoint, s in sorted(servers.items()):
            engines: dict[tuple[str, str], dict[str, Any]] = s["engines"]
            for engine, state in s["sleep"].items():  # onto each model of that engine
                for fields_ in [f for (_, e), f in engines.items() if e == engine] or [
                        engines.setdefault(("", engine), {})]:
                    fields_["sleep_state"] = state
            out.append(VllmSample(
                endpoint=endpoint, up=s["up"] if s["up"] is not None else bool(engines),
                cache_config=s["cache"],
                engines=tuple(VllmEngineStats(model=model, engine=engine, **fields_)
                              for (model, engine), fields_ in sorted(engines.items()))))
        return tuple(out)


# gpumem_vllm_engine_sleep_state's levels (serve/exposition.py) in vLLM's words (VllmEngineStats).
_SLEEP_LEVELS = {0.0: "awake", 1.0: "weights_offloaded", 2.0: "discard_all"}


def _cache_config(labels: dict[str, str]) -> CacheConfig:
    """vllm:cache_config_info's labels as the exporter re-exports them (unknown ones ignored)."""
    def number(name: str, kind: Callable[[str], _T]) -> _T | None:
        try:
            return kind(labels[name]) if labels.get(name) else None
        except ValueError:
            return None

    util = number("gpu_memory_utilization", float)
    return CacheConfig(
        gpu_memory_utilization=util if util is not None and 0 < util <= 1 else None,
        num_gpu_blocks=number("num_gpu_blocks", int), block_size=number("block_size", int),
        cache_dtype=labels.get("cache_dtype", ""),
        kv_cache_memory_bytes=number("kv_cache_memory_bytes", int),
        kv_cache_size_tokens=number("kv_cache_size_tokens", int),
        kv_cache_max_concurrency=number("kv_cache_max_concurrency", float))


def _matrix(response: object, where: str) -> Iterator[tuple[int, dict[str, str], list[Any]]]:
    if not isinstance(response, dict):
        raise TraceError(f"{where}: expected a query_range response object")
    if response.get("status") not in (None, "success"):
        raise TraceError(f"{where}: response status is {str(response.get('status'))[:40]!r}: "
                         f"{str(response.get('error', ''))[:200]}")
    data = response.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "matrix":
        raise TraceError(f"{where}: expected data.resultType 'matrix' (a range query)")
    result = data.get("result")
    if not isinstance(result, list):
        raise TraceError(f"{where}: data.result is not a list")
    for index, series in enumerate(result):
        if (not isinstance(series, dict) or not isinstance(series.get("metric"), dict)
                or not isinstance(series.get("values"), list)):
            raise TraceError(f"{where}: result {index} lacks 'metric' and 'values'")
        metric = {str(k): str(v) for k, v in series["metric"].items()}
        yield index, metric, series["values"]


def _points(values: list[Any], where: str) -> Iterator[tuple[float, float]]:
    for index, point in enumerate(values):
        if not isinstance(point, list) or len(point) != 2:
            raise TraceError(f"{where}: value {index} is not a [timestamp, \"value\"] pair")
        try:
            ts = _parse_float(str(point[0]), "timestamp")
            value = float(str(point[1]))
        except ValueError as exc:
            raise TraceError(f"{where}: value {index}: {exc}") from None
        if math.isnan(value):
            continue  # Prometheus writes NaN for missing data; there is nothing to replay
        yield ts, value


def _series_row(kind: str, metric: dict[str, str], ts: float, value: float,
                origin: str) -> TraceRow:
    try:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"value {value} is not a byte count")
        count = int(value)
        gpu = metric.get("gpu", "")
        if kind != "process_rss" and not gpu:
            raise ValueError("series has no gpu label")
        pid = _parse_pid(metric["pid"]) if kind.startswith("process") and "pid" in metric \
            else None
        if kind.startswith("process") and pid is None:
            raise ValueError("process series has no pid label")
    except ValueError as exc:
        raise TraceError(f"{origin}: {exc}") from None
    common = TraceRow(origin=origin, timestamp=ts, gpu=gpu, uuid=metric.get("uuid", ""))
    if kind == "gpu_total":
        return replace(common, total_bytes=count)
    if kind == "gpu_used":
        return replace(common, used_bytes=count)
    proc = replace(common, pid=pid, process=metric.get("process", ""), role=metric.get("role", ""),
                   container=metric.get("container", ""), pod=metric.get("pod", ""),
                   namespace=metric.get("namespace", ""))
    if kind == "process_rss":
        return replace(proc, host_rss_bytes=count)
    return replace(proc, used_bytes=count)


def _attach_rss(rows: list[TraceRow], rss_rows: list[TraceRow]) -> list[TraceRow]:
    """Host RSS series have no gpu label: give each value to that pid's rows at that time."""
    if not rss_rows:
        return rows
    rss = {(r.timestamp, r.pid): r.host_rss_bytes for r in rss_rows}
    return [replace(r, host_rss_bytes=rss.get((r.timestamp, r.pid), r.host_rss_bytes))
            if r.pid is not None else r for r in rows]


# ---------------------------------------------------------------- rows -> snapshots

def read_rows(path: str) -> list[TraceRow]:
    """The rows of one trace file, CSV or Prometheus JSON (told apart by their first byte)."""
    try:  # a regular file only: a FIFO or device would hang or never end
        head = read_head(path, 64)[0].lstrip(b"\xef\xbb\xbf \t\r\n")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if head[:1] in (b"{", b"["):
        return read_prometheus_rows(path)
    return list(read_csv_rows(path))


def read_trace(path: str) -> list[Snapshot]:
    """One trace file as a time-ordered list of Snapshots."""
    return snapshots_from_rows(read_rows(path))


def read_traces(paths: Iterable[str]) -> list[Snapshot]:
    """Several trace files merged into one time-ordered list (rows at the same time join)."""
    return snapshots_from_rows(_read_all(paths))


def _read_all(paths: Iterable[str]) -> list[TraceRow]:
    rows: list[TraceRow] = []
    for path in paths:
        rows.extend(read_rows(path))
        if len(rows) > MAX_ROWS:
            raise TraceError(f"{path}: the traces hold more than {MAX_ROWS} rows together")
    return rows


_GPU_FIELDS = ("uuid", "total_bytes", "unified")


class _GpuEntry(TypedDict):
    """One GPU at one timestamp while rows are grouped."""

    gpu: dict[str, Any]  # merged GPU fields: uuid, total_bytes, unified, used_bytes
    origins: dict[str, str]  # field -> the row that gave it
    procs: dict[tuple[int, float | None], TraceRow]  # (pid, start_time) -> row


def snapshots_from_rows(rows: Iterable[TraceRow]) -> list[Snapshot]:
    """Group rows by timestamp into Snapshots. Conflicting duplicates are a TraceError."""
    return _group(rows)[0]


def _group(rows: Iterable[TraceRow]) -> tuple[list[Snapshot], list[tuple[float, str]]]:
    # timestamp -> gpu -> {"gpu": merged GPU fields, "procs": {(pid, start): row}}
    grouped: dict[float, dict[str, _GpuEntry]] = {}
    hosts: dict[float, HostMemory] = {}
    vllm: dict[float, tuple[VllmSample, ...]] = {}
    events: dict[float, list[OomMessage]] = {}
    triggers: dict[float, list[str]] = {}
    for row in rows:
        gpus = grouped.setdefault(row.timestamp, {})
        entry = gpus.setdefault(row.gpu, {"gpu": {}, "origins": {}, "procs": {}})
        if row.host is not None:
            hosts.setdefault(row.timestamp, row.host)
        if row.vllm is not None:
            vllm.setdefault(row.timestamp, row.vllm)
        if row.oom_events:
            events.setdefault(row.timestamp, []).extend(row.oom_events)
        for t in row.trigger.split("+") if row.trigger else ():
            have = triggers.setdefault(row.timestamp, [])
            if t not in have:
                have.append(t)
        for name in _GPU_FIELDS:
            _merge_field(entry, name, getattr(row, name), row.origin)
        if row.pid is None:
            _merge_field(entry, "used_bytes", row.used_bytes, row.origin)
            _merge_field(entry, "gpu_error", row.gpu_error, row.origin)
            continue
        key = (row.pid, row.start_time)
        if key in entry["procs"]:
            first = entry["procs"][key].origin
            raise TraceError(f"{row.origin}: pid {row.pid} on gpu {row.gpu} at {row.timestamp!r} "
                             f"already given at {first}")
        entry["procs"][key] = row
    snapshots = [Snapshot(timestamp=ts, host=hosts.get(ts), vllm=vllm.get(ts, ()),
                          log_events=tuple(events.get(ts, ())),
                          gpus=tuple(_gpu_sample(index, grouped[ts][index])
                                     for index in sorted(grouped[ts], key=_gpu_order)))
                 for ts in sorted(grouped)]
    return snapshots, [(ts, "+".join(triggers[ts])) for ts in sorted(triggers)]


@dataclass(frozen=True)
class Trace:
    """Trace files read for replay: the snapshots, and the flight recorder's triggers
    ((tick time, `+`-joined triggers), oldest first) where the files mark them."""

    snapshots: list[Snapshot]
    triggers: list[tuple[float, str]]


def load_traces(paths: Iterable[str]) -> Trace:
    """Like read_traces, with the triggers the files record."""
    return Trace(*_group(_read_all(paths)))


def _merge_field(entry: _GpuEntry, name: str, value: object, origin: str) -> None:
    if value is None or value == "":
        return
    have = entry["gpu"].get(name)
    if have is None:
        entry["gpu"][name] = value
        entry["origins"][name] = origin
    elif have != value:
        raise TraceError(f"{origin}: {name} {value!r} contradicts {have!r} given at "
                         f"{entry['origins'][name]}")


def _gpu_order(index: str) -> tuple[tuple[int, int, str], ...]:
    """"10" after "9"; MIG "0/1" after "0"."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in index.split("/"))


def _gpu_sample(index: str, entry: _GpuEntry) -> GpuSample:
    info = entry["gpu"]
    total, used = info.get("total_bytes"), info.get("used_bytes")
    free = total - used if total is not None and used is not None and used <= total else None
    procs = tuple(
        ProcessSample(pid=pid, used_bytes=r.used_bytes, name=r.process,
                      host_rss_bytes=r.host_rss_bytes, start_time=r.start_time,
                      container=r.container, pod=r.pod, namespace=r.namespace,
                      role=r.role or "other", endpoint=r.endpoint, allocator=r.allocator)
        for (pid, _), r in sorted(entry["procs"].items(), key=lambda kv: (kv[0][0], kv[0][1] or 0.0)))
    error = info.get("gpu_error") or ""
    return GpuSample(index=index, uuid=info.get("uuid") or f"trace-gpu-{index}",
                     up=not error, error="" if error == "down" else error,
                     total_bytes=total, used_bytes=used, free_bytes=free,
                     unified=bool(info.get("unified", False)),
                     mig="/" in index, processes=procs)


__all__ = [
    "CSV_COLUMNS",
    "Trace",
    "TraceError",
    "TraceRow",
    "load_traces",
    "read_csv_rows",
    "read_prometheus_rows",
    "read_rows",
    "read_trace",
    "read_traces",
    "snapshots_from_rows",
    "write_csv",
]
