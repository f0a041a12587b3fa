"""The scenario document's schema: a parsed YAML mapping checked key by key into specs.

Top-level keys (sizes: 80GiB / bytes; times: seconds or "30m"; unknown keys are errors):

    name, description (one line), duration, driver_version?, cuda_driver_version?
    gpus:   [{name, memory, reserved?, unified?, count?, mig?: [{profile, memory}]}]
    host:   {memory, available?, psi_some?, psi_full?, oom_kills?, subtract_processes?}
    processes: [{pid, ppid?, name (as psutil names it, <= 64 chars: the kernel's 15-character
                 comm, or the title a process gave itself, e.g. VLLM::EngineCore), cmdline?,
                 gpu? (0 | "0/1" | [0, 1]),
                 start?, stop?, memory? (curve), memory_by_gpu? {gpu: curve}, rss?, kind?,
                 container? (64 hex), pod_uid?, qos?, namespace?, ns_pid?,
                 memory_not_available?, replicas? (copies with pids pid, pid+1, ...),
                 allocator? {non_torch (curve), cached?, inactive_split?, alloc_retries?
                             (counter), ooms? (counter), interval?, start?, alloc_conf?}}]
    stale_memory: [{gpu, bytes, at?, until?}]
    vllm:   [{port, pid (API server), model, kv_cache_usage?, running?, waiting?,
              preemptions? (cumulative), prefix_cache_queries? (cumulative),
              prefix_cache_hit_ratio?, sleep_level? (a curve: 0 awake, 1 weights_offloaded,
              2 discard_all, i.e. --enable-sleep-mode; absent: no sleep metrics),
              log? [{at, line}] (lines the server writes to its log at that moment, e.g. an
              out-of-memory error; read like a real server's log),
              cache_config: {gpu_memory_utilization, num_gpu_blocks,
              block_size?, cache_dtype?, enable_prefix_caching?, kv_cache_memory_bytes?}}]
    faults: [{kind: init_failure, error: library_not_found|driver_not_loaded|version_mismatch}
             {kind: gpu_lost|reset_required, gpu}
             {call: <GPU library function>, error: <its error>, version?, gpu?}: the names are the
              GPU library's, checked by its simulated stand-in (sim/fake_nvml: e.g.
              {call: nvmlDeviceGetMemoryInfo, version: 2, error: FunctionNotFound})
             {kind: vllm_http_error (status?) | vllm_slow (delay) | vllm_garbage, server?}
             each with at? (default 0) and until? (default: forever), active in [at, until)]

Curves (memory, rss, host and vLLM values) are written in the curve language of `curves`.

`allocator` puts the in-process probe (docs/probe.md) in a process: on each of its GPUs torch
reserved = memory - non_torch, allocated = reserved - cached, inactive_split <= cached (each
clamped to what is there), on process time; the simulated host writes the probe's files.
"""
from __future__ import annotations

import functools
import logging
import math
import re
import uuid as uuidlib
import zlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ...sources.hostview import MAX_NAME_CHARS
from .curves import Curve, constant, parse_curve
from .evaluate import Scenario
from .specs import (
    FAULT_KINDS,
    INIT_ERRORS,
    RENAMED_INIT_ERRORS,
    AllocatorSpec,
    CacheConfigSpec,
    FaultSpec,
    GpuSpec,
    HostSpec,
    MigSpec,
    ProcessSpec,
    StaleSpec,
    VllmSpec,
)
from .validate import (
    Node,
    ScenarioError,
    boolean,
    integer,
    listed,
    nonneg,
    parse_duration,
    positive,
    size_nonneg,
    string,
)

MAX_PROCESSES = 4096

log = logging.getLogger("exporter.sim.scenario")


def _gpu_uuid(scenario: str, *parts: object) -> str:
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, "gpumem-sim:" + "/".join(map(str, (scenario,) + parts))))


def _parse_gpus(value: Any, path: str, scenario: str) -> tuple[GpuSpec, ...]:
    out: list[GpuSpec] = []
    items = listed(value, path)
    if not items:
        raise ScenarioError(f"{path}: at least one GPU is needed")
    for i, item in enumerate(items):
        n = Node(item, f"{path}[{i}]")
        count = n.get("count", integer, 1)
        if count < 1 or count > 64:
            raise ScenarioError(f"{n.sub('count')}: must be between 1 and 64")
        name = n.get("name", string, "NVIDIA H100 80GB HBM3")
        memory = int(n.get("memory", size_nonneg))
        if memory <= 0:
            raise ScenarioError(f"{n.sub('memory')}: must be positive")
        reserved = int(n.get("reserved", size_nonneg, 0))
        if reserved >= memory:
            raise ScenarioError(f"{n.sub('reserved')}: must be less than memory")
        unified = n.get("unified", boolean, False)
        mig_items = n.get("mig", listed, [])
        if mig_items and unified:
            raise ScenarioError(f"{n.sub('mig')}: a unified-memory GPU has no MIG")
        n.done()
        for _ in range(count):
            index = len(out)
            migs = []
            for j, m in enumerate(mig_items):
                mn = Node(m, f"{path}[{i}].mig[{j}]")
                profile = mn.get("profile", string)
                mem = int(mn.get("memory", size_nonneg))
                mn.done()
                migs.append(MigSpec(j, profile, mem, gpu_instance_id=j + 1, compute_instance_id=0,
                                    uuid="MIG-" + _gpu_uuid(scenario, index, j)))
            if sum(m.memory_bytes for m in migs) > memory - reserved:
                raise ScenarioError(f"{path}[{i}].mig: instances add up to more than the GPU's memory")
            out.append(GpuSpec(index, name, "GPU-" + _gpu_uuid(scenario, index), memory, reserved,
                               unified, tuple(migs)))
    return tuple(out)


def _parse_host(value: Any, path: str) -> HostSpec:
    n = Node(value, path)
    total = int(n.get("memory", size_nonneg))
    spec = HostSpec(
        memory_bytes=total,
        available=n.get("available", lambda v, p: parse_curve(v, p, bytes_=True), Curve((constant(total * 0.8),))),
        psi_some=n.get("psi_some", lambda v, p: parse_curve(v, p, bytes_=False), Curve.zero()),
        psi_full=n.get("psi_full", lambda v, p: parse_curve(v, p, bytes_=False), None),
        oom_kills=n.get("oom_kills", lambda v, p: parse_curve(v, p, bytes_=False, counter=True), Curve.zero()),
        subtract_processes=n.get("subtract_processes", boolean, False),
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


PROBE_INTERVAL = (0.5, 300.0)  # the probe's own bounds for GPUMEM_PROBE_INTERVAL


def _parse_allocator(value: Any, path: str, seed: int) -> AllocatorSpec:
    n = Node(value, path)
    size = functools.partial(parse_curve, bytes_=True, seed_base=seed)
    counter = functools.partial(parse_curve, bytes_=False, counter=True)
    interval = n.get("interval", positive, 5.0)
    if not PROBE_INTERVAL[0] <= interval <= PROBE_INTERVAL[1]:
        raise ScenarioError(f"{n.sub('interval')}: must be between {PROBE_INTERVAL[0]:g} and "
                            f"{PROBE_INTERVAL[1]:g} seconds (the probe's bounds), got {interval:g}")
    alloc_conf = n.get("alloc_conf", string, "")
    if len(alloc_conf) > 512:
        raise ScenarioError(f"{n.sub('alloc_conf')}: at most 512 characters")
    spec = AllocatorSpec(
        non_torch=n.get("non_torch", size),
        cached=n.get("cached", size, Curve.zero()),
        inactive_split=n.get("inactive_split", size, Curve.zero()),
        alloc_retries=n.get("alloc_retries", counter, Curve.zero()),
        ooms=n.get("ooms", counter, Curve.zero()),
        interval=interval, start=n.get("start", parse_duration, 0.0), alloc_conf=alloc_conf)
    n.done()
    return spec


def _parse_processes(value: Any, path: str, gpus: tuple[GpuSpec, ...]) -> tuple[ProcessSpec, ...]:
    out: list[ProcessSpec] = []
    for i, item in enumerate(listed(value, path)):
        p = f"{path}[{i}]"
        n = Node(item, p)
        pid = n.get("pid", integer)
        replicas = n.get("replicas", integer, 1)
        if replicas < 1 or len(out) + replicas > MAX_PROCESSES:
            raise ScenarioError(f"{n.sub('replicas')}: must be between 1 and {MAX_PROCESSES} processes in all")
        if pid < 1 or pid + replicas - 1 > 4194304:
            raise ScenarioError(f"{n.sub('pid')}: must be between 1 and 4194304")
        ppid = n.get("ppid", integer, 1)
        name = n.get("name", string)
        if not name or len(name) > MAX_NAME_CHARS:
            raise ScenarioError(f"{n.sub('name')}: a process name has 1 to {MAX_NAME_CHARS} characters")
        raw_gpu = n.raw("gpu")
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
        kind = n.get("kind", string, "compute")
        if kind not in ("compute", "graphics"):
            raise ScenarioError(f"{n.sub('kind')}: expected compute or graphics, got {kind!r}")
        container = n.get("container", string, "")
        if container and not _HEX64.match(container):
            raise ScenarioError(f"{n.sub('container')}: expected a 64-character lowercase hex container id")
        pod_uid = n.get("pod_uid", string, "")
        if pod_uid and not _POD_UID.match(pod_uid):
            raise ScenarioError(f"{n.sub('pod_uid')}: expected a pod UID like 1b4e28ba-2fa1-11d2-883f-0016d3cca427")
        if pod_uid and not container:
            raise ScenarioError(f"{n.sub('pod_uid')}: a pod needs a container id too")
        qos = n.get("qos", string, "burstable")
        if qos not in ("burstable", "besteffort", "guaranteed"):
            raise ScenarioError(f"{n.sub('qos')}: expected burstable, besteffort or guaranteed")
        namespace = n.get("namespace", string, "")
        cmdline = n.get("cmdline", string, "")
        ns_pid = n.get("ns_pid", integer, None)
        not_avail = n.get("memory_not_available", boolean, False)
        raw_mem = n.raw("memory")
        raw_by_gpu = n.raw("memory_by_gpu")
        raw_rss = n.raw("rss", 0)
        raw_allocator = n.raw("allocator")
        n.done()
        if keys and raw_mem is None and raw_by_gpu is None:
            raise ScenarioError(f"{n.sub('memory')}: required for a process on a GPU")
        if not keys and (raw_mem is not None or raw_by_gpu is not None):
            raise ScenarioError(f"{n.sub('memory')}: the process has no 'gpu'")
        if not keys and raw_allocator is not None:
            raise ScenarioError(f"{n.sub('allocator')}: the process has no 'gpu' (a probe writes only "
                                "in a process that uses CUDA)")
        allocator = (None if raw_allocator is None else
                     _parse_allocator(raw_allocator, n.sub("allocator"), zlib.crc32(f"{p}/allocator".encode())))
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
                ns_pid=ns_pid, memory_not_available=not_avail, allocator=allocator))
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
    out: list[StaleSpec] = []
    for i, item in enumerate(listed(value, path)):
        n = Node(item, f"{path}[{i}]")
        key = n.get("gpu", lambda v, p: _gpu_key(v, p, gpus))
        size = int(n.get("bytes", size_nonneg))
        at = n.get("at", parse_duration, 0.0)
        until = n.get("until", parse_duration, None)
        n.done()
        if until is not None and until <= at:
            raise ScenarioError(f"{path}[{i}].until: must be after 'at'")
        out.append(StaleSpec(key, size, at, until))
    return tuple(out)


MAX_LOG_LINES = 1000
MAX_LOG_LINE_CHARS = 8192


def _parse_log_lines(value: Any, path: str) -> tuple[tuple[float, str], ...]:
    out = []
    items = listed(value, path)
    if len(items) > MAX_LOG_LINES:
        raise ScenarioError(f"{path}: at most {MAX_LOG_LINES} lines")
    for j, item in enumerate(items):
        n = Node(item, f"{path}[{j}]")
        at = n.get("at", parse_duration)
        line = n.get("line", string)
        n.done()
        if "\n" in line or "\r" in line or len(line) > MAX_LOG_LINE_CHARS:
            raise ScenarioError(f"{n.sub('line')}: one line of at most {MAX_LOG_LINE_CHARS} characters")
        out.append((at, line))
    return tuple(sorted(out, key=lambda x: x[0]))


def _parse_vllm(value: Any, path: str, processes: tuple[ProcessSpec, ...]) -> tuple[VllmSpec, ...]:
    out: list[VllmSpec] = []
    pids = {p.pid for p in processes}
    lifetimes: dict[int, list[tuple[float, float]]] = {}  # pid -> (start, stop) of each process that had it
    for proc in processes:
        lifetimes.setdefault(proc.pid, []).append((proc.start, math.inf if proc.stop is None else proc.stop))
    ports: dict[int, list[tuple[float, float]]] = {}
    for i, item in enumerate(listed(value, path)):
        p = f"{path}[{i}]"
        n = Node(item, p)
        port = n.get("port", integer)
        if not 1 <= port <= 65535:
            raise ScenarioError(f"{n.sub('port')}: must be between 1 and 65535")
        pid = n.get("pid", integer)
        if pid not in pids:
            raise ScenarioError(f"{n.sub('pid')}: no process with pid {pid}")
        # A restarted server may reuse its port, but two live servers cannot share one.
        for a0, a1 in lifetimes[pid]:
            if any(a0 < b1 and b0 < a1 for b0, b1 in ports.get(port, [])):
                raise ScenarioError(f"{n.sub('port')}: port {port} is used by two servers at the same time")
        ports.setdefault(port, []).extend(lifetimes[pid])
        num = functools.partial(parse_curve, bytes_=False, seed_base=zlib.crc32(p.encode()))
        counter = functools.partial(parse_curve, bytes_=False, counter=True)
        model = n.get("model", string)
        kv = n.get("kv_cache_usage", num, Curve.zero())
        running = n.get("running", num, Curve.zero())
        waiting = n.get("waiting", num, Curve.zero())
        preemptions = n.get("preemptions", counter, Curve.zero())
        queries = n.get("prefix_cache_queries", counter, Curve.zero())
        ratio = n.get("prefix_cache_hit_ratio", nonneg, 0.0)
        if ratio > 1:
            raise ScenarioError(f"{n.sub('prefix_cache_hit_ratio')}: must be between 0 and 1")
        sleep_level = n.get("sleep_level", num, None)
        log_lines = _parse_log_lines(n.raw("log", []), n.sub("log"))
        cn = Node(n.raw("cache_config", ...), n.sub("cache_config"))
        gmu = cn.get("gpu_memory_utilization", positive)
        if gmu > 1:
            raise ScenarioError(f"{cn.sub('gpu_memory_utilization')}: must be at most 1")
        kv_bytes = cn.get("kv_cache_memory_bytes", size_nonneg, None)
        cache = CacheConfigSpec(
            gpu_memory_utilization=gmu,
            num_gpu_blocks=cn.get("num_gpu_blocks", integer),
            block_size=cn.get("block_size", integer, 16),
            cache_dtype=cn.get("cache_dtype", string, "auto"),
            enable_prefix_caching=cn.get("enable_prefix_caching", boolean, True),
            kv_cache_memory_bytes=None if kv_bytes is None else int(kv_bytes))
        cn.done()
        n.done()
        out.append(VllmSpec(i, port, pid, model, kv, running, waiting, preemptions, queries, ratio, cache,
                            sleep_level, log_lines))
    return tuple(out)


def _identifier(value: Any, path: str) -> str:
    """A GPU library's function or error name: which names exist is its fake's to say."""
    name = string(value, path)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", name):
        raise ScenarioError(f"{path}: expected a name of the GPU library (letters, digits, _), got {value!r}")
    return name


def _parse_faults(value: Any, path: str, gpus: tuple[GpuSpec, ...], n_servers: int) -> tuple[FaultSpec, ...]:
    out: list[FaultSpec] = []
    for i, item in enumerate(listed(value, path)):
        n = Node(item, f"{path}[{i}]")
        call = n.get("call", string, "")
        kind = n.get("kind", string, "call_error" if call else "")
        if kind not in FAULT_KINDS:
            raise ScenarioError(f"{n.sub('kind')}: expected one of {', '.join(FAULT_KINDS)}, got {kind!r}")
        at = n.get("at", parse_duration, 0.0)
        until = n.get("until", parse_duration, None)
        if until is not None and until <= at:
            raise ScenarioError(f"{n.sub('until')}: must be after 'at'")
        gpu = n.get("gpu", integer, None)
        if gpu is not None and not 0 <= gpu < len(gpus):
            raise ScenarioError(f"{n.sub('gpu')}: no GPU {gpu} (the scenario has {len(gpus)})")
        fault: dict[str, Any] = {"kind": kind, "at": at, "until": until, "gpu": gpu}
        if kind == "init_failure":
            err = n.get("error", string)
            if err in RENAMED_INIT_ERRORS:
                log.warning("%s: %r is deprecated, say %r", n.sub("error"), err, RENAMED_INIT_ERRORS[err])
                err = RENAMED_INIT_ERRORS[err]
            if err not in INIT_ERRORS:
                raise ScenarioError(f"{n.sub('error')}: expected one of {', '.join(INIT_ERRORS)}, got {err!r}")
            fault["error"] = err
        elif kind in ("gpu_lost", "reset_required"):
            if gpu is None:
                raise ScenarioError(f"{n.sub('gpu')}: required for {kind}")
        elif kind == "call_error":
            fault["call"] = _identifier(call, n.sub("call"))
            fault["error"] = n.get("error", _identifier)
            fault["version"] = n.get("version", integer, None)
        else:  # vLLM faults
            server = n.get("server", integer, None)
            if server is not None and not 0 <= server < n_servers:
                raise ScenarioError(f"{n.sub('server')}: no vLLM server {server}")
            fault["server"] = server
            if kind == "vllm_http_error":
                status = n.get("status", integer, 500)
                if not 400 <= status <= 599:
                    raise ScenarioError(f"{n.sub('status')}: expected an HTTP error status (400-599)")
                fault["status"] = status
            if kind == "vllm_slow":
                delay = n.get("delay", nonneg)
                if delay > 60:
                    raise ScenarioError(f"{n.sub('delay')}: at most 60 seconds")
                fault["delay"] = delay
        n.done()
        out.append(FaultSpec(**fault))
    return tuple(out)


def from_dict(data: Any, source: str = "<dict>") -> Scenario:
    """Validate a parsed scenario document and build the Scenario."""
    n = Node(data, "")
    name = n.get("name", string)
    description = n.get("description", string, "")
    if "\n" in description:
        raise ScenarioError("description: must be one line")
    duration = n.get("duration", parse_duration)
    driver = n.get("driver_version", string, "570.172.08")
    cuda = n.get("cuda_driver_version", integer, 12080)
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
