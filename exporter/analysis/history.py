"""Bounded per-series history of what the sources sampled.

Four kinds of series, each keyed so a reused PID never inherits an old process's data:
  process memory  (gpu uuid, pid, start_time)
  process rss     (pid, start_time)
  gpu used        (gpu uuid)
  gpu unowned     (gpu uuid): used memory no live process accounts for (unattributed_bytes),
                  so a finding about it can say how long it has lasted beyond the raw window
and, for a process the allocator probe reports on (ProcessSample.allocator), its PyTorch
allocator's numbers on that GPU, keyed like its memory (ALLOCATOR_SERIES): the three
components of its GPU memory (torch allocated, torch cached = reserved - allocated, non-torch =
NVML used - reserved) for the leak attribution, whose tier is what counts; the inactive-split
bytes and the alloc-retries counter for the fragmentation detector, which reads their raw points.

Each series keeps its raw points for `raw_seconds` and a downsampled tier of per-bucket medians
(one bucket = `bucket_seconds`, 1 min by default) for `retention_seconds`. The tier is what the
detectors read: it changes once per bucket, so its SeriesView object is cached and reused until
the next bucket closes (the leak detector memoises on that object). Bucket boundaries are offset
per series (a stable hash of its key) so that the recomputation for hundreds of processes that
started together is spread over the minute instead of landing on one tick.

Beside the series, the raw snapshots of the last `raw_seconds` are kept (with the memory
budgets the analysis computed for each): the detectors that compare with a moment ago and the
flight recorder read them. They are kept with what those readers use (GPUs, processes, host,
vLLM, log events), not the tick's fault records or source statuses, which the daemon has already
counted; and the log events they hold together are capped at `max_log_events`, the oldest let go
first (counted in `dropped_log_events`), so a flood of OOM lines cannot fill the hour.

Memory does not grow with uptime, churn or sampling rate: series not updated for
`dead_grace_seconds` are dropped, at most `max_series` are kept (the least recently updated go
first), and the raw tier holds at most about `max_raw_samples` points per series (and snapshots):
sampled faster than that fills `raw_seconds`, older raw points are thinned to one per
raw_seconds / max_raw_samples, the newest always kept (the bucket medians still see every
sample, and a snapshot that still carries log events is not thinned away, so at most
`max_log_events` snapshots are kept beyond `max_raw_samples`).
"""
from __future__ import annotations

import bisect
import zlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, cast

from ..model import Budget, GpuSample, Identity, OomEvent, ProcessSample, Snapshot
from .frame_index import FrameIndex
from .trend import median

# ("gpu", uuid) | ("mem", uuid, pid, start_time) | ("rss", pid, start_time)
# | (allocator series name, uuid, pid, start_time)
SeriesKey = tuple[object, ...]

# The allocator series per probed process and GPU. The first three are the components of the
# process's GPU memory (they add up to NVML's figure) and are read as trends, from the tier: their
# raw tier keeps only the newest point. The last two are read over the detectors' recent windows
# from their raw points, kept for raw_seconds like every raw series.
ALLOCATOR_COMPONENTS = ("torch_allocated", "torch_cached", "non_torch")
ALLOCATOR_SERIES = (*ALLOCATOR_COMPONENTS, "inactive_split", "alloc_retries")
_COMPONENTS = frozenset(ALLOCATOR_COMPONENTS)
# Log events the raw snapshots hold together: an incident logs a handful; a flood of distinct OOM
# lines keeps only the newest this many (a few MiB) for the detectors and the flight recorder.
MAX_LOG_EVENTS = 1024


@dataclass(frozen=True)
class SeriesView:
    times: tuple[float, ...]  # Unix s, ascending
    values: tuple[float, ...]  # bucket medians (raw views: the samples)
    # Bucket minima, aligned with times (empty for raw views). A cache being freed shows here
    # even when the drop falls mid-bucket, so the leak detector reads the floor from them.
    lows: tuple[float, ...] = ()

    def __len__(self) -> int:
        return len(self.times)

    @property
    def least(self) -> tuple[float, ...]:
        """The bucket minima, or a raw view's samples (which have none)."""
        return self.lows if len(self.lows) == len(self.times) else self.values


EMPTY = SeriesView((), ())


class RawSpan(NamedTuple):
    """A summary of a series' raw points over a window (History.process_allocator_span)."""

    first_time: float
    last_time: float
    low: float  # the least value
    flat: bool  # every value the same (then low is that value)


def bucket_point(time_sum: float, values: Sequence[float]) -> tuple[float, float, float]:
    """A bucket's point in the tier, from its samples' times summed and their values: the mean
    time, the median and the least value."""
    return time_sum / len(values), median(values), min(values)


def bucket_offset(key: SeriesKey, bucket_seconds: float) -> float:
    """Where the series of `key` starts its buckets, within one bucket: each series its own phase
    (which sample opens a minute). Stable across runs (unlike hash() of str), so replays are
    reproducible."""
    return (zlib.crc32(repr(key).encode()) % 997) / 997.0 * bucket_seconds


class _Series:
    """One series: raw ring (two arrays with a moving start) plus the bucket-median tier."""

    __slots__ = (
        "bucket",
        "bucket_seconds",
        "bucket_tsum",
        "bucket_vals",
        "changed_at",
        "last_seen",
        "name",
        "offset",
        "raw_start",
        "raw_t",
        "raw_v",
        "tier_lo",
        "tier_start",
        "tier_t",
        "tier_v",
        "view",
    )

    def __init__(self, key: SeriesKey, t: float, name: str, bucket_seconds: float):
        self.last_seen = t
        self.name = name
        self.bucket_seconds = bucket_seconds
        self.offset = bucket_offset(key, bucket_seconds)
        self.raw_t = array("d")
        self.raw_v = array("d")
        self.raw_start = 0
        # The time of the newest raw point whose value differs from the point stored before it
        # (or that has none): every later point has its value. Never earlier than that point
        # (a thinned point's change may be kept after it is overwritten), so "flat since" is
        # never claimed wrongly (raw_span()).
        self.changed_at = t
        self.tier_t = array("d")
        self.tier_v = array("d")
        self.tier_lo = array("d")
        self.tier_start = 0
        self.bucket: int | None = None
        self.bucket_vals: list[float] = []
        self.bucket_tsum = 0.0
        self.view: SeriesView | None = None

    def add(self, t: float, v: float, raw_seconds: float, retention_seconds: float,
            raw_gap: float) -> None:
        raw_t, raw_v = self.raw_t, self.raw_v
        n = len(raw_t)
        if n:
            if t <= raw_t[-1]:
                return  # out of order or duplicate: keep the series ascending
            if n - self.raw_start >= 2 and raw_t[-1] - raw_t[-2] < raw_gap:
                # The previous newest was too close: thinned (overwritten).
                if v != raw_v[-2]:
                    self.changed_at = t
                raw_t[-1] = t
                raw_v[-1] = v
            else:
                if v != raw_v[-1]:
                    self.changed_at = t
                raw_t.append(t)
                raw_v.append(v)
            if raw_t[self.raw_start] < t - raw_seconds:  # else _trim() would do nothing
                self.raw_start = _trim(raw_t, self.raw_start, t - raw_seconds, raw_v)
        else:
            self.changed_at = t
            raw_t.append(t)
            raw_v.append(v)
        self.last_seen = t
        self._to_bucket(t, v, retention_seconds)

    def add_newest(self, t: float, v: float, retention_seconds: float) -> None:
        """add() for a series read only from its tier: its raw tier keeps only the newest
        point (what add() with raw_seconds 0 keeps, without the trimming)."""
        raw_t = self.raw_t
        if raw_t:
            if t <= raw_t[-1]:
                return  # out of order or duplicate: keep the series ascending
            if v != self.raw_v[-1]:
                self.changed_at = t
            raw_t[-1] = t
            self.raw_v[-1] = v
        else:
            raw_t.append(t)
            self.raw_v.append(v)
        self.raw_start = 0
        self.last_seen = t
        self._to_bucket(t, v, retention_seconds)

    def _to_bucket(self, t: float, v: float, retention_seconds: float) -> None:
        """Count the point into its per-minute bucket, closing the previous bucket first."""
        bucket = int((t - self.offset) // self.bucket_seconds)
        if bucket != self.bucket:
            if self.bucket is not None:
                self._close_bucket(t, retention_seconds)
            self.bucket = bucket
        self.bucket_vals.append(v)
        self.bucket_tsum += t

    def _close_bucket(self, now: float, retention_seconds: float) -> None:
        vals = self.bucket_vals
        if vals:
            t, value, low = bucket_point(self.bucket_tsum, vals)
            self.tier_t.append(t)
            self.tier_v.append(value)
            self.tier_lo.append(low)
            self.tier_start = _trim(self.tier_t, self.tier_start, now - retention_seconds,
                                    self.tier_v, self.tier_lo)
            self.view = None
        self.bucket_vals = []
        self.bucket_tsum = 0.0

    def tier_view(self) -> SeriesView:
        if self.view is None:
            s = self.tier_start
            self.view = SeriesView(tuple(self.tier_t[s:]), tuple(self.tier_v[s:]),
                                   tuple(self.tier_lo[s:]))
        return self.view

    def _raw_index(self, since: float | None) -> int:
        s = self.raw_start
        if since is not None:
            s = max(s, bisect.bisect_right(self.raw_t, since, s) - 1)
        return s

    def raw_view(self, since: float | None = None) -> SeriesView:
        """The raw points; with `since`, from the one in effect then (the newest at or before
        it, where kept) on."""
        s = self._raw_index(since)
        return SeriesView(tuple(self.raw_t[s:]), tuple(self.raw_v[s:]))

    def raw_span(self, since: float) -> RawSpan | None:
        """What raw_view(since) holds, summed up: its first and last times, its least value,
        and whether every value is the same. None when it would be empty."""
        s = self._raw_index(since)
        raw_t, raw_v = self.raw_t, self.raw_v
        if s >= len(raw_t):
            return None
        if self.changed_at <= raw_t[s]:  # no value changed after the first point: all alike
            return RawSpan(raw_t[s], raw_t[-1], raw_v[-1], True)
        return RawSpan(raw_t[s], raw_t[-1], min(raw_v[s:]), False)

    def point_count(self) -> int:
        return (len(self.raw_t) - self.raw_start) + (len(self.tier_t) - self.tier_start)


def _trim(ts: array[float], start: int, cutoff: float, *columns: array[float]) -> int:
    """Advance `start` past points older than `cutoff`; compact when half the array is dead."""
    n = len(ts)
    while start < n and ts[start] < cutoff:
        start += 1
    if start > 64 and start * 2 > n:
        for col in (ts,) + columns:
            del col[:start]
        start = 0
    return start


class History:
    """Bounded per-series history. Memory does not grow with uptime or process churn:
    series of processes gone for longer than dead_grace_seconds are dropped; each series keeps
    raw points for raw_seconds and a downsampled tier (bucket medians) up to retention_seconds."""

    def __init__(self, raw_seconds: float = 3600, retention_seconds: float = 6 * 3600,
                 dead_grace_seconds: float = 900, bucket_seconds: float = 60,
                 max_series: int = 8192, max_raw_samples: int = 4096,
                 max_log_events: int = MAX_LOG_EVENTS):
        if min(raw_seconds, retention_seconds, bucket_seconds) <= 0 or dead_grace_seconds < 0:
            raise ValueError("history durations must be positive")
        if max_series < 1 or max_raw_samples < 2 or max_log_events < 1:
            raise ValueError("max_series and max_log_events must be at least 1, max_raw_samples at least 2")
        self.raw_seconds = float(raw_seconds)
        # Raw points closer together than this are thinned (see the module docstring).
        self.raw_gap = self.raw_seconds / max_raw_samples
        self.retention_seconds = float(retention_seconds)
        self.dead_grace_seconds = float(dead_grace_seconds)
        self.bucket_seconds = float(bucket_seconds)
        self.max_series = max_series
        # Insertion order = least recently updated first (moved to the end on every update).
        self._series: OrderedDict[SeriesKey, _Series] = OrderedDict()
        self._frames: deque[tuple[Snapshot, tuple[Budget, ...]]] = deque()
        self._index = FrameIndex()  # what the frames show of rare events, kept beside them
        self.max_log_events = max_log_events
        self._held_log_events = 0  # log events in self._frames
        self._last_timestamp: float | None = None
        self.started_at: float | None = None  # the first snapshot's time: no series reaches further back
        self._next_sweep = float("-inf")
        self.dropped_out_of_order = 0
        self.dropped_log_events = 0  # let go of to stay within max_log_events

    # --- writing -------------------------------------------------------------------------
    def update(self, snapshot: Snapshot, budgets: tuple[Budget, ...] = ()) -> None:
        """Add one tick's snapshot, with the memory budgets the analysis computed for it."""
        t = snapshot.timestamp
        if self._last_timestamp is not None and t <= self._last_timestamp:
            self.dropped_out_of_order += 1  # a clock step backwards must not corrupt order
            return
        self._last_timestamp = t
        if self.started_at is None:
            self.started_at = t
        rss_done: set[SeriesKey] = set()
        get, move_to_end = self._series.get, self._series.move_to_end
        raw_seconds, retention, raw_gap = self.raw_seconds, self.retention_seconds, self.raw_gap
        for gpu in snapshot.gpus:
            if gpu.used_bytes is not None:
                self._add(("gpu", gpu.uuid), t, float(gpu.used_bytes), "")
                unowned = unattributed_bytes(gpu)
                if unowned is not None:
                    self._add(("unowned", gpu.uuid), t, float(unowned), "")
            for p in gpu.processes:
                if p.used_bytes is not None:
                    self._add(("mem", gpu.uuid, p.pid, p.start_time), t, float(p.used_bytes), p.name)
                if p.allocator is not None:
                    pid, start_time = p.pid, p.start_time
                    for name, value in _allocator_values(p):
                        key = (name, gpu.uuid, pid, start_time)
                        series = get(key)
                        if series is None or start_time is None:  # new, or maybe a reused PID
                            self._add(key, t, value, p.name, raw=name not in _COMPONENTS)
                            continue
                        move_to_end(key)  # what _add() does, without its call
                        if name in _COMPONENTS:
                            series.add_newest(t, value, retention)
                        else:
                            series.add(t, value, raw_seconds, retention, raw_gap)
                rss_key = ("rss", p.pid, p.start_time)
                if p.host_rss_bytes is not None and rss_key not in rss_done:
                    rss_done.add(rss_key)  # a process on several GPUs has one RSS
                    self._add(rss_key, t, float(p.host_rss_bytes), p.name)
        for server in snapshot.vllm:  # a server's own processes, on no GPU (vLLM's CPU backend)
            for p in server.processes:
                rss_key = ("rss", p.pid, p.start_time)
                if p.host_rss_bytes is not None and rss_key not in rss_done:
                    rss_done.add(rss_key)
                    self._add(rss_key, t, float(p.host_rss_bytes), p.name)
        frames = self._frames
        if (len(frames) >= 2 and frames[-1][0].timestamp - frames[-2][0].timestamp < self.raw_gap
                and not frames[-1][0].log_events):
            frames.pop()  # the previous newest was too close to the one before: thinned
            self._index.drop(newest=True)
        frames.append((_kept(snapshot, self.max_log_events), budgets))
        self._index.add(snapshot)
        self._held_log_events += len(frames[-1][0].log_events)
        self.dropped_log_events += len(snapshot.log_events) - len(frames[-1][0].log_events)
        cutoff = t - self.raw_seconds
        while frames and frames[0][0].timestamp < cutoff:
            self._held_log_events -= len(frames.popleft()[0].log_events)
            self._index.drop(newest=False)
        if self._held_log_events > self.max_log_events:
            self._let_go_of_log_events()
        sweep = t >= self._next_sweep
        self._index.trim(frames[0][0].timestamp, sweep)
        if sweep:
            self._sweep(t)
            self._next_sweep = t + min(self.bucket_seconds, self.dead_grace_seconds or self.bucket_seconds)
        while len(self._series) > self.max_series:
            self._series.popitem(last=False)

    def _let_go_of_log_events(self) -> None:
        """The oldest snapshots' log events go until the held ones fit max_log_events."""
        frames = self._frames
        for i, (snap, budgets) in enumerate(frames):
            if self._held_log_events <= self.max_log_events:
                break
            n = len(snap.log_events)
            if n and i < len(frames) - 1:  # the newest keeps its own (cut to the cap on entry)
                frames[i] = (replace(snap, log_events=()), budgets)
                self._held_log_events -= n
                self.dropped_log_events += n

    def _add(self, key: SeriesKey, t: float, value: float, name: str, raw: bool = True) -> None:
        series = self._series.get(key)
        if series is not None and key[-1] is None and key[0] != "gpu" and name and series.name \
                and name != series.name:
            # Without a start time only the name can tell a reused PID apart.
            series = None
        if series is None:
            series = _Series(key, t, name, self.bucket_seconds)
            self._series[key] = series
        else:
            self._series.move_to_end(key)
        # A series read only from its tier keeps no raw history (only its newest point).
        if raw:
            series.add(t, value, self.raw_seconds, self.retention_seconds, self.raw_gap)
        else:
            series.add_newest(t, value, self.retention_seconds)

    def _sweep(self, now: float) -> None:
        cutoff = now - self.dead_grace_seconds
        while self._series:
            key, series = next(iter(self._series.items()))
            if series.last_seen >= cutoff:
                break
            del self._series[key]

    # --- reading -------------------------------------------------------------------------
    def _view(self, key: SeriesKey, raw: bool, since: float | None = None) -> SeriesView:
        series = self._series.get(key)
        if series is None:
            return EMPTY
        return series.raw_view(since) if raw else series.tier_view()

    def process_memory(self, uuid: str, identity: Identity, raw: bool = False,
                       since: float | None = None) -> SeriesView:
        """Bucket medians of the process's GPU memory (raw=True: the raw samples of raw_seconds,
        with `since` from the one in effect then on)."""
        return self._view(("mem", uuid, identity[0], identity[1]), raw, since)

    def process_rss(self, identity: Identity, raw: bool = False) -> SeriesView:
        return self._view(("rss", identity[0], identity[1]), raw)

    def gpu_used(self, uuid: str, raw: bool = False) -> SeriesView:
        return self._view(("gpu", uuid), raw)

    def gpu_unowned(self, uuid: str, raw: bool = False) -> SeriesView:
        """unattributed_bytes of the GPU over time (bucket medians and minima, or raw)."""
        return self._view(("unowned", uuid), raw)

    def process_allocator(self, name: str, uuid: str, identity: Identity,
                          since: float | None = None) -> SeriesView:
        """One of ALLOCATOR_SERIES for a process on a GPU: its tier, or with `since` its raw
        points from the one in effect at that time (the newest at or before it, where kept) on;
        the components keep only their newest raw point."""
        if name not in ALLOCATOR_SERIES:
            raise ValueError(f"no allocator series {name!r}")
        series = self._series.get((name, uuid, identity[0], identity[1]))
        if series is None:
            return EMPTY
        return series.tier_view() if since is None else series.raw_view(since)

    def process_allocator_span(self, name: str, uuid: str, identity: Identity,
                               since: float) -> RawSpan | None:
        """process_allocator(name, uuid, identity, since) summed up (RawSpan), without building
        the view: None where that view is empty."""
        if name not in ALLOCATOR_SERIES:
            raise ValueError(f"no allocator series {name!r}")
        series = self._series.get((name, uuid, identity[0], identity[1]))
        return None if series is None else series.raw_span(since)

    def recent(self, since: float) -> list[Snapshot]:
        """Raw snapshots with timestamp >= since, oldest first (kept for raw_seconds)."""
        return [snap for snap, _ in self.recent_frames(since)]

    def recent_frames(self, since: float) -> list[tuple[Snapshot, tuple[Budget, ...]]]:
        """(snapshot, its memory budgets) with timestamp >= since, oldest first."""
        out = []
        for frame in reversed(self._frames):
            if frame[0].timestamp < since:
                break
            out.append(frame)
        out.reverse()
        return out

    # --- what the frames show of rare events, without reading them (frame_index.py) ---------
    def serving_seen(self, since: float) -> list[tuple[str, Identity]]:
        """(GPU uuid, identity) of every serving process (role "vllm") seen on that GPU in a frame
        at or after `since`, and maybe a few more (seen in a frame since thinned): enough to know
        that none of them is gone without reading the frames."""
        return self._index.serving_seen(since)

    def preemptions_run(self, endpoint: str, model: str, engine: str) -> tuple[float, float] | None:
        """(value, since): the engine's preemptions counter had this value in every frame since
        `since` that gave one (None when no frame kept gave one)."""
        return self._index.preemptions_run((endpoint, model, engine))

    def kv_usage_peak(self, endpoint: str, model: str, engine: str, since: float) -> float | None:
        """The engine's highest KV cache usage in the frames at or after `since`, or higher (a
        frame since thinned may still count); None when no frame kept gave one."""
        return self._index.kv_usage_peak((endpoint, model, engine), since)

    def sleep_states(self, since: float, before: float) -> dict[str, frozenset[str]]:
        """endpoint -> the sleep states ("" for none reported) the frames with since <= timestamp
        < before show it in: what `recent(since)` would say of them, without reading the frames."""
        return self._index.sleep_states(since, before)

    def series_count(self) -> int:
        return len(self._series)

    def point_count(self) -> int:
        """Stored points over all series (for tests and self-monitoring)."""
        return sum(s.point_count() for s in self._series.values())


def unattributed_bytes(gpu: GpuSample) -> int | None:
    """Used minus what live processes account for; None where that cannot be known
    (unified memory, used unknown, a process whose usage NVML does not report)."""
    if gpu.unified or gpu.used_bytes is None or any(p.used_bytes is None for p in gpu.processes):
        return None
    return max(0, gpu.used_bytes - gpu.process_used_bytes)
def _kept(snapshot: Snapshot, max_log_events: int) -> Snapshot:
    """What a raw snapshot keeps: everything its readers use, not the fault records and source
    statuses the daemon counted as the tick ran; at most max_log_events log events."""
    return replace(snapshot, errors=(), sources=(), dropped=(),
                   log_events=snapshot.log_events[:max_log_events])


def _allocator_values(p: ProcessSample) -> Iterator[tuple[str, float]]:
    """The allocator series' values of this sample (those its numbers allow)."""
    a = p.allocator
    if a is None:
        return
    if a.allocated_bytes is not None:
        yield "torch_allocated", float(a.allocated_bytes)
        if a.reserved_bytes is not None and a.reserved_bytes >= a.allocated_bytes:
            yield "torch_cached", float(a.reserved_bytes - a.allocated_bytes)
    non_torch = p.non_torch_bytes  # one rule for the vLLM sleep pool (ProcessSample)
    if non_torch is not None:
        yield "non_torch", float(non_torch)
    if a.inactive_split_bytes is not None:
        yield "inactive_split", float(a.inactive_split_bytes)
    if a.alloc_retries is not None:
        yield "alloc_retries", float(a.alloc_retries)


def recent_events(history: History, snapshot: Snapshot,
                  window: float) -> Iterator[tuple[Snapshot, OomEvent]]:
    """OOM events that arrived within `window` seconds, with the snapshot they came in."""
    # Snapshot.log_events holds OomMessages as parsed; the engine classifies them (OomEvent)
    # before a snapshot reaches the detectors or the history, which the type cannot say.
    now = snapshot.timestamp
    for snap in history.recent(now - window):
        if snap.timestamp < now:
            for event in snap.log_events:
                yield snap, cast(OomEvent, event)
    for event in snapshot.log_events:
        yield snapshot, cast(OomEvent, event)
