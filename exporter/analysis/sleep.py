"""vLLM sleep mode (--enable-sleep-mode): memory that falls on sleep and rises on wake is by
design; a sleep/wake cycle that does not give the memory back is a finding of its own.

vLLM's sleep (vllm/v1/worker/gpu_worker.py, Worker.sleep) releases the CuMemAllocator pool:
level 1 offloads the weights to host memory and discards the KV cache, level 2 discards both;
`vllm:engine_sleep_state` says which (awake / weights_offloaded / discard_all). Wake maps it all
again. The leak and stale-memory detectors leave a server alone while it sleeps and for a
settling time after each change of its sleep state (quiet_endpoints); this module judges the
cycle instead (`sleep_leak`, one finding per server and GPU), on three signals:

- after wake (once settled) the server holds more than before it slept, by a margin: memory
  the cycle did not give back (a known leak source: buffers allocated outside the pool);
- asleep at level 1 or 2, it freed much less than its KV cache (+ weights) should give back;
- from its log: the memory "still in use" after sleep ("Sleep mode freed X GiB memory, Y GiB
  memory is still in use") rose by the margin from one sleep to the next (device-wide, so a
  co-tenant's growth counts too: the evidence says so).

Cycles are found in the raw history (up to lookback_seconds, as far as the history holds). What
the cycles kept is remembered from one to the next (SleepLeakDetector): the finding stays raised
while the memory is kept, asleep again or between scrapes, and names the total kept since the
first sleep.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..model import Finding, GpuSample, Identity, Snapshot, VllmSample
from ..units import format_bytes
from .detector import DetectorSpec, FindingAlert, FindingKind, Tick
from .history import History
from .sleep_state import SLEEPING_STATES, is_asleep, sleep_state

__all__ = ["SLEEPING_STATES", "SleepConfig", "SleepLeakDetector", "quiet_endpoints", "sleep_state"]

Evidence = list[tuple[str, float | int | str]]

MIB = 1 << 20


@dataclass(frozen=True)
class SleepConfig:
    min_growth_bytes: int = 512 * MIB  # "did not give back": more than this ...
    min_growth_ratio: float = 0.01  # ... and this share of the GPU
    settle_seconds: float = 60.0  # after a sleep or wake, before the level is judged
    min_freed_share: float = 0.5  # asleep: freed at least this share of what it should
    lookback_seconds: float = 3600.0

    def __post_init__(self) -> None:
        if self.min_growth_bytes < 0 or not 0 <= self.min_growth_ratio <= 1 \
                or not 0 <= self.min_freed_share <= 1:
            raise ValueError("sleep: min_growth_bytes >= 0, ratios within 0-1")
        if self.settle_seconds < 0 or self.lookback_seconds <= self.settle_seconds:
            raise ValueError("sleep: settle_seconds >= 0 and lookback_seconds > settle_seconds")


def _states(snap: Snapshot) -> dict[str, str]:
    return {v.endpoint: sleep_state(v) for v in snap.vllm}


def quiet_endpoints(history: History, snapshot: Snapshot, seconds: float) -> frozenset[str]:
    """Servers asleep now, or whose sleep state changed within `seconds`: their memory falls
    and rises by design, so the leak and stale detectors do not judge it then."""
    now = snapshot.timestamp
    current = _states(snapshot)
    quiet = {endpoint for endpoint, state in current.items() if is_asleep(state)}
    # The states the earlier frames show, from the history's index: asked every tick by two
    # detectors, reading the frames themselves was a cost that grew with `seconds` (#18).
    for endpoint, states in history.sleep_states(now - seconds, now).items():
        if any(is_asleep(state) or (state and state != current.get(endpoint, state)) for state in states):
            quiet.add(endpoint)
    return frozenset(quiet)


def _used(gpu: GpuSample | None, endpoint: str, only: frozenset[Identity] | None = None) -> int | None:
    """The server's processes' memory on this GPU (of the processes `only` names, where given: a
    restarted server's earlier processes are another story); None if the GPU library gave no
    figure for one."""
    if gpu is None:
        return None
    amounts = [p.used_bytes for p in gpu.processes if p.role == "vllm" and p.endpoint == endpoint
               and (only is None or p.identity in only)]
    if not amounts or any(a is None for a in amounts):
        return None
    return sum(a for a in amounts if a is not None)


@dataclass
class _Kept:
    """Memory a server's sleep/wake cycles kept on one GPU, from the first such cycle on: what it
    held before its first sleep, and the cycles that kept some."""

    processes: frozenset[Identity]  # the server's processes on the GPU: a restart starts afresh
    baseline: int  # bytes before the first sleep of the first cycle that kept memory
    cycles: dict[float, int] = field(default_factory=dict)  # woke_at -> bytes that cycle kept
    evidence: Evidence = field(default_factory=list)  # the latest judged cycle's, totals added


def _processes(gpu: GpuSample, endpoint: str) -> frozenset[Identity]:
    return frozenset(p.identity for p in gpu.processes if p.role == "vllm" and p.endpoint == endpoint)


MAX_TRACKED = 4096  # (server, GPU) pairs remembered at most; servers and GPUs are few
MAX_MEMO_ENTRIES = 256  # per frame: (GPU, server, processes) memory sums remembered


class _FrameMemo:
    """One history frame's sleep states and the servers' memory on its GPUs, each read once
    (frames are immutable)."""

    __slots__ = ("_used", "asleep", "frame", "states")

    def __init__(self, frame: Snapshot):
        self.frame = frame
        self.states = _states(frame)
        self.asleep = frozenset(e for e, state in self.states.items() if is_asleep(state))
        self._used: dict[tuple[str, str, frozenset[Identity]], int | None] = {}

    def used(self, uuid: str, endpoint: str, processes: frozenset[Identity]) -> int | None:
        """_used of the frame's GPU `uuid` (None when the frame has no such GPU)."""
        key = (uuid, endpoint, processes)
        if key in self._used:
            return self._used[key]
        value = _used(next((g for g in self.frame.gpus if g.uuid == uuid), None), endpoint, processes)
        if len(self._used) < MAX_MEMO_ENTRIES:
            self._used[key] = value
        return value


class SleepLeakDetector:
    """Judges each sleep/wake cycle as it settles, and remembers what the cycles kept: the finding
    stays while the memory is kept (asleep again, a scrape missed, settling after a change) and
    names the total kept since the first sleep, not the last cycle's share. It clears once the
    server, awake and settled, is back within the margin of what it held before its first sleep,
    or its processes are gone or replaced (a restart gives everything back)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, str], _Kept] = {}
        # What each frame says, read once: the lookback holds an hour of frames (720), and reading
        # every frame for every server and GPU each tick was most of the exporter's CPU with 4
        # endpoints (#18). Keyed by id; the memo holds its frame, so the id stays its own.
        self._frame_memos: dict[int, _FrameMemo] = {}

    def __call__(self, tick: Tick, config: SleepConfig) -> list[Finding]:
        snapshot, now = tick.snapshot, tick.now
        since = now - config.lookback_seconds
        # Asleep at some time in the lookback: from the history's index of sleep states, so a host
        # whose servers never sleep reads no frame (most hosts, most of the time; #18).
        asleep = {e for e, states in tick.history.sleep_states(since, now).items() if any(map(is_asleep, states))}
        asleep.update(e for e, state in _states(snapshot).items() if is_asleep(state))
        frames: list[Snapshot] = []
        memos: list[_FrameMemo] = []
        if asleep or self._kept or any(_logs_sleeps(s) for s in snapshot.vllm):
            frames = [s for s in tick.history.recent(since) if s.timestamp < now]
            frames.append(snapshot)
        if asleep or self._kept:
            memos = self._memos(frames)
        else:
            self._frame_memos = {}  # no cycle to judge: hold no frame
        findings = []
        seen: set[tuple[str, str]] = set()
        for server in snapshot.vllm:
            endpoint = server.endpoint
            # No sleep within the lookback (most servers, most of the time): no cycle to judge, and
            # the states are read only to clear what an earlier cycle kept.
            slept = server.up and endpoint in asleep
            states = [(m.frame.timestamp, m.states.get(endpoint, "")) for m in memos] \
                if slept or any(k[0] == endpoint for k in self._kept) else []
            for gpu in snapshot.gpus:
                key = (endpoint, gpu.uuid)
                used = _used(gpu, endpoint)
                if used is None:
                    if not gpu.up and key in self._kept:  # a lost GPU hides its processes: keep
                        seen.add(key)
                        findings.append(_finding(gpu, server, self._kept[key].evidence, now))
                    continue
                seen.add(key)
                processes = _processes(gpu, endpoint)
                evidence: Evidence = []
                if slept:
                    series = [(t, state, m.used(gpu.uuid, endpoint, processes))
                              for (t, state), m in zip(states, memos, strict=True)]
                    evidence = _cycle(series, gpu, server, now, config)
                kept = self._judge(key, gpu, server, evidence, used, states, now, config)
                if kept:
                    findings.append(_finding(gpu, server, kept, now))
                elif evidence:
                    findings.append(_finding(gpu, server, evidence, now))
            logged = _log_signal(frames, server, snapshot, config) if server.up else []
            if logged and not any(f.endpoint == endpoint for f in findings):
                findings.append(_finding(None, server, logged, now))
        for key in [k for k in self._kept if k not in seen]:
            del self._kept[key]  # the server or the GPU went away: what it kept went with it
        return findings

    def _memos(self, frames: list[Snapshot]) -> list[_FrameMemo]:
        """Each frame's memo, kept for the frames still in the lookback only."""
        known, kept = self._frame_memos, {}
        for frame in frames:
            memo = known.get(id(frame))
            if memo is None or memo.frame is not frame:
                memo = _FrameMemo(frame)
            kept[id(frame)] = memo
        self._frame_memos = kept
        return [kept[id(frame)] for frame in frames]

    def _judge(self, key: tuple[str, str], gpu: GpuSample, server: VllmSample, evidence: Evidence,
               used: int, states: list[tuple[float, str]], now: float, config: SleepConfig) -> Evidence:
        """The evidence of the memory kept so far on this GPU ([] when none is), updating what is
        remembered with this tick's judgement of the last cycle."""
        processes = _processes(gpu, server.endpoint)
        kept = self._kept.get(key)
        if kept is not None and kept.processes != processes:
            del self._kept[key]  # restarted: a new process holds nothing of the old one's cycles
            kept = None
        e = dict(evidence)
        if e.get("signal") == "not_given_back":
            if kept is None:
                if len(self._kept) >= MAX_TRACKED:
                    self._kept.pop(next(iter(self._kept)))
                kept = self._kept[key] = _Kept(processes, int(e["before_sleep_bytes"]))
            kept.cycles[float(e["woke_at"])] = int(e["kept_bytes"])
            total = int(e["after_wake_bytes"]) - kept.baseline
            kept.evidence = [*[(k, v) for k, v in evidence if k != "kept_bytes"],
                             ("kept_bytes", max(total, int(e["kept_bytes"]))),
                             ("last_cycle_kept_bytes", int(e["kept_bytes"])), ("cycles", len(kept.cycles)),
                             ("first_before_sleep_bytes", kept.baseline)]
            return kept.evidence
        if kept is None:
            return []
        settled = server.up and all(state == "awake" for t, state in states if t >= now - config.settle_seconds)
        if settled and used <= kept.baseline + _margin(gpu, config):
            del self._kept[key]  # awake, settled and back where it was before its first sleep
            return []
        return kept.evidence


def _margin(gpu: GpuSample | None, config: SleepConfig) -> int:
    total = gpu.total_bytes if gpu is not None and gpu.total_bytes else 0
    return max(config.min_growth_bytes, int(config.min_growth_ratio * total))


def _cycle(series: list[tuple[float, str, int | None]], gpu: GpuSample, server: VllmSample,
           now: float, config: SleepConfig) -> Evidence:
    """The last sleep/wake cycle in `series` (time, state, used): evidence if it kept memory."""
    asleep = [state not in ("", "awake") for _, state, _ in series]
    # the last sleep: the first sleeping sample after the last awake one before it
    last = max((i for i, a in enumerate(asleep) if a), default=None)
    if last is None:
        return []
    start = last
    while start > 0 and asleep[start - 1]:
        start -= 1
    before_at = next((i for i in range(start - 1, -1, -1)
                      if series[i][1] == "awake" and series[i][2] is not None), None)
    before = series[before_at][2] if before_at is not None else None
    if before is None:
        return []
    margin = _margin(gpu, config)
    t_sleep, state = series[start][0], series[last][1]
    asleep_used = [u for _, s, u in series[start:last + 1] if u is not None]
    if last == len(series) - 1:  # asleep now: did it free what it should?
        if state not in SLEEPING_STATES or now - t_sleep < config.settle_seconds or not asleep_used:
            return []
        held = min(asleep_used)
        freed = before - held
        expected = _expected_freed(server)
        if expected is not None:
            short = freed < config.min_freed_share * expected
            want = f"{format_bytes(expected)} expected: its KV cache and weights"
        else:
            short = freed < config.min_freed_share * before
            want = f"under {config.min_freed_share:.0%} of the {format_bytes(before)} it held"
        if not short or before - held < 0:
            return []
        ev: Evidence = [("signal", "freed_too_little"), ("sleep_state", state),
                        ("before_sleep_bytes", before), ("asleep_bytes", held),
                        ("freed_bytes", freed), ("asleep_since", t_sleep), ("summary_detail", want)]
        if expected is not None:
            ev.append(("expected_freed_bytes", expected))
        return ev
    # woke after the last sleep: back to where it was?
    woke = last + 1
    t_wake = series[woke][0]
    if now - t_wake < config.settle_seconds:
        return []
    after = [u for t, s, u in series[woke:] if t >= t_wake + config.settle_seconds and s == "awake"
             and u is not None]
    if not after:
        return []
    floor = min(after)  # the settled floor: a passing activation peak is not kept memory
    growth = floor - before
    if growth <= margin:
        return []
    return [("signal", "not_given_back"), ("sleep_state", state), ("before_sleep_bytes", before),
            ("asleep_bytes", min(asleep_used) if asleep_used else 0), ("after_wake_bytes", floor),
            ("kept_bytes", growth), ("margin_bytes", margin), ("slept_at", t_sleep), ("woke_at", t_wake)]


def _expected_freed(server: VllmSample) -> int | None:
    """What a sleep at level 1 or 2 gives back on a GPU: the KV cache and the weights (offloaded
    at level 1, discarded at level 2); None where the KV cache size is unknown."""
    c, p = server.cache_config, server.startup
    kv = c.kv_cache_memory_bytes if c is not None and c.kv_cache_memory_bytes else None
    if kv is None and p is not None and p.kv_cache_bytes and p.kv_cache_bytes > 0:
        kv = p.kv_cache_bytes
    if kv is None:
        return None
    weights = p.weights_bytes if p is not None and p.weights_bytes else 0
    return kv + weights


def _logs_sleeps(server: VllmSample) -> bool:
    """The server's log has told of two sleeps or more (_log_signal has something to compare)."""
    p = server.startup
    return server.up and p is not None and p.sleeps >= 2 and p.sleep_still_in_use_bytes is not None


def _log_signal(frames: list[Snapshot], server: VllmSample, snapshot: Snapshot,
                config: SleepConfig) -> Evidence:
    """The log's "still in use" after the latest sleep against the one before it."""
    p = server.startup
    if not _logs_sleeps(server) or p is None or p.sleep_still_in_use_bytes is None:
        return []
    previous = None
    for snap in reversed(frames[:-1]):  # the latest earlier figure from the previous sleep
        old = next((v.startup for v in snap.vllm if v.endpoint == server.endpoint), None)
        if old is not None and old.sleeps == p.sleeps - 1 and old.sleep_still_in_use_bytes is not None:
            previous = old
            break
    if previous is None or previous.sleep_still_in_use_bytes is None:
        return []
    gpus = [g for g in snapshot.gpus if _used(g, server.endpoint) is not None]
    margin = _margin(gpus[0] if gpus else None, config)
    growth = p.sleep_still_in_use_bytes - previous.sleep_still_in_use_bytes
    if growth <= margin:
        return []
    return [("signal", "log_still_in_use_grew"),
            ("still_in_use_previous_sleep_bytes", previous.sleep_still_in_use_bytes),
            ("still_in_use_last_sleep_bytes", p.sleep_still_in_use_bytes),
            ("kept_bytes", growth), ("margin_bytes", margin),
            ("freed_previous_sleep_bytes", previous.sleep_freed_bytes or 0),
            ("freed_last_sleep_bytes", p.sleep_freed_bytes or 0), ("sleeps", p.sleeps),
            ("scope", "device (vLLM logs cudaMemGetInfo: other processes count too)")]


def _finding(gpu: GpuSample | None, server: VllmSample, evidence: Evidence, now: float) -> Finding:
    e = dict(evidence)
    where = f"GPU {gpu.index}" if gpu is not None else "its GPU"
    signal = e["signal"]
    if signal == "freed_too_little":
        summary = (f"{server.endpoint}: asleep ({e['sleep_state']}) on {where} it freed only "
                   f"{format_bytes(int(e['freed_bytes']))} and still holds {format_bytes(int(e['asleep_bytes']))}"
                   f" ({e['summary_detail']})")
    elif signal == "not_given_back" and int(e.get("cycles", 1)) > 1:
        summary = (f"{server.endpoint}: {e['cycles']} sleep/wake cycles did not give memory back on {where}: "
                   f"{format_bytes(int(e['first_before_sleep_bytes']))} before the first sleep, "
                   f"{format_bytes(int(e['after_wake_bytes']))} after the last wake: "
                   f"{format_bytes(int(e['kept_bytes']))} kept in all "
                   f"(+{format_bytes(int(e['last_cycle_kept_bytes']))} the last cycle)")
    elif signal == "not_given_back":
        summary = (f"{server.endpoint}: a sleep/wake cycle did not give memory back on {where}: "
                   f"{format_bytes(int(e['before_sleep_bytes']))} before sleep, "
                   f"{format_bytes(int(e['after_wake_bytes']))} after wake "
                   f"(+{format_bytes(int(e['kept_bytes']))})")
    else:
        summary = (f"{server.endpoint}: memory still in use after sleep rose from "
                   f"{format_bytes(int(e['still_in_use_previous_sleep_bytes']))} to "
                   f"{format_bytes(int(e['still_in_use_last_sleep_bytes']))} between two sleeps (its log)")
    evidence = [(k, v) for k, v in evidence if k != "summary_detail"]
    return Finding(
        kind="sleep_leak", severity="warning", first_detected_at=now,
        gpu=gpu.index if gpu is not None else None, uuid=gpu.uuid if gpu is not None else "",
        endpoint=server.endpoint, summary=summary, evidence=tuple(evidence), advice=_ADVICE)


_ADVICE = (
    "Memory allocated outside vLLM's sleep pool (CuMemAllocator) is not released by sleep: "
    "custom ops, NCCL buffers (set NCCL_CUMEM_ENABLE=0 or check the NCCL version), "
    "torch.compile / CUDA graph pools and tensors a caller created between sleep and wake.",
    "Check the server's log for each cycle ('Sleep mode freed X GiB memory, Y GiB memory is "
    "still in use'): Y should stay the same from one sleep to the next.",
    "Upgrade vLLM and PyTorch: several sleep-mode leaks were fixed; until then restart the "
    "server before the GPU fills (gpumem_vllm_memory_used_bytes over the cycles).",
)


DETECTOR = DetectorSpec(
    name="sleep_leak", config=SleepConfig, create=SleepLeakDetector,
    help="vLLM sleep mode (--enable-sleep-mode): sleep/wake cycles that do not give memory back.",
    kinds=(FindingKind(
        "sleep_leak", scenario="sleep-leak",
        help=("a vLLM sleep/wake cycle that did not give memory back, or a sleep that freed much "
              "less than the KV cache and weights"),
        alert=FindingAlert(
            "VllmSleepModeLeak", severity="ticket", for_="5m",
            summary=("vLLM {{ $labels.endpoint }} on {{ $labels.instance }} keeps memory across "
                     "sleep{{ with $labels.gpu }} on GPU {{ . }}{{ end }}."),
            description=("The exporter's sleep-mode detector finds that {{ $labels.endpoint }} on "
                         "{{ $labels.instance }} did not give memory back over its last sleep/wake cycle, or "
                         "freed much less than its KV cache and weights while asleep. Its processes now hold "
                         '{{ with printf "sum(gpumem_vllm_memory_used_bytes{instance=%q,endpoint=%q})" '
                         "$labels.instance $labels.endpoint | query }}{{ . | first | value "
                         "| humanize1024 }}B{{ end }} of GPU memory. What each cycle keeps adds up until a wake "
                         "or a request runs out of memory."))),),
    settings={
        "min_growth_bytes": "A cycle that kept more than this ...",
        "min_growth_ratio": "... and this share of the GPU did not give its memory back.",
        "settle_seconds": "After a sleep or a wake, the server's memory is judged only this much later.",
        "min_freed_share": ("Asleep at level 1 or 2, a server must have freed at least this share of its KV cache "
                            "and weights."),
        "lookback_seconds": "Sleep/wake cycles are looked for this far back (as far as the history holds).",
    })
