"""Simulation scenarios: a YAML description of a host whose whole state is a pure function of time.

A scenario lists GPUs, host memory, processes (with a memory curve per GPU and a host RSS curve),
stale memory, vLLM servers and faults. `Scenario.state_at(t)` (t = seconds since the scenario
started) returns everything the fake NVML module, the simulated host and the fake vLLM server
report at that moment, so any run (live, `snapshot --at`, tests) sees the same numbers for the
same t.

Curves are a list of components whose values add up:

    constant: 1GiB                        (a bare scalar is shorthand for this)
    step:     {at: 600, to: 20GiB}        (`from` before `at`, default 0; or {at, by})
    ramp:     {weights: 15GiB, kv_cache: 50GiB, ...}   a vLLM start-up (see RampComponent)
    linear:   {from: 300, rate: 4MiB/min, until: 7200} grows from time `from` to `until`
    sawtooth: {period: 120, amplitude: 1GiB}           rises over each period, then drops
    staircase: {every: 600, step: 256MiB}              jumps by `step` every `every` seconds
    noise:    {stddev: 32MiB, seed: 7}                 hash-based: a pure function of (seed, t)

Process curves run on the process's own time (seconds since it started), so a process that
starts at 30 min begins its ramp then; host and vLLM curves run on scenario time.

Top-level keys (sizes: 80GiB / bytes; times: seconds or "30m"; unknown keys are errors):

    name, description (one line), duration, driver_version?, cuda_driver_version?
    gpus:   [{name, memory, reserved?, unified?, count?, mig?: [{profile, memory}]}]
    host:   {memory, available?, psi_some?, psi_full?, oom_kills?, subtract_processes?}
    processes: [{pid, ppid?, name (comm, <= 15 chars), cmdline?, gpu? (0 | "0/1" | [0, 1]),
                 start?, stop?, memory? (curve), memory_by_gpu? {gpu: curve}, rss?, kind?,
                 container? (64 hex), pod_uid?, qos?, namespace?, ns_pid?,
                 memory_not_available?, replicas? (copies with pids pid, pid+1, ...)}]
    stale_memory: [{gpu, bytes, at?, until?}]
    vllm:   [{port, pid (API server), model, kv_cache_usage?, running?, waiting?,
              preemptions? (cumulative), prefix_cache_queries? (cumulative),
              prefix_cache_hit_ratio?, cache_config: {gpu_memory_utilization, num_gpu_blocks,
              block_size?, cache_dtype?, enable_prefix_caching?, kv_cache_memory_bytes?}}]
    faults: [{kind: init_failure, error: library_not_found|driver_not_loaded|lib_rm_version_mismatch}
             {kind: gpu_lost|reset_required, gpu}
             {call: nvmlDeviceGetMemoryInfo, version?: 1|2, error: FunctionNotFound, gpu?}
             {kind: vllm_http_error (status?) | vllm_slow (delay) | vllm_garbage, server?}
             each with at? (default 0) and until? (default: forever), active in [at, until)]
"""
from __future__ import annotations

import math
import re
import threading
import uuid as uuidlib
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import yaml

SCENARIO_DIR = Path(__file__).with_name("scenarios")
MAX_SCENARIO_BYTES = 4 * 1024 * 1024  # scenario files are hand-written; refuse anything huge
MAX_PROCESSES = 4096

_UNIT = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PER = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60,
        "h": 3600, "hour": 3600, "d": 86400, "day": 86400}
_SIZE_RE = re.compile(r"^\s*([+-]?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d)?\s*$")

INIT_ERRORS = ("library_not_found", "driver_not_loaded", "lib_rm_version_mismatch")
VLLM_FAULTS = ("vllm_http_error", "vllm_slow", "vllm_garbage")
FAULT_KINDS = ("init_failure", "gpu_lost", "reset_required", "call_error") + VLLM_FAULTS


class ScenarioError(ValueError):
    """A scenario that cannot be used; the message names the key path and the problem."""


# ----------------------------------------------------------------------------------------------
# Reading values with key paths in errors


class _Node:
    """A mapping being read: remembers which keys were used so unknown ones can be rejected."""

    def __init__(self, data: Any, path: str):
        if not isinstance(data, Mapping):
            raise ScenarioError(f"{path or '<top>'}: expected a mapping, got {_kind(data)}")
        for key in data:
            if not isinstance(key, str):
                raise ScenarioError(f"{path or '<top>'}: keys must be strings, got {key!r}")
        self.data = data
        self.path = path
        self.used: set[str] = set()

    def sub(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def get(self, key: str, parse: Callable[[Any, str], Any], default: Any = ...) -> Any:
        self.used.add(key)
        if key not in self.data or self.data[key] is None:
            if default is ...:
                raise ScenarioError(f"{self.sub(key)}: required key is missing")
            return default
        return parse(self.data[key], self.sub(key))

    def done(self) -> None:
        unknown = [k for k in self.data if k not in self.used]
        if unknown:
            allowed = ", ".join(sorted(self.used))
            raise ScenarioError(f"{self.sub(unknown[0])}: unknown key (allowed: {allowed})")


def _kind(value: Any) -> str:
    return type(value).__name__


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ScenarioError(f"{path}: expected a number, got {value!r}")
    return float(value)


def _nonneg(value: Any, path: str) -> float:
    v = _number(value, path)
    if v < 0:
        raise ScenarioError(f"{path}: must not be negative, got {value!r}")
    return v


def _positive(value: Any, path: str) -> float:
    v = _number(value, path)
    if v <= 0:
        raise ScenarioError(f"{path}: must be positive, got {value!r}")
    return v


def _int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(f"{path}: expected an integer, got {value!r}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ScenarioError(f"{path}: expected a string, got {value!r}")
    return value


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ScenarioError(f"{path}: expected true or false, got {value!r}")
    return value


def _list(value: Any, path: str) -> list:
    if not isinstance(value, list):
        raise ScenarioError(f"{path}: expected a list, got {_kind(value)}")
    return value


def parse_size(value: Any, path: str = "size") -> float:
    """Bytes from an int/float or a string like "80GiB", "512MiB", "1.5GB", "-2GiB"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _number(value, path)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNIT:
            return float(m.group(1)) * _UNIT[m.group(2).lower()]
    raise ScenarioError(f"{path}: expected a size like '80GiB' or a number of bytes, got {value!r}")


def parse_rate(value: Any, path: str = "rate") -> float:
    """Units per second from a number or a string like "2MiB/min", "100MiB/h", "12/min"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _number(value, path)
    if isinstance(value, str) and value.count("/") == 1:
        amount, per = value.split("/")
        m = _SIZE_RE.match(amount)
        per = per.strip().lower()
        if m and m.group(2).lower() in _UNIT and per in _PER:
            return float(m.group(1)) * _UNIT[m.group(2).lower()] / _PER[per]
    raise ScenarioError(f"{path}: expected a rate like '2MiB/min', got {value!r}")


def parse_duration(value: Any, path: str = "duration") -> float:
    """Seconds from a number or a string like "90s", "30m", "6h", "1d"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _nonneg(value, path)
    if isinstance(value, str):
        m = _DURATION_RE.match(value)
        if m:
            return float(m.group(1)) * _PER[m.group(2) or "s"]
    raise ScenarioError(f"{path}: expected seconds or a duration like '30m', got {value!r}")


def _size_nonneg(value: Any, path: str) -> float:
    v = parse_size(value, path)
    if v < 0:
        raise ScenarioError(f"{path}: must not be negative, got {value!r}")
    return v


def _plain_number(value: Any, path: str) -> float:
    """Values of non-byte curves (ratios, counts, percent) may not carry byte units."""
    if isinstance(value, str):
        raise ScenarioError(f"{path}: expected a number, got {value!r}")
    return _number(value, path)


# ----------------------------------------------------------------------------------------------
# Curves


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def hash_normal(seed: int, bucket: int) -> float:
    """A standard normal deviate that depends only on (seed, bucket): no hidden RNG state."""
    h1 = _splitmix64((seed * 1_000_003) ^ (bucket & 0xFFFFFFFFFFFFFFFF))
    h2 = _splitmix64(h1)
    u1 = ((h1 >> 11) + 1) / 9007199254740993.0  # (0, 1]
    u2 = (h2 >> 11) / 9007199254740992.0
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def _constant(v: float):
    return lambda t: v


def _step(at: float, before: float, after: float):
    return lambda t: after if t >= at else before


def _linear(start: float, rate: float, until: float | None):
    if until is None:
        return lambda t: rate * (t - start) if t > start else 0.0
    return lambda t: rate * (min(t, until) - start) if t > start else 0.0


def _sawtooth(period: float, amplitude: float, phase: float):
    return lambda t: amplitude * (((t + phase) % period) / period)


def _staircase(every: float, step: float, start: float, until: float | None):
    def f(t: float) -> float:
        if t < start:
            return 0.0
        if until is not None:
            t = min(t, until)
        return step * math.floor((t - start) / every)
    return f


def _noise(stddev: float, seed: int, every: float):
    return lambda t: stddev * hash_normal(seed, math.floor(t / every))


def _ramp(at: float, non_torch: float, weights: float, load_s: float, peak: float,
          profile_s: float, kv: float, graphs: float, graph_s: float):
    """vLLM start-up: load weights, profile (activation spike), preallocate KV, capture graphs."""
    t1, t2 = load_s, load_s + profile_s
    t3 = t2 + graph_s
    plateau = non_torch + weights + kv + graphs

    def f(t: float) -> float:
        t -= at
        if t < 0:
            return 0.0
        if t >= t3:
            return plateau
        if t < t1:
            return non_torch + weights * (t / t1)
        if t < t2:
            return non_torch + weights + peak
        return non_torch + weights + kv + graphs * ((t - t2) / graph_s)
    return f


@dataclass(frozen=True)
class Curve:
    """A sum of components; `monotonic` records that it can only grow (for counters)."""

    components: tuple[Callable[[float], float], ...] = ()
    monotonic: bool = True
    startup: Mapping[str, float] | None = None  # the ramp's figures, for the simulated vLLM log

    def __call__(self, t: float) -> float:
        return sum(c(t) for c in self.components) if self.components else 0.0

    @staticmethod
    def zero() -> "Curve":
        return Curve(())


_COMPONENTS = ("constant", "step", "ramp", "linear", "sawtooth", "staircase", "noise")


def parse_curve(value: Any, path: str, *, bytes_: bool, seed_base: int = 0,
                counter: bool = False) -> Curve:
    """A curve from a scalar (constant), a one-component mapping, or a list of components.

    `bytes_` selects whether values take size units ("1GiB") or must be plain numbers.
    `counter` allows only components that never decrease (a Prometheus counter never does).
    """
    val = parse_size if bytes_ else _plain_number
    rate = parse_rate  # "2MiB/min" for bytes, "12/min" for counts
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return Curve((_constant(val(value, path)),), True)
    if isinstance(value, Mapping):
        items, paths = [value], [path]
    elif isinstance(value, list):
        items, paths = value, [f"{path}[{i}]" for i in range(len(value))]
    else:
        raise ScenarioError(f"{path}: expected a curve (a number, a component or a list), got {_kind(value)}")
    comps = []
    monotonic = True
    startup = None
    for item, p in zip(items, paths):
        if not isinstance(item, Mapping) or len(item) != 1:
            raise ScenarioError(f"{p}: expected one component, one of: {', '.join(_COMPONENTS)}")
        (kind, params), = item.items()
        if kind not in _COMPONENTS:
            raise ScenarioError(f"{p}.{kind}: unknown curve component (expected one of: {', '.join(_COMPONENTS)})")
        cp = f"{p}.{kind}"
        if kind == "constant":
            comps.append(_constant(val(params, cp)))
            continue
        n = _Node(params, cp)
        if kind == "step":
            at = n.get("at", parse_duration)
            if n.has("by") == n.has("to"):
                raise ScenarioError(f"{cp}: give exactly one of 'to' or 'by'")
            if n.has("by"):
                before, after = 0.0, n.get("by", val)
            else:
                before, after = n.get("from", val, 0.0), n.get("to", val)
            monotonic &= after >= before
            comps.append(_step(at, before, after))
        elif kind == "ramp":
            if not bytes_:
                raise ScenarioError(f"{cp}: a ramp is a memory start-up; use it in memory curves only")
            startup = {
                "at": n.get("at", parse_duration, 0.0),
                "non_torch": n.get("non_torch", _size_nonneg, 0.0),
                "weights": n.get("weights", _size_nonneg),
                "load_seconds": n.get("load_seconds", _positive, 60.0),
                "profile_peak": n.get("profile_peak", _size_nonneg, 0.0),
                "profile_seconds": n.get("profile_seconds", _positive, 15.0),
                "kv_cache": n.get("kv_cache", _size_nonneg),
                "cuda_graphs": n.get("cuda_graphs", _size_nonneg, 0.0),
                "graph_seconds": n.get("graph_seconds", _positive, 20.0),
            }
            comps.append(_ramp(*startup.values()))
            monotonic = False
        elif kind == "linear":
            start = n.get("from", parse_duration, 0.0)
            r = n.get("rate", rate)
            until = n.get("until", parse_duration, None)
            if until is not None and until < start:
                raise ScenarioError(f"{cp}.until: must not be before 'from'")
            monotonic &= r >= 0
            comps.append(_linear(start, r, until))
        elif kind == "sawtooth":
            comps.append(_sawtooth(n.get("period", _positive), n.get("amplitude", val),
                                   n.get("phase", _number, 0.0)))
            monotonic = False
        elif kind == "staircase":
            every = n.get("every", _positive)
            step = n.get("step", val)
            start = n.get("from", parse_duration, 0.0)
            until = n.get("until", parse_duration, None)
            monotonic &= step >= 0
            comps.append(_staircase(every, step, start, until))
        elif kind == "noise":
            default_seed = (seed_base ^ zlib.crc32(p.encode())) & 0x7FFFFFFF
            comps.append(_noise(n.get("stddev", _size_nonneg if bytes_ else _nonneg),
                                n.get("seed", _int, default_seed), n.get("every", _positive, 1.0)))
            monotonic = False
        n.done()
    if counter and not monotonic:
        raise ScenarioError(f"{path}: a counter may only use components that never decrease "
                            "(constant, step up, linear with rate >= 0, staircase with step >= 0)")
    return Curve(tuple(comps), monotonic, MappingProxyType(startup) if startup else None)


# ----------------------------------------------------------------------------------------------
# Specs (what the YAML says)


@dataclass(frozen=True)
class MigSpec:
    index: int
    profile: str
    memory_bytes: int
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str


@dataclass(frozen=True)
class GpuSpec:
    index: int
    name: str
    uuid: str
    memory_bytes: int
    reserved_bytes: int
    unified: bool
    mig: tuple[MigSpec, ...] = ()

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserved_bytes


@dataclass(frozen=True)
class HostSpec:
    memory_bytes: int
    available: Curve
    psi_some: Curve
    psi_full: Curve | None
    oom_kills: Curve
    subtract_processes: bool


@dataclass(frozen=True)
class ProcessSpec:
    pid: int
    ppid: int
    name: str
    gpus: tuple[str, ...]  # "0" or "0/1" (MIG parent/instance)
    start: float
    stop: float | None
    memory: Mapping[str, Curve]  # per GPU key
    rss: Curve
    kind: str = "compute"
    cmdline: str = ""
    container: str = ""
    pod_uid: str = ""
    namespace: str = ""
    qos: str = "burstable"
    ns_pid: int | None = None
    memory_not_available: bool = False

    def alive_at(self, t: float) -> bool:
        return self.start <= t and (self.stop is None or t < self.stop)


@dataclass(frozen=True)
class StaleSpec:
    gpu: str
    bytes: int
    at: float
    until: float | None


@dataclass(frozen=True)
class CacheConfigSpec:
    gpu_memory_utilization: float
    num_gpu_blocks: int
    block_size: int
    cache_dtype: str
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None


@dataclass(frozen=True)
class VllmSpec:
    index: int
    port: int
    pid: int
    model: str
    kv_cache_usage: Curve
    running: Curve
    waiting: Curve
    preemptions: Curve
    prefix_cache_queries: Curve
    prefix_cache_hit_ratio: float
    cache_config: CacheConfigSpec


@dataclass(frozen=True)
class FaultSpec:
    kind: str  # one of FAULT_KINDS
    at: float
    until: float | None
    gpu: int | None = None  # None: every GPU
    error: str = ""  # init: library_not_found...; call_error: an NVMLError_* suffix
    call: str = ""
    version: int | None = None  # nvmlDeviceGetMemoryInfo: 1 or 2; None: both
    server: int | None = None  # vLLM faults: server index; None: every server
    status: int = 500
    delay: float = 0.0

    def active_at(self, t: float) -> bool:
        return self.at <= t and (self.until is None or t < self.until)


# ----------------------------------------------------------------------------------------------
# State (what the host looks like at time t)


@dataclass(frozen=True)
class MigState:
    key: str  # "0/1"
    index: int
    profile: str
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    total_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class GpuState:
    index: int
    name: str
    uuid: str
    total_bytes: int
    reserved_bytes: int
    used_bytes: int  # NVML v2 meaning: excludes the driver-reserved part
    unified: bool
    stale_bytes: int = 0
    mig: tuple[MigState, ...] = ()

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.reserved_bytes - self.used_bytes


@dataclass(frozen=True)
class ProcessState:
    pid: int
    ppid: int
    name: str
    kind: str
    start: float  # scenario seconds
    gpu_bytes: Mapping[str, int]  # GPU key ("0", "0/1") -> bytes
    rss_bytes: int
    cmdline: str = ""
    container: str = ""
    pod_uid: str = ""
    namespace: str = ""
    qos: str = "burstable"
    ns_pid: int | None = None
    memory_not_available: bool = False


@dataclass(frozen=True)
class HostState:
    total_bytes: int
    available_bytes: int
    psi_some_avg10: float
    psi_full_avg10: float | None
    oom_kills: int


@dataclass(frozen=True)
class VllmState:
    index: int
    port: int
    pid: int
    model: str
    up: bool  # the API server process is alive
    started_at: float  # scenario seconds when the API server started
    kv_cache_usage: float
    requests_running: int
    requests_waiting: int
    preemptions_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    cache_config: CacheConfigSpec


@dataclass(frozen=True)
class State:
    t: float
    gpus: tuple[GpuState, ...]
    processes: tuple[ProcessState, ...]  # live ones, by pid
    host: HostState
    vllm: tuple[VllmState, ...]
    faults: tuple[FaultSpec, ...]  # active at t
    _by_pid: Mapping[int, ProcessState] = field(default_factory=dict, repr=False, compare=False)

    def process(self, pid: int) -> ProcessState | None:
        return self._by_pid.get(pid)

    def processes_on(self, key: str) -> list[ProcessState]:
        return [p for p in self.processes if key in p.gpu_bytes]


# ----------------------------------------------------------------------------------------------
# The scenario


@dataclass
class Scenario:
    name: str
    description: str
    duration: float
    gpus: tuple[GpuSpec, ...]
    host: HostSpec
    processes: tuple[ProcessSpec, ...]
    stale_memory: tuple[StaleSpec, ...]
    vllm: tuple[VllmSpec, ...]
    faults: tuple[FaultSpec, ...]
    driver_version: str = "570.172.08"
    cuda_driver_version: int = 12080
    source: str = ""
    resolution: float = 1.0  # state_for(clock) rounds scenario time down to this many seconds
    _memo: tuple | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def faults_at(self, t: float) -> tuple[FaultSpec, ...]:
        return tuple(f for f in self.faults if f.active_at(t))

    def replace_processes(self, processes: Iterable[ProcessSpec]) -> None:
        """Swap in a new process list, in place: the fake NVML module and the simulated host
        keep holding this Scenario. For hosts with more processes over time than one scenario
        may list (the soak benchmark's churn comes in windows)."""
        with self._lock:
            self.processes = tuple(processes)
            self._memo = None

    def state_for(self, clock) -> State:
        """The state at the clock's scenario time (a VirtualClock or FixedClock: `elapsed()`),
        rounded down to `resolution` so the many calls of one sampling tick share one evaluation."""
        t = clock.elapsed()
        if self.resolution > 0:
            t = math.floor(t / self.resolution) * self.resolution
        return self.state_at(t)

    def state_at(self, t: float) -> State:
        memo = self._memo
        if memo is not None and memo[0] == t:
            return memo[1]
        with self._lock:
            memo = self._memo
            if memo is not None and memo[0] == t:
                return memo[1]
            state = self._evaluate(float(t))
            self._memo = (t, state)
            return state

    def _evaluate(self, t: float) -> State:
        totals = {}
        for g in self.gpus:
            for m in g.mig:
                totals[f"{g.index}/{m.index}"] = m.memory_bytes
            totals[str(g.index)] = g.usable_bytes
        used: dict[str, int] = dict.fromkeys(totals, 0)
        procs = []
        for p in self.processes:
            if not p.alive_at(t):
                continue
            pt = t - p.start
            gpu_bytes = {}
            for key in p.gpus:
                v = p.memory[key](pt)
                v = int(min(max(v, 0.0), totals[key]))
                gpu_bytes[key] = v
                used[key] += v
            rss = int(max(p.rss(pt), 0.0))
            procs.append(ProcessState(
                pid=p.pid, ppid=p.ppid, name=p.name, kind=p.kind, start=p.start,
                gpu_bytes=MappingProxyType(gpu_bytes), rss_bytes=rss, cmdline=p.cmdline,
                container=p.container, pod_uid=p.pod_uid, namespace=p.namespace, qos=p.qos,
                ns_pid=p.ns_pid, memory_not_available=p.memory_not_available))
        procs.sort(key=lambda p: p.pid)
        stale: dict[str, int] = {}
        for s in self.stale_memory:
            if s.at <= t and (s.until is None or t < s.until):
                stale[s.gpu] = stale.get(s.gpu, 0) + s.bytes
                used[s.gpu] += s.bytes
        gpus = []
        for g in self.gpus:
            migs = []
            for m in g.mig:
                key = f"{g.index}/{m.index}"
                migs.append(MigState(key, m.index, m.profile, m.uuid, m.gpu_instance_id,
                                     m.compute_instance_id, m.memory_bytes,
                                     min(used[key], m.memory_bytes)))
            own = used[str(g.index)] + sum(m.used_bytes for m in migs)
            gpus.append(GpuState(
                index=g.index, name=g.name, uuid=g.uuid, total_bytes=g.memory_bytes,
                reserved_bytes=g.reserved_bytes, used_bytes=min(own, g.usable_bytes),
                unified=g.unified, stale_bytes=stale.get(str(g.index), 0), mig=tuple(migs)))
        host = self._host_state(t, procs, gpus)
        by_pid = {p.pid: p for p in procs}
        servers = tuple(self._vllm_state(v, t, by_pid) for v in self.vllm)
        return State(t=t, gpus=tuple(gpus), processes=tuple(procs), host=host, vllm=servers,
                     faults=self.faults_at(t), _by_pid=by_pid)

    def _host_state(self, t: float, procs: list[ProcessState], gpus: list[GpuState]) -> HostState:
        h = self.host
        avail = h.available(t)
        if h.subtract_processes:
            # On a unified-memory machine GPU allocations come out of host RAM too.
            avail -= sum(p.rss_bytes for p in procs)
            avail -= sum(g.used_bytes for g in gpus if g.unified)
        psi_full = None if h.psi_full is None else min(max(h.psi_full(t), 0.0), 100.0)
        return HostState(
            total_bytes=h.memory_bytes,
            available_bytes=int(min(max(avail, 0.0), h.memory_bytes)),
            psi_some_avg10=round(min(max(h.psi_some(t), 0.0), 100.0), 2),
            psi_full_avg10=None if psi_full is None else round(psi_full, 2),
            oom_kills=int(max(h.oom_kills(t), 0.0)))

    def _vllm_state(self, v: VllmSpec, t: float, by_pid: Mapping[int, ProcessState]) -> VllmState:
        api = by_pid.get(v.pid)
        start = next((p.start for p in self.processes if p.pid == v.pid and p.alive_at(t)),
                     next(p.start for p in self.processes if p.pid == v.pid))
        up = api is not None
        queries = int(max(v.prefix_cache_queries(t), 0.0)) if up else 0
        return VllmState(
            index=v.index, port=v.port, pid=v.pid, model=v.model, up=up, started_at=start,
            kv_cache_usage=min(max(v.kv_cache_usage(t), 0.0), 1.0) if up else 0.0,
            requests_running=int(max(round(v.running(t)), 0)) if up else 0,
            requests_waiting=int(max(round(v.waiting(t)), 0)) if up else 0,
            preemptions_total=int(max(v.preemptions(t), 0.0)) if up else 0,
            prefix_cache_queries_total=queries,
            prefix_cache_hits_total=int(queries * v.prefix_cache_hit_ratio),
            cache_config=v.cache_config)


# ----------------------------------------------------------------------------------------------
# Loading


def _gpu_uuid(scenario: str, *parts: object) -> str:
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, "gpumem-sim:" + "/".join(map(str, (scenario,) + parts))))


def _parse_gpus(value: Any, path: str, scenario: str) -> tuple[GpuSpec, ...]:
    out = []
    items = _list(value, path)
    if not items:
        raise ScenarioError(f"{path}: at least one GPU is needed")
    for i, item in enumerate(items):
        n = _Node(item, f"{path}[{i}]")
        count = n.get("count", _int, 1)
        if count < 1 or count > 64:
            raise ScenarioError(f"{n.sub('count')}: must be between 1 and 64")
        name = n.get("name", _str, "NVIDIA H100 80GB HBM3")
        memory = int(n.get("memory", _size_nonneg))
        if memory <= 0:
            raise ScenarioError(f"{n.sub('memory')}: must be positive")
        reserved = int(n.get("reserved", _size_nonneg, 0))
        if reserved >= memory:
            raise ScenarioError(f"{n.sub('reserved')}: must be less than memory")
        unified = n.get("unified", _bool, False)
        mig_items = n.get("mig", _list, [])
        if mig_items and unified:
            raise ScenarioError(f"{n.sub('mig')}: a unified-memory GPU has no MIG")
        n.done()
        for _ in range(count):
            index = len(out)
            migs = []
            for j, m in enumerate(mig_items):
                mn = _Node(m, f"{path}[{i}].mig[{j}]")
                profile = mn.get("profile", _str)
                mem = int(mn.get("memory", _size_nonneg))
                mn.done()
                migs.append(MigSpec(j, profile, mem, gpu_instance_id=j + 1, compute_instance_id=0,
                                    uuid="MIG-" + _gpu_uuid(scenario, index, j)))
            if sum(m.memory_bytes for m in migs) > memory - reserved:
                raise ScenarioError(f"{path}[{i}].mig: instances add up to more than the GPU's memory")
            out.append(GpuSpec(index, name, "GPU-" + _gpu_uuid(scenario, index), memory, reserved,
                               unified, tuple(migs)))
    return tuple(out)


def _parse_host(value: Any, path: str) -> HostSpec:
    n = _Node(value, path)
    total = int(n.get("memory", _size_nonneg))
    spec = HostSpec(
        memory_bytes=total,
        available=n.get("available", lambda v, p: parse_curve(v, p, bytes_=True), Curve((_constant(total * 0.8),))),
        psi_some=n.get("psi_some", lambda v, p: parse_curve(v, p, bytes_=False), Curve.zero()),
        psi_full=n.get("psi_full", lambda v, p: parse_curve(v, p, bytes_=False), None),
        oom_kills=n.get("oom_kills", lambda v, p: parse_curve(v, p, bytes_=False, counter=True), Curve.zero()),
        subtract_processes=n.get("subtract_processes", _bool, False),
    )
    n.done()
    return spec


_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_POD_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_GPU_KEY = re.compile(r"^(\d+)(?:/(\d+))?$")


def _gpu_key(value: Any, path: str, gpus: tuple[GpuSpec, ...]) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    m = _GPU_KEY.match(value) if isinstance(value, str) else None
    if not m:
        raise ScenarioError(f"{path}: expected a GPU index like 0 or a MIG instance like '0/1', got {value!r}")
    g = int(m.group(1))
    if g >= len(gpus):
        raise ScenarioError(f"{path}: no GPU {g} (the scenario has {len(gpus)})")
    if m.group(2) is None:
        if gpus[g].mig:
            raise ScenarioError(f"{path}: GPU {g} is in MIG mode; name an instance like '{g}/0'")
        return str(g)
    if int(m.group(2)) >= len(gpus[g].mig):
        raise ScenarioError(f"{path}: GPU {g} has no MIG instance {m.group(2)}")
    return f"{g}/{int(m.group(2))}"


def _parse_processes(value: Any, path: str, gpus: tuple[GpuSpec, ...]) -> tuple[ProcessSpec, ...]:
    out: list[ProcessSpec] = []
    for i, item in enumerate(_list(value, path)):
        p = f"{path}[{i}]"
        n = _Node(item, p)
        pid = n.get("pid", _int)
        replicas = n.get("replicas", _int, 1)
        if replicas < 1 or len(out) + replicas > MAX_PROCESSES:
            raise ScenarioError(f"{n.sub('replicas')}: must be between 1 and {MAX_PROCESSES} processes in all")
        if pid < 1 or pid + replicas - 1 > 4194304:
            raise ScenarioError(f"{n.sub('pid')}: must be between 1 and 4194304")
        ppid = n.get("ppid", _int, 1)
        name = n.get("name", _str)
        if not name or len(name) > 15:
            raise ScenarioError(f"{n.sub('name')}: a process name (comm) has 1 to 15 characters")
        raw_gpu = n.get("gpu", lambda v, q: v, None)
        if raw_gpu is None:
            keys: tuple[str, ...] = ()
        elif isinstance(raw_gpu, list):
            keys = tuple(_gpu_key(g, f"{n.sub('gpu')}[{j}]", gpus) for j, g in enumerate(raw_gpu))
        else:
            keys = (_gpu_key(raw_gpu, n.sub("gpu"), gpus),)
        if len(set(keys)) != len(keys):
            raise ScenarioError(f"{n.sub('gpu')}: a GPU is listed twice")
        start = n.get("start", parse_duration, 0.0)
        stop = n.get("stop", parse_duration, None)
        if stop is not None and stop <= start:
            raise ScenarioError(f"{n.sub('stop')}: must be after start")
        kind = n.get("kind", _str, "compute")
        if kind not in ("compute", "graphics"):
            raise ScenarioError(f"{n.sub('kind')}: expected compute or graphics, got {kind!r}")
        container = n.get("container", _str, "")
        if container and not _HEX64.match(container):
            raise ScenarioError(f"{n.sub('container')}: expected a 64-character lowercase hex container id")
        pod_uid = n.get("pod_uid", _str, "")
        if pod_uid and not _POD_UID.match(pod_uid):
            raise ScenarioError(f"{n.sub('pod_uid')}: expected a pod UID like 1b4e28ba-2fa1-11d2-883f-0016d3cca427")
        if pod_uid and not container:
            raise ScenarioError(f"{n.sub('pod_uid')}: a pod needs a container id too")
        qos = n.get("qos", _str, "burstable")
        if qos not in ("burstable", "besteffort", "guaranteed"):
            raise ScenarioError(f"{n.sub('qos')}: expected burstable, besteffort or guaranteed")
        namespace = n.get("namespace", _str, "")
        cmdline = n.get("cmdline", _str, "")
        ns_pid = n.get("ns_pid", _int, None)
        not_avail = n.get("memory_not_available", _bool, False)
        raw_mem = n.get("memory", lambda v, q: v, None)
        raw_by_gpu = n.get("memory_by_gpu", lambda v, q: v, None)
        raw_rss = n.get("rss", lambda v, q: v, 0)
        n.done()
        if keys and raw_mem is None and raw_by_gpu is None:
            raise ScenarioError(f"{n.sub('memory')}: required for a process on a GPU")
        if not keys and (raw_mem is not None or raw_by_gpu is not None):
            raise ScenarioError(f"{n.sub('memory')}: the process has no 'gpu'")
        by_gpu_raw: dict[str, tuple[Any, str]] = {}
        if raw_by_gpu is not None:
            if not isinstance(raw_by_gpu, Mapping):
                raise ScenarioError(f"{n.sub('memory_by_gpu')}: expected a mapping of GPU to curve")
            for k, v in raw_by_gpu.items():  # keys are GPU indexes: YAML gives ints or strings
                kp = f"{n.sub('memory_by_gpu')}.{k}"
                key = _gpu_key(k, kp, gpus)
                if key not in keys:
                    raise ScenarioError(f"{kp}: the process is not on GPU {key}")
                by_gpu_raw[key] = (v, kp)
        for r in range(replicas):
            seed = zlib.crc32(f"{p}#{r}".encode())
            memory = {}
            for key in keys:
                raw, rp = by_gpu_raw.get(key, (raw_mem, n.sub("memory")))
                if raw is None:
                    raise ScenarioError(f"{n.sub('memory')}: no curve for GPU {key}")
                memory[key] = parse_curve(raw, rp, bytes_=True, seed_base=seed ^ zlib.crc32(key.encode()))
            rss = parse_curve(raw_rss, n.sub("rss"), bytes_=True, seed_base=seed)
            out.append(ProcessSpec(
                pid=pid + r, ppid=ppid, name=name, gpus=keys, start=start, stop=stop,
                memory=MappingProxyType(memory), rss=rss, kind=kind, cmdline=cmdline,
                container=container, pod_uid=pod_uid, namespace=namespace, qos=qos,
                ns_pid=ns_pid, memory_not_available=not_avail))
    # A PID may be reused, but never by two processes alive at the same time.
    by_pid: dict[int, list[ProcessSpec]] = {}
    for spec in out:
        for other in by_pid.get(spec.pid, []):
            a_end = math.inf if other.stop is None else other.stop
            b_end = math.inf if spec.stop is None else spec.stop
            if spec.start < a_end and other.start < b_end:
                raise ScenarioError(f"{path}: pid {spec.pid} is used by two processes alive at the same time")
        by_pid.setdefault(spec.pid, []).append(spec)
    return tuple(out)


def _parse_stale(value: Any, path: str, gpus: tuple[GpuSpec, ...]) -> tuple[StaleSpec, ...]:
    out = []
    for i, item in enumerate(_list(value, path)):
        n = _Node(item, f"{path}[{i}]")
        key = n.get("gpu", lambda v, p: _gpu_key(v, p, gpus))
        size = int(n.get("bytes", _size_nonneg))
        at = n.get("at", parse_duration, 0.0)
        until = n.get("until", parse_duration, None)
        n.done()
        if until is not None and until <= at:
            raise ScenarioError(f"{path}[{i}].until: must be after 'at'")
        out.append(StaleSpec(key, size, at, until))
    return tuple(out)


def _parse_vllm(value: Any, path: str, processes: tuple[ProcessSpec, ...]) -> tuple[VllmSpec, ...]:
    out = []
    pids = {p.pid for p in processes}
    lifetimes = {}  # pid -> [(start, stop)] of every process that ever had it
    for proc in processes:
        lifetimes.setdefault(proc.pid, []).append((proc.start, math.inf if proc.stop is None else proc.stop))
    ports: dict[int, list[tuple[float, float]]] = {}
    for i, item in enumerate(_list(value, path)):
        p = f"{path}[{i}]"
        n = _Node(item, p)
        port = n.get("port", _int)
        if not 1 <= port <= 65535:
            raise ScenarioError(f"{n.sub('port')}: must be between 1 and 65535")
        pid = n.get("pid", _int)
        if pid not in pids:
            raise ScenarioError(f"{n.sub('pid')}: no process with pid {pid}")
        # A restarted server may reuse its port, but two live servers cannot share one.
        for a0, a1 in lifetimes[pid]:
            if any(a0 < b1 and b0 < a1 for b0, b1 in ports.get(port, [])):
                raise ScenarioError(f"{n.sub('port')}: port {port} is used by two servers at the same time")
        ports.setdefault(port, []).extend(lifetimes[pid])
        seed = zlib.crc32(p.encode())
        num = lambda v, q: parse_curve(v, q, bytes_=False, seed_base=seed)  # noqa: E731
        counter = lambda v, q: parse_curve(v, q, bytes_=False, counter=True)  # noqa: E731
        model = n.get("model", _str)
        kv = n.get("kv_cache_usage", num, Curve.zero())
        running = n.get("running", num, Curve.zero())
        waiting = n.get("waiting", num, Curve.zero())
        preemptions = n.get("preemptions", counter, Curve.zero())
        queries = n.get("prefix_cache_queries", counter, Curve.zero())
        ratio = n.get("prefix_cache_hit_ratio", _nonneg, 0.0)
        if ratio > 1:
            raise ScenarioError(f"{n.sub('prefix_cache_hit_ratio')}: must be between 0 and 1")
        cn = _Node(n.get("cache_config", lambda v, q: v), n.sub("cache_config"))
        gmu = cn.get("gpu_memory_utilization", _positive)
        if gmu > 1:
            raise ScenarioError(f"{cn.sub('gpu_memory_utilization')}: must be at most 1")
        kv_bytes = cn.get("kv_cache_memory_bytes", _size_nonneg, None)
        cache = CacheConfigSpec(
            gpu_memory_utilization=gmu,
            num_gpu_blocks=cn.get("num_gpu_blocks", _int),
            block_size=cn.get("block_size", _int, 16),
            cache_dtype=cn.get("cache_dtype", _str, "auto"),
            enable_prefix_caching=cn.get("enable_prefix_caching", _bool, True),
            kv_cache_memory_bytes=None if kv_bytes is None else int(kv_bytes))
        cn.done()
        n.done()
        out.append(VllmSpec(i, port, pid, model, kv, running, waiting, preemptions, queries, ratio, cache))
    return tuple(out)


def _nvml_error_name(value: Any, path: str) -> str:
    """Accept 'FunctionNotFound', 'function_not_found' or 'NVMLError_FunctionNotFound'."""
    import pynvml  # the real error classes: the simulator raises exactly these

    name = _str(value, path)
    if name.startswith("NVMLError_"):
        name = name[len("NVMLError_"):]
    if "_" in name or name.islower():
        name = "".join(part.capitalize() for part in name.split("_"))
    if not isinstance(getattr(pynvml, "NVMLError_" + name, None), type):
        raise ScenarioError(f"{path}: unknown NVML error {value!r} (e.g. FunctionNotFound, NotSupported, "
                            "NoPermission, Timeout, GpuIsLost, Unknown)")
    return name


def _parse_faults(value: Any, path: str, gpus: tuple[GpuSpec, ...], n_servers: int) -> tuple[FaultSpec, ...]:
    out = []
    for i, item in enumerate(_list(value, path)):
        n = _Node(item, f"{path}[{i}]")
        call = n.get("call", _str, "")
        kind = n.get("kind", _str, "call_error" if call else "")
        if kind not in FAULT_KINDS:
            raise ScenarioError(f"{n.sub('kind')}: expected one of {', '.join(FAULT_KINDS)}, got {kind!r}")
        at = n.get("at", parse_duration, 0.0)
        until = n.get("until", parse_duration, None)
        if until is not None and until <= at:
            raise ScenarioError(f"{n.sub('until')}: must be after 'at'")
        gpu = n.get("gpu", _int, None)
        if gpu is not None and not 0 <= gpu < len(gpus):
            raise ScenarioError(f"{n.sub('gpu')}: no GPU {gpu} (the scenario has {len(gpus)})")
        fault = dict(kind=kind, at=at, until=until, gpu=gpu)
        if kind == "init_failure":
            err = n.get("error", _str)
            if err not in INIT_ERRORS:
                raise ScenarioError(f"{n.sub('error')}: expected one of {', '.join(INIT_ERRORS)}, got {err!r}")
            fault["error"] = err
        elif kind in ("gpu_lost", "reset_required"):
            if gpu is None:
                raise ScenarioError(f"{n.sub('gpu')}: required for {kind}")
        elif kind == "call_error":
            if not re.match(r"^nvml[A-Za-z0-9_]+$", call):
                raise ScenarioError(f"{n.sub('call')}: expected an NVML function name like nvmlDeviceGetMemoryInfo")
            fault["call"] = call
            fault["error"] = n.get("error", _nvml_error_name)
            version = n.get("version", _int, None)
            if version is not None and (call != "nvmlDeviceGetMemoryInfo" or version not in (1, 2)):
                raise ScenarioError(f"{n.sub('version')}: only nvmlDeviceGetMemoryInfo has versions (1 or 2)")
            fault["version"] = version
        else:  # vLLM faults
            server = n.get("server", _int, None)
            if server is not None and not 0 <= server < n_servers:
                raise ScenarioError(f"{n.sub('server')}: no vLLM server {server}")
            fault["server"] = server
            if kind == "vllm_http_error":
                status = n.get("status", _int, 500)
                if not 400 <= status <= 599:
                    raise ScenarioError(f"{n.sub('status')}: expected an HTTP error status (400-599)")
                fault["status"] = status
            if kind == "vllm_slow":
                delay = n.get("delay", _nonneg)
                if delay > 60:
                    raise ScenarioError(f"{n.sub('delay')}: at most 60 seconds")
                fault["delay"] = delay
        n.done()
        out.append(FaultSpec(**fault))
    return tuple(out)


def from_dict(data: Any, source: str = "<dict>") -> Scenario:
    """Validate a parsed scenario document and build the Scenario."""
    n = _Node(data, "")
    name = n.get("name", _str)
    description = n.get("description", _str, "")
    if "\n" in description:
        raise ScenarioError("description: must be one line")
    duration = n.get("duration", parse_duration)
    driver = n.get("driver_version", _str, "570.172.08")
    cuda = n.get("cuda_driver_version", _int, 12080)
    gpus = n.get("gpus", lambda v, p: _parse_gpus(v, p, name))
    host = n.get("host", _parse_host)
    processes = n.get("processes", lambda v, p: _parse_processes(v, p, gpus), ())
    stale = n.get("stale_memory", lambda v, p: _parse_stale(v, p, gpus), ())
    servers = n.get("vllm", lambda v, p: _parse_vllm(v, p, processes), ())
    faults = n.get("faults", lambda v, p: _parse_faults(v, p, gpus, len(servers)), ())
    n.done()
    return Scenario(name=name, description=description, duration=duration, gpus=gpus, host=host,
                    processes=processes, stale_memory=stale, vllm=servers, faults=faults,
                    driver_version=driver, cuda_driver_version=cuda, source=source)


def loads(text: str, source: str = "<string>") -> Scenario:
    if len(text) > MAX_SCENARIO_BYTES:
        raise ScenarioError(f"{source}: scenario larger than {MAX_SCENARIO_BYTES} bytes")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ScenarioError(f"{source}: not valid YAML: {e}") from None
    return from_dict(data, source)


def _builtin_path(name: str) -> Path | None:
    if re.match(r"^[a-z0-9][a-z0-9_-]*$", name):
        path = SCENARIO_DIR / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def load(name_or_path: str | Path) -> Scenario:
    """A built-in scenario by name (see `builtin()`) or a YAML file by path."""
    path = _builtin_path(str(name_or_path)) or Path(name_or_path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SCENARIO_BYTES + 1)
    except OSError as e:
        names = ", ".join(n for n, _ in builtin())
        raise ScenarioError(f"{name_or_path}: no such scenario file or built-in name "
                            f"({e.strerror}); built-in: {names}") from None
    if len(raw) > MAX_SCENARIO_BYTES:
        raise ScenarioError(f"{path}: scenario larger than {MAX_SCENARIO_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ScenarioError(f"{path}: not UTF-8 text") from None
    return loads(text, str(path))


def builtin() -> list[tuple[str, str]]:
    """(name, one-line description) of every built-in scenario, by name."""
    out = []
    for path in sorted(SCENARIO_DIR.glob("*.yaml")):
        try:
            text = path.read_text(encoding="utf-8")
            data = yaml.safe_load(text)
            desc = data.get("description", "") if isinstance(data, dict) else ""
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            desc = "(unreadable)"
        out.append((path.stem, str(desc)))
    return out
