"""Turn a vLLM `/metrics` page, whatever the vLLM version, into VllmEngineStats and CacheConfig.

vLLM renamed its metrics over time (V0 `gpu_cache_usage_perc` became V1 `kv_cache_usage_perc`,
`gpu_prefix_cache_*` became `prefix_cache_*`), added an `engine` label for data-parallel engines,
and its counters come out of prometheus_client as `<name>_total` plus a `<name>_created` gauge.
We key on sample names with `_total` stripped, so typed, untyped and renamed families all land
in the same place, and prefer the current name when a release exposes both.

A real page is mostly histograms (fourteen request histograms per engine, the API server's
`http_*` families, Python's collectors: about 600 lines, 50 KiB for vLLM 0.32) and we read a few
dozen lines of it. One regular expression, built from the names we read, finds those lines
(`^vllm:<name>{labels} value`), and each is parsed strictly by hand: name, labels as the text
format escapes them, a float. prometheus_client's parser took half a millisecond for them
(bench/vllm_page_cost.py). A line of a family we read that is not valid text format fails the
scrape, as before; a malformed line in a family we never read is never looked at.

The work a page can cost is bounded whatever it holds (docs/memory.md): the scan is one regex
pass in C; at most MAX_SAMPLE_LINES lines are parsed (a page cut there counts in the
`vllm_pages` budget); and a page without any line we read is parsed only as far as
MAX_SNIFF_CHARS to say what it is. A series without an `engine` label (V0 names, before data
parallelism) is engine "0", so a page that switches between V0 and V1 names does not switch its
series' labels.
"""
from __future__ import annotations

import functools
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

# vllm:num_requests_waiting_by_reason{reason=capacity|deferred} (vLLM 0.2x+, loggers.py).
WAITING_BY_REASON_METRIC = "vllm:num_requests_waiting_by_reason"
# vllm:request_num_preemptions, a histogram over finished requests: its _sum and _count only.
REQUEST_PREEMPTIONS_SUM = "vllm:request_num_preemptions_sum"
REQUEST_PREEMPTIONS_COUNT = "vllm:request_num_preemptions_count"
# vllm:admission_rejections_total{model_name, reason}: no engine label (the API server counts).
ADMISSION_REJECTIONS_METRIC = "vllm:admission_rejections"
MAX_REASONS = 16  # per engine or model: a hostile page must not grow our label sets
# Every sample name read, as it appears on a page (a counter's base, _total and the unsuffixed
# V0 form alike).
_READ = (*_WANTED, SLEEP_STATE_METRIC, WAITING_BY_REASON_METRIC, REQUEST_PREEMPTIONS_SUM,
         REQUEST_PREEMPTIONS_COUNT, ADMISSION_REJECTIONS_METRIC, CACHE_CONFIG_METRIC)
_NAMES = sorted({n for base in _READ for n in (base, base + "_total")}, key=len, reverse=True)
# The same as prometheus_client writes them (a counter's samples end in `_total`), for a server
# asked for these alone (vllm.only_read_url): the names only, each once, as the URL's length costs
# the client (urllib3 walks it byte by byte, twice a request).
_COUNTERS = (*FIELD_METRICS["preemptions_total"], *FIELD_METRICS["prefix_cache_queries_total"],
             *FIELD_METRICS["prefix_cache_hits_total"], ADMISSION_REJECTIONS_METRIC)
SAMPLE_NAMES = tuple(sorted(name + "_total" if name in _COUNTERS else name for name in _READ))
# The lines of those families, each at the start of a line as exposition writers put them: the
# name, then `{labels}` or blanks (so a longer name sharing the prefix is not taken), then the
# rest of the line, parsed by _sample(). The literal "\nvllm:" lets the scan skip the rest of
# the page at C speed.
_WANTED_LINE = re.compile(r"\nvllm:(" + "|".join(re.escape(n[len("vllm:"):]) for n in _NAMES)
                          + r")(?=[{ \t])([^\n]*)")
_ANY_VLLM_LINE = re.compile(r"^[ \t]*vllm:", re.MULTILINE)
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*(,?)')
_VALUE = re.compile(r"[ \t]+([^ \t\r]+)(?:[ \t]+-?\d+)?[ \t\r]*")
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_ESCAPE = re.compile(r"\\.")
MAX_CACHED_LINE_CHARS = 4096
# Label sets remembered across scrapes (a 64-engine page has about a thousand), each at most
# this long: a page of ever-new labels costs a bounded cache, not memory without end.
MAX_CACHED_LABEL_SETS = 1024
MAX_CACHED_LABELS_CHARS = 512

# A hostile or broken server must not blow up our own label cardinality or memory.
MAX_ENGINES = 64
MAX_LABEL_CHARS = 256
# The per-page budget: lines we read that are parsed (a 64-engine V1 page has about 15 per
# engine), and how much of a page without any is parsed to tell "not exposition text" from "no
# vllm: metrics".
MAX_SAMPLE_LINES = 2048
MAX_SNIFF_CHARS = 8 * 1024
# Counts and sizes past these are not a server's numbers: dropped as out of range (2^53: exact in
# a float; sizes as units.MAX_BYTES).
MAX_COUNT = float(1 << 53)


class ParseError(ValueError):
    """The body is not Prometheus text exposition, or holds no vLLM metrics."""


@dataclass(frozen=True)
class NormalisedMetrics:
    engines: tuple[VllmEngineStats, ...]
    cache_config: CacheConfig | None
    # Names of the metrics whose values were impossible (a negative counter, a KV usage of -5,
    # NaN): dropped, never passed on as numbers. Bounded.
    rejected: tuple[str, ...] = ()
    # vllm:admission_rejections_total: (model, reason, rejections).
    admission_rejections: tuple[tuple[str, str, float], ...] = ()
    truncated: bool = False  # the page held more lines we read than the budget: the rest unread


def normalise(text: str) -> NormalisedMetrics:
    """Parse exposition text; raise ParseError when it is not a vLLM metrics page."""
    values: dict[tuple[str, str], dict[str, tuple[int, float]]] = {}
    sleep: dict[tuple[str, str], dict[str, float]] = {}
    waiting: dict[tuple[str, str], dict[str, float]] = {}
    finished: dict[tuple[str, str], dict[str, float]] = {}
    admission: dict[tuple[str, str], float] = {}
    rejected: set[str] = set()
    cache_labels: list[dict[str, str]] = []
    found: list[tuple[str, str]] = []
    truncated = False
    for match in _WANTED_LINE.finditer("\n" + text):
        if len(found) >= MAX_SAMPLE_LINES:
            truncated = True
            break
        found.append(("vllm:" + match.group(1), match.group(2)))
    if not found:  # rare: say what the body is (not exposition text, or no vLLM in it)
        _raise_why_no_vllm(text)
    for name, rest in found:
        if name == CACHE_CONFIG_METRIC:
            cache_labels.append(dict(_info_labels(name + rest)))
            continue
        labels, raw = _sample(name, rest)
        base = name[: -len("_total")] if name.endswith("_total") else name
        field = _WANTED.get(base)
        value = _valid(field, raw, base)
        if value is None:
            _reject(rejected, base)
            continue
        model = _label(labels, "model_name")
        if base == ADMISSION_REJECTIONS_METRIC:  # per model, not per engine
            key2 = (model, _label(labels, "reason"))
            if key2 in admission or len(admission) < MAX_REASONS:
                admission[key2] = max(value, admission.get(key2, 0.0))
            continue
        # No engine label (V0 names, one engine): engine "0", as V1 labels its first.
        key = (model, _label(labels, "engine") or "0")
        if key not in values:
            if len(values) >= MAX_ENGINES:
                continue
            values[key] = {}
        if field is not None:
            _merge(values[key], field, _PREFERENCE[base], value)
        elif base == SLEEP_STATE_METRIC:
            state = labels.get("sleep_state", "")
            if state in SLEEP_STATES:
                sleep.setdefault(key, {})[state] = value
        elif base == WAITING_BY_REASON_METRIC:
            reasons = waiting.setdefault(key, {})
            reason = _label(labels, "reason")
            if reason in reasons or len(reasons) < MAX_REASONS:
                reasons[reason] = max(value, reasons.get(reason, 0.0))
        else:  # the preemption histogram's sum and count
            part = "request_preemptions_total" if base == REQUEST_PREEMPTIONS_SUM else "requests_finished_total"
            finished.setdefault(key, {})[part] = max(value, finished.get(key, {}).get(part, 0.0))
    engines = tuple(
        VllmEngineStats(model=model, engine=engine, sleep_state=_sleep_state(sleep.get((model, engine), {})),
                        requests_waiting_by_reason=tuple(sorted(waiting.get((model, engine), {}).items())),
                        **finished.get((model, engine), {}),
                        **{f: v for f, (_, v) in fields.items()})
        for (model, engine), fields in sorted(values.items())
    )
    cache_config = _cache_config(cache_labels, rejected)
    return NormalisedMetrics(engines=engines, cache_config=cache_config, rejected=tuple(sorted(rejected)),
                             admission_rejections=tuple((m, r, v) for (m, r), v in sorted(admission.items())),
                             truncated=truncated)


def _sample(name: str, rest: str) -> tuple[dict[str, str], str]:
    """The labels (not to be changed: shared between pages) and the value text of one sample
    line (its name already read), strictly as the text format writes them; ParseError
    otherwise. A series' labels are the same text on every scrape: parsed once, remembered."""
    head, brace, tail = rest.rpartition("}")  # a value never holds "}"; a label value may
    if brace and head.startswith("{") and len(head) <= MAX_CACHED_LABELS_CHARS:
        labels = _cached_labels(head)
        m = _VALUE.fullmatch(tail) if labels is not None else None
        if labels is not None and m is not None:
            return labels, m.group(1)
    return _parse_sample(name, rest)  # not the common shape: parsed afresh, its error said


@functools.lru_cache(maxsize=MAX_CACHED_LABEL_SETS)
def _cached_labels(head: str) -> dict[str, str] | None:
    """The labels of `head` + "}" when that is exactly one well-formed label set, else None."""
    try:
        labels, at = _parse_labels("", head + "}")
    except ParseError:
        return None
    return labels if at == len(head) + 1 else None


def _parse_sample(name: str, rest: str) -> tuple[dict[str, str], str]:
    labels, at = _parse_labels(name, rest)
    m = _VALUE.fullmatch(rest, at)
    if m is None:
        raise ParseError(f"not Prometheus text format: no value in {name}{rest[:80]!r}")
    return labels, m.group(1)


def _parse_labels(name: str, rest: str) -> tuple[dict[str, str], int]:
    """The labels at the start of `rest` (none unless it starts with "{") and where they end."""
    labels: dict[str, str] = {}
    at = 0
    if rest.startswith("{"):
        at = 1
        while True:
            if rest.startswith("}", at):
                at += 1
                break
            m = _LABEL.match(rest, at)
            if m is None:
                raise ParseError(f"not Prometheus text format: bad labels in {name}{rest[:80]!r}")
            value = m.group(2)
            labels[m.group(1)] = _ESCAPE.sub(lambda e: _ESCAPES.get(e.group(0), e.group(0)), value) \
                if "\\" in value else value
            at = m.end()
            if not m.group(3) and not rest.startswith("}", at):
                raise ParseError(f"not Prometheus text format: bad labels in {name}{rest[:80]!r}")
    return labels, at


def _valid(field: str | None, text: str, base: str) -> float | None:
    """The value when it is possible for its field, else None. Every value we read is a count,
    a 0/1 gauge or a ratio: never negative, never NaN or infinite. ParseError when the text is
    no number at all."""
    try:
        if "_" in text:  # float() takes 1_000; the text format does not
            raise ValueError(text)
        number = float(text)
    except ValueError:
        raise ParseError(f"not Prometheus text format: {base} has the value {text[:40]!r}") from None
    if not math.isfinite(number) or number < 0 or number > MAX_COUNT:
        return None
    if field == "kv_cache_usage_ratio" and number > 1:
        return 1.0 if number <= 1 + RATIO_SLACK else None
    if base == SLEEP_STATE_METRIC and number > 1:  # engine_sleep_state series are 0 or 1
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
    every scrape and the costliest to parse (about forty labels in 0.32): parsed once,
    remembered."""
    if len(line) > MAX_CACHED_LINE_CHARS:
        return _parse_info_line(line)
    return _cached_info_line(line)


def _parse_info_line(line: str) -> tuple[tuple[str, str], ...]:
    return tuple(_sample(CACHE_CONFIG_METRIC, line[len(CACHE_CONFIG_METRIC):])[0].items())


_cached_info_line = functools.lru_cache(maxsize=64)(_parse_info_line)


def _raise_why_no_vllm(text: str) -> None:
    """None of the samples we read: say whether the body is exposition text at all (a wrong URL
    answers with HTML or JSON) or valid text from something else. A valid page with other vllm:
    samples only passes (no engines). Judged from the first MAX_SNIFF_CHARS (whole lines):
    parsing all of a large page would cost seconds of a core every tick."""
    head = text if len(text) <= MAX_SNIFF_CHARS else text[:text.rfind("\n", 0, MAX_SNIFF_CHARS) + 1]
    try:
        for _ in text_string_to_metric_families(head):
            pass
    except Exception as exc:
        raise ParseError(f"not Prometheus text format: {_short(exc)}") from None
    if not _ANY_VLLM_LINE.search(text):
        raise ParseError("no vllm: metrics in the response")


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

    def text(key: str) -> str:  # vLLM's str() of the field; "None" is unset
        value = labels.get(key, "")
        return "" if value == "None" else value[:64]

    return CacheConfig(
        gpu_memory_utilization=number("gpu_memory_utilization", lambda v: 0 < v <= 1),
        num_gpu_blocks=count("num_gpu_blocks"),
        block_size=count("block_size") or None,
        cache_dtype=text("cache_dtype"),
        enable_prefix_caching=text("enable_prefix_caching"),
        kv_offloading_backend=text("kv_offloading_backend"),
        kv_offloading_size=text("kv_offloading_size"),
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


def _label(labels: dict[str, str], name: str) -> str:
    return labels.get(name, "")[:MAX_LABEL_CHARS]


def _short(exc: Exception) -> str:
    return str(exc)[:200]
