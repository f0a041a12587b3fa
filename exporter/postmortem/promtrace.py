"""Prometheus `/api/v1/query_range` JSON of the exporter's own metrics, turned into TraceRows.

The series: `gpumem_process_memory_used_bytes`, `gpumem_gpu_memory_total_bytes`,
`gpumem_gpu_memory_used_bytes`, `gpumem_process_host_rss_bytes`, and for the vLLM findings
VLLM_PROMETHEUS_METRICS: up, KV usage, running/waiting, preemptions, cache config, sleep state,
and each server's memory per GPU, which tells whose processes are whose. A saved file holds one
response, or a list of responses; `analyze --prometheus` (promquery.py) gives its responses one
at a time to the same `PrometheusRows`, so a live query and a saved one replay identically.

Bounded: a file is at most MAX_JSON_BYTES; each response is turned into rows and let go before
the next is parsed; the rows of all responses together are at most MAX_ROWS; a row keeps its
series' description (shared), not a string of its own. JSON nested deeper than Python parses
is a TraceError, like any other bad input.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from ..boundedio import read_head
from ..model import CacheConfig, VllmEngineStats, VllmSample
from .tracerow import MAX_ROWS, TraceError, TraceRow, clean_text, parse_float, parse_pid

# A saved file is parsed in one piece; Python's objects take about six times the text.
MAX_JSON_BYTES = 64 << 20

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


def parse_json(text: str | bytes, where: str) -> Any:
    """JSON from outside: a TraceError (with the line) for anything json.loads refuses."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    except RecursionError:
        raise TraceError(f"{where}: invalid JSON: nested too deeply") from None


def read_prometheus_rows(path: str, max_bytes: int = MAX_JSON_BYTES,
                         max_rows: int | None = None) -> list[TraceRow]:
    """Rows from a `/api/v1/query_range` response (or a list of them) of gpumem_* series."""
    raw, more = read_head(path, max_bytes)
    if more:
        raise TraceError(f"{path}: over the {max_bytes} byte limit for JSON")
    doc = parse_json(raw.decode("utf-8-sig", errors="replace"), path)
    del raw
    several = isinstance(doc, list)
    responses = doc if several else [doc]
    del doc
    rows = PrometheusRows(MAX_ROWS if max_rows is None else max_rows)
    for i in range(len(responses)):
        rows.add(f"{path}: response {i}" if several else path, responses[i])
        responses[i] = None  # let each response go once it is rows
    if rows.known == 0:
        raise TraceError(f"{path}: no gpumem_process_memory_used_bytes or gpumem_gpu_memory_* "
                         "series with a __name__ label (query the metric names directly)")
    return rows.finish()


@dataclass
class PrometheusRows:
    """Range-query responses turned into rows, one response at a time (see the module's doc).
    `known`: how many gpumem series were used; `instances`: the `instance` labels seen."""

    max_rows: int = MAX_ROWS
    known: int = 0
    points: int = 0  # every point taken, the vLLM series' included: at most max_rows
    instances: set[str] = field(default_factory=set)
    rows: list[TraceRow] = field(default_factory=list)
    rss_rows: list[TraceRow] = field(default_factory=list)
    vllm: _VllmPoints = field(default_factory=lambda: _VllmPoints())

    def add(self, where: str, response: object, default_name: str | None = None) -> None:
        """One response; `default_name` stands in for a series without a __name__ label (None:
        skip such series)."""
        for s_index, metric, values in _matrix(response, where):
            self.instances.add(metric.get("instance", ""))
            if default_name:
                metric.setdefault("__name__", default_name)
            name = metric.get("__name__", "")
            s_where = f"{where}: result {s_index} ({clean_text(name)[:100]})"
            vllm_kind = VLLM_PROMETHEUS_METRICS.get(name)
            if vllm_kind is not None:
                for v_index, ts, value in _points(values, s_where):
                    self._count(s_where, v_index)
                    self.vllm.add(vllm_kind, metric, ts, value)
                continue
            kind = PROMETHEUS_METRICS.get(name)
            if kind is None:
                continue  # a series we do not use, like an unknown CSV column
            self.known += 1
            out = self.rss_rows if kind == "process_rss" else self.rows
            for v_index, ts, value in _points(values, s_where):
                self._count(s_where, v_index)
                out.append(_series_row(kind, metric, ts, value, s_where, v_index))

    def _count(self, where: str, index: int) -> None:
        self.points += 1
        if self.points > self.max_rows:
            raise TraceError(f"{where}: value {index}: more than {self.max_rows} points; split "
                             "the query (a larger step or a shorter range)")

    def finish(self) -> list[TraceRow]:
        rows = self.vllm.attach(_attach_rss(self.rows, self.rss_rows))
        self.rows, self.rss_rows = [], []
        return rows


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
        raise TraceError(f"{where}: response status is {clean_text(str(response.get('status')))[:40]!r}: "
                         f"{clean_text(str(response.get('error', '')))[:200]}")
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
        metric = {clean_text(str(k)): clean_text(str(v)) for k, v in series["metric"].items()}
        yield index, metric, series["values"]


def _points(values: list[Any], where: str) -> Iterator[tuple[int, float, float]]:
    for index, point in enumerate(values):
        if not isinstance(point, list) or len(point) != 2:
            raise TraceError(f"{where}: value {index} is not a [timestamp, \"value\"] pair")
        try:
            ts = parse_float(str(point[0]), "timestamp")
            value = float(str(point[1]))
        except ValueError as exc:
            raise TraceError(f"{where}: value {index}: {exc}") from None
        if math.isnan(value):
            continue  # Prometheus writes NaN for missing data; there is nothing to replay
        yield index, ts, value


def _series_row(kind: str, metric: dict[str, str], ts: float, value: float,
                origin: str, index: int) -> TraceRow:
    """One point as a row; `origin` (the series, shared by its rows) and `index` name it."""
    try:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"value {value} is not a byte count")
        count = int(value)
        gpu = metric.get("gpu", "")
        if kind != "process_rss" and not gpu:
            raise ValueError("series has no gpu label")
        pid = parse_pid(metric["pid"]) if kind.startswith("process") and "pid" in metric \
            else None
        if kind.startswith("process") and pid is None:
            raise ValueError("process series has no pid label")
    except ValueError as exc:
        raise TraceError(f"{origin}: value {index}: {exc}") from None
    uuid = metric.get("uuid", "")
    if kind == "gpu_total":
        return TraceRow(origin, ts, gpu, uuid=uuid, total_bytes=count)
    if kind == "gpu_used":
        return TraceRow(origin, ts, gpu, uuid=uuid, used_bytes=count)
    rss = kind == "process_rss"
    return TraceRow(origin, ts, gpu, pid=pid, uuid=uuid, process=metric.get("process", ""),
                    role=metric.get("role", ""), container=metric.get("container", ""),
                    pod=metric.get("pod", ""), namespace=metric.get("namespace", ""),
                    used_bytes=None if rss else count, host_rss_bytes=count if rss else None)


def _attach_rss(rows: list[TraceRow], rss_rows: list[TraceRow]) -> list[TraceRow]:
    """Host RSS series have no gpu label: give each value to that pid's rows at that time."""
    if not rss_rows:
        return rows
    rss = {(r.timestamp, r.pid): r.host_rss_bytes for r in rss_rows}
    return [replace(r, host_rss_bytes=rss.get((r.timestamp, r.pid), r.host_rss_bytes))
            if r.pid is not None else r for r in rows]


__all__ = [
    "MAX_JSON_BYTES",
    "MAX_ROWS",
    "PROMETHEUS_METRICS",
    "VLLM_PROMETHEUS_METRICS",
    "PrometheusRows",
    "parse_json",
    "read_prometheus_rows",
]
