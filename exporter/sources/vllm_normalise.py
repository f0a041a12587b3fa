"""Turn a vLLM `/metrics` page, whatever the vLLM version, into VllmEngineStats and CacheConfig.

vLLM renamed its metrics over time (V0 `gpu_cache_usage_perc` became V1 `kv_cache_usage_perc`,
`gpu_prefix_cache_*` became `prefix_cache_*`), added an `engine` label for data-parallel engines,
and its counters come out of prometheus_client as `<name>_total` plus a `<name>_created` gauge.
We key on sample names with `_total` stripped, so typed, untyped and renamed families all land
in the same place, and prefer the current name when a release exposes both.

A real page is mostly histograms (fourteen request histograms per engine, the API server's
`http_*` families, Python's collectors: about 500 lines) and we read none of them. Only the
`vllm:` samples we read go to the parser, a small fraction of the page (bench/vllm_parse.py).
The price: a malformed line in a family we never read no longer fails the scrape.

The work a page can cost is bounded whatever it holds (docs/memory.md): `vllm:` lines are found
by a regex anchored on newlines (a page of other metrics is one fast scan); at most MAX_VLLM_LINES of them are looked at
and MAX_SAMPLE_LINES handed to the parser (a page cut there counts in the `vllm_pages` budget);
and a page without any is parsed only as far as MAX_SNIFF_CHARS to say what it is. A series
without an `engine` label (V0 names, before data parallelism) is engine "0", so a page that
switches between V0 and V1 names does not switch its series' labels.
"""
from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from ..model import CacheConfig, VllmEngineStats
from ..units import MAX_BYTES

# Field of VllmEngineStats -> metric base names, preferred first.
FIELD_METRICS: dict[str, tuple[str, ...]] = {
    "kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "requests_running": ("vllm:num_requests_running",),
    "requests_waiting": ("vllm:num_requests_waiting",),
    "preemptions_total": ("vllm:num_preemptions",),
    "prefix_cache_queries_total": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits_total": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
}
_WANTED = {name: field for field, names in FIELD_METRICS.items() for name in names}
_PREFERENCE = {name: rank for names in FIELD_METRICS.values() for rank, name in enumerate(names)}
CACHE_CONFIG_METRIC = "vllm:cache_config_info"
# vllm:engine_sleep_state{sleep_state=awake|weights_offloaded|discard_all}: one 0/1 series each
# (vllm/v1/metrics/loggers.py, sleep mode, V1 0.11+).
SLEEP_STATE_METRIC = "vllm:engine_sleep_state"
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
# A KV usage a hair over 1 is float noise in vLLM's 1 - free/total; more is a broken server.
RATIO_SLACK = 1e-6
MAX_REJECTED_NAMES = 16

_CACHE_CONFIG_LINE = re.compile(r"[ \t]*vllm:cache_config_info[{ \t]")
# A `vllm:` sample line, and its metric name.
_VLLM_SAMPLE = re.compile(r"\n[ \t]*(vllm:[^{ \t\n]*)[^\n]*")
_VLLM_FIRST = re.compile(r"[ \t]*(vllm:[^{ \t\n]*)[^\n]*")
MAX_CACHED_LINE_CHARS = 4096
# The per-page budget: `vllm:` lines looked at (a 64-engine V1 page has about 25,000), sample
# lines handed to the parser (about 12 per engine are read), and how much of a page without any
# is parsed to tell "not exposition text" from "no vllm: metrics".
MAX_VLLM_LINES = 32_768
MAX_SAMPLE_LINES = 1024
MAX_SNIFF_CHARS = 8 * 1024
# Counts and sizes past these are not a server's numbers: dropped as out of range (2^53: exact in
# a float; sizes as units.MAX_BYTES).
MAX_COUNT = float(1 << 53)
_READ = frozenset({*_WANTED, *(f"{name}_total" for name in _WANTED), SLEEP_STATE_METRIC, CACHE_CONFIG_METRIC})

# A hostile or broken server must not blow up our own label cardinality or memory.
MAX_ENGINES = 64
MAX_LABEL_CHARS = 256


class ParseError(ValueError):
    """The body is not Prometheus text exposition, or holds no vLLM metrics."""


@dataclass(frozen=True)
class NormalisedMetrics:
    engines: tuple[VllmEngineStats, ...]
    cache_config: CacheConfig | None
    # Names of the metrics whose values were impossible (a negative counter, a KV usage of -5,
    # NaN): dropped, never passed on as numbers. Bounded.
    rejected: tuple[str, ...] = ()
    truncated: bool = False  # the page held more vllm: lines than the budget: the rest unread


def _vllm_lines(text: str) -> tuple[list[str], bool, bool]:
    """The `vllm:` sample lines we read (histogram series, `_created` and families we do not
    read are skipped), whether the page has any `vllm:` sample line at all, and whether the
    budget cut the page. One regex whose every match starts at a newline: a page of other
    metrics costs one scan in C."""
    lines: list[str] = []
    seen = 0
    first = _VLLM_FIRST.match(text)  # the first line has no newline before it
    for match in itertools.chain((first,) if first else (), _VLLM_SAMPLE.finditer(text)):
        seen += 1
        if seen > MAX_VLLM_LINES or len(lines) >= MAX_SAMPLE_LINES:
            return lines, True, True
        if match.group(1) in _READ:
            lines.append(match.group(0).lstrip("\n"))
    return lines, seen > 0, False


def normalise(text: str) -> NormalisedMetrics:
    """Parse exposition text; raise ParseError when it is not a vLLM metrics page."""
    values: dict[tuple[str, str], dict[str, tuple[int, float]]] = {}
    sleep: dict[tuple[str, str], dict[str, float]] = {}
    rejected: set[str] = set()
    cache_labels: list[dict[str, str]] = []
    lines, any_vllm, truncated = _vllm_lines(text)
    if not lines:
        _check_head(text)  # raises ParseError when the page is not exposition text at all
        if not any_vllm:
            raise ParseError("no vllm: metrics in the response")
    try:
        samples = []
        for line in lines:
            if _CACHE_CONFIG_LINE.match(line):
                cache_labels.append(dict(_info_labels(line)))
            else:
                samples.append(line)
        for family in text_string_to_metric_families("\n".join(samples) + "\n"):
            for sample in family.samples:
                name = sample.name
                base = name[: -len("_total")] if name.endswith("_total") else name
                field = _WANTED.get(base)
                if field is None and base != SLEEP_STATE_METRIC:
                    continue
                value = _valid(field, sample.value)
                if value is None:
                    _reject(rejected, base)
                    continue
                # No engine label (V0 names, one engine): engine "0", as V1 labels its first.
                key = (_label(sample.labels, "model_name"), _label(sample.labels, "engine") or "0")
                if key not in values:
                    if len(values) >= MAX_ENGINES:
                        continue
                    values[key] = {}
                if field is None:
                    state = sample.labels.get("sleep_state", "")
                    if state in SLEEP_STATES:
                        sleep.setdefault(key, {})[state] = value
                    continue
                _merge(values[key], field, _PREFERENCE[base], value)
    except ParseError:
        raise
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on bad text
        raise ParseError(f"not Prometheus text format: {_short(exc)}") from None
    engines = tuple(
        VllmEngineStats(model=model, engine=engine, sleep_state=_sleep_state(sleep.get((model, engine), {})),
                        **{f: v for f, (_, v) in fields.items()})
        for (model, engine), fields in sorted(values.items())
    )
    cache_config = _cache_config(cache_labels, rejected)
    return NormalisedMetrics(engines=engines, cache_config=cache_config, rejected=tuple(sorted(rejected)),
                             truncated=truncated)


def _valid(field: str | None, value: object) -> float | None:
    """The value when it is possible for its field, else None. Every field we read is a count,
    a 0/1 gauge or a ratio: never negative, never NaN or infinite."""
    if not _finite(value):
        return None
    number = float(value)  # type: ignore[arg-type]
    if number < 0 or number > MAX_COUNT:
        return None
    if field == "kv_cache_usage_ratio" and number > 1:
        return 1.0 if number <= 1 + RATIO_SLACK else None
    if field is None and number > 1:  # engine_sleep_state series are 0 or 1
        return None
    return number


def _reject(rejected: set[str], name: str) -> None:
    if len(rejected) < MAX_REJECTED_NAMES:
        rejected.add(name[:MAX_LABEL_CHARS])


def _sleep_state(flags: dict[str, float]) -> str:
    """vLLM's own words: awake, weights_offloaded (sleep level 1), discard_all (level 2);
    "asleep" when it sleeps without either (a level-0 pause); "" when not reported."""
    if not flags:
        return ""
    if flags.get("awake") == 1:
        return "awake"
    for state in ("discard_all", "weights_offloaded"):
        if flags.get(state) == 1:
            return state
    return "asleep" if flags.get("awake") == 0 else ""


def _info_labels(line: str) -> tuple[tuple[str, str], ...]:
    """The labels of an info line (`vllm:cache_config_info{...} 1`). It is the same line on
    every scrape and the costliest to parse (fifteen labels): parsed once, remembered."""
    if len(line) > MAX_CACHED_LINE_CHARS:
        return _parse_info_line(line)
    return _cached_info_line(line)


def _parse_info_line(line: str) -> tuple[tuple[str, str], ...]:
    for family in text_string_to_metric_families(line + "\n"):
        for sample in family.samples:
            return tuple(sample.labels.items())
    return ()


_cached_info_line = functools.lru_cache(maxsize=64)(_parse_info_line)


def _check_head(text: str) -> None:
    """Nothing on the page that we read: raise ParseError when it is not exposition text at all
    (a wrong URL answers with HTML or JSON), judged from its first MAX_SNIFF_CHARS (whole lines):
    parsing all of a large page would cost seconds of a core every tick."""
    if len(text) > MAX_SNIFF_CHARS:
        text = text[:text.rfind("\n", 0, MAX_SNIFF_CHARS) + 1]
    try:
        for _ in text_string_to_metric_families(text):
            pass
    except Exception as exc:
        raise ParseError(f"not Prometheus text format: {_short(exc)}") from None


def _merge(fields: dict[str, tuple[int, float]], field: str, rank: int, value: float) -> None:
    """Keep the preferred name's value; for duplicate series of one name (extra labels such
    as prometheus multiprocess `pid`) keep the largest, the conservative reading."""
    old = fields.get(field)
    if old is None or rank < old[0] or (rank == old[0] and value > old[1]):
        fields[field] = (rank, value)


def _cache_config(candidates: list[dict[str, str]], rejected: set[str]) -> CacheConfig | None:
    """CacheConfig from the labels of `vllm:cache_config_info`: vLLM 0.33 exports every field of
    its CacheConfig as a label (`{key: str(value)}`), the KV capacity it computed at start-up
    (kv_cache_size_tokens, kv_cache_max_concurrency) and --kv-cache-memory included."""
    if not candidates:
        return None
    # Data-parallel engines each report the same config; engine "0" (or the unlabelled V0
    # series) is the canonical one.
    labels = min(candidates, key=lambda lb: (lb.get("engine", "") not in ("", "0"), lb.get("engine", "")))

    def number(key: str, valid: Callable[[float], bool]) -> float | None:
        value = _opt_float(labels.get(key))
        if value is not None and not valid(value):
            _reject(rejected, f"{CACHE_CONFIG_METRIC}.{key}")
            return None
        return value

    def count(key: str, most: float = MAX_COUNT) -> int | None:
        value = number(key, lambda v: 0 <= v <= most and v == int(v))
        return None if value is None else int(value)

    dtype = labels.get("cache_dtype", "")
    return CacheConfig(
        gpu_memory_utilization=number("gpu_memory_utilization", lambda v: 0 < v <= 1),
        num_gpu_blocks=count("num_gpu_blocks"),
        block_size=count("block_size") or None,
        cache_dtype="" if dtype in ("None", "") else dtype[:64],
        kv_cache_memory_bytes=count("kv_cache_memory_bytes", MAX_BYTES),
        kv_cache_size_tokens=count("kv_cache_size_tokens"),
        kv_cache_max_concurrency=number("kv_cache_max_concurrency", lambda v: 0 <= v <= MAX_COUNT),
    )


def _opt_float(text: str | None) -> float | None:
    """vLLM stringifies every CacheConfig field, so "None", "" and "auto" mean unknown; a
    number that is not finite is unknown too."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _label(labels: dict[str, str], name: str) -> str:
    return labels.get(name, "")[:MAX_LABEL_CHARS]


def _short(exc: Exception) -> str:
    return str(exc)[:200]
