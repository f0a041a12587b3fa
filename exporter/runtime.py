"""Wires sources to a host: the real one (the GPU vendor's library + /proc), or a simulated
scenario.

This is the only place that knows whether the host is simulated; everything downstream gets
the same GPU library shape (the vendor's module or the simulator's stand-in, sim/fake_<backend>),
the same HostView and plain vLLM endpoint URLs.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .clock import Clock, FixedClock, SystemClock, VirtualClock
from .config import Config, ConfigError, EndpointConfig, read_secret_file
from .daemon import Sampler
from .sources.gpu import GpuBackend, backend
from .sources.hostview import HostView
from .sources.source import Source

if TYPE_CHECKING:  # imported where used: only some hosts need them
    from .sim.logs import SimulatedLogs
    from .sim.probes import SimulatedProbes
    from .sources.kubelet import KubeletPods
    from .sources.vllm import VllmEndpoint

log = logging.getLogger("exporter.runtime")


@dataclass
class Host:
    """What lives as long as the process: the GPU library (its backend and module), the
    HostView, the clock, the kubelet's pod list in Kubernetes, and when simulated the scenario's
    fake vLLM servers (with their start-up logs) and its processes' allocator probes (with their
    directory)."""

    gpu: GpuBackend
    gpu_library: object  # the vendor's module (pynvml), or the simulator's drop-in (sim/fake_nvml)
    view: HostView
    clock: Clock
    pods: KubeletPods | None = None  # None outside Kubernetes
    scenario: Played | None = None  # when simulated: the scenario it plays
    sim_endpoints: tuple[VllmEndpoint, ...] = ()  # one per simulated vLLM server
    sim_probes: SimulatedProbes | None = None  # when a simulated process has the allocator probe
    sim_logs: SimulatedLogs | None = None  # when a simulated server writes lines to its log as it runs
    _cleanup: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def simulated(self) -> bool:
        return self.scenario is not None

    def sampled(self) -> str:
        """How the host is sampled, for the status page: "real", or the scenario and where its
        clock stands, so whoever watches a scenario play knows which part of its story is on."""
        if self.scenario is None:
            return "real"
        played = max(0.0, self.clock.now() - self.scenario.start)
        where = f"simulated: scenario {self.scenario.name}, at {_hours_minutes(played)}"
        if played > self.scenario.duration:  # its curves go on, but what they tell is over
            return f"{where}, past the end of its story ({_hours_minutes(self.scenario.duration)})"
        return f"{where} of {_hours_minutes(self.scenario.duration)}"

    def close(self) -> None:
        self._cleanup.close()


@dataclass(frozen=True)
class Played:
    name: str
    start: float  # the clock's time at the scenario's 0 s
    duration: float


def _hours_minutes(seconds: float) -> str:
    minutes = int(seconds // 60)
    return f"{minutes // 60}h{minutes % 60:02d}m"


@dataclass
class Runtime:
    """A Host and the sampler built over it from one configuration. A reload (SIGHUP) builds
    a new sampler over the same host: the simulated clock and GPU library carry on."""

    host: Host
    sampler: Sampler

    @property
    def clock(self) -> Clock:
        return self.host.clock

    def close(self) -> None:
        self.sampler.close()
        self.host.close()


def _endpoint(ep: EndpointConfig, where: str) -> VllmEndpoint:
    from .sources.vllm import VllmEndpoint

    token = read_secret_file(ep.bearer_token_file, f"{where}.bearer_token_file") if ep.bearer_token_file else None
    return VllmEndpoint(url=ep.url, name=ep.name, bearer_token=token, timeout_seconds=ep.timeout_seconds,
                        max_response_bytes=ep.max_response_bytes, pid_file=ep.pid_file or None,
                        container_id=ep.container_id or None, process_pattern=ep.process_pattern or None,
                        log_file=ep.log_file or None, by_name=ep.by_name,
                        idle_read_seconds=ep.idle_read_seconds)


def kubelet_pods(config: Config, env: Mapping[str, str] | None = None) -> KubeletPods | None:
    """The kubelet pod lookup, or None where pod names cannot or should not be had: outside
    Kubernetes (enabled: auto), or with no node address to reach the kubelet at."""
    from .sources import kubelet

    k = config.kubelet
    if k.enabled == "false" or (k.enabled == "auto" and not kubelet.in_kubernetes(k.token_file or
                                                                                   kubelet.DEFAULT_TOKEN_FILE, env)):
        return None
    url = k.url or kubelet.default_url(env)
    if not url:
        log.warning("kubelet: no url configured and neither NODE_IP nor NODE_NAME is set; "
                    "processes get no pod names")
        return None
    # Never send the token in clear text (the read-only port 10255 needs none anyway).
    token_file = k.token_file if url.startswith("https://") else None
    log.info("kubelet: pod names from %s", url)
    return kubelet.KubeletPods(url, token_file=token_file or None, ca_file=k.ca_file or None,
                               insecure_skip_verify=k.insecure_skip_verify,
                               timeout_seconds=k.timeout_seconds, max_response_bytes=k.max_response_bytes,
                               refresh_seconds=k.refresh_seconds,
                               unknown_refresh_seconds=k.unknown_pod_refresh_seconds)


def open_host(config: Config, simulate: str | None = None, speed: float = 1.0,
              at: float | None = None) -> Host:
    """`simulate`: a scenario name or file. `at`: freeze the simulated clock at that scenario
    time (for `snapshot`). Raises ScenarioError on a bad scenario, ConfigError where the GPU
    backend's library cannot be imported."""
    stack = contextlib.ExitStack()
    gpu = backend(config.gpu.backend)
    if not simulate:
        import psutil

        from .sources.host import LocalHost

        try:
            library = importlib.import_module(gpu.library) if gpu.library else None
        except (ImportError, OSError) as exc:
            raise ConfigError(f"gpu.backend: {gpu.name} needs the Python module {gpu.library!r}, which cannot "
                              f"be imported here: {exc}") from None
        # psutil reads /proc through this one process-wide setting (its documented way to read
        # a /proc mounted elsewhere); set once here, before anything reads /proc.
        psutil.PROCFS_PATH = config.host.proc_root
        pods = kubelet_pods(config)
        if pods is not None:
            stack.callback(pods.close)
        return Host(gpu, library, LocalHost(), SystemClock(), pods=pods, _cleanup=stack)

    import tempfile
    import time

    from .sim.fake_vllm import FakeVllmServer
    from .sim.host import SimulatedHost
    from .sim.scenario import load as load_scenario
    from .sources.vllm import VllmEndpoint

    scenario = load_scenario(simulate)
    when = f"frozen at {at:g} s" if at is not None else f"{speed:g}x real time"
    log.info("SIMULATED host, scenario %r: %s (%s; no real GPU or process is read)",
             scenario.name, scenario.description, when)
    # Start simulated time on a whole minute: history buckets align the same way every run,
    # so a replayed scenario gives the same findings at the same moments.
    start = float(int(time.time()) // 60 * 60)
    clock = FixedClock(start, at) if at is not None else VirtualClock(start, speed=speed)
    # Each backend's simulated library is sim/fake_<name>.py, driven by the same scenario.
    fake = importlib.import_module(f"{__package__}.sim.fake_{gpu.name}") if gpu.library else None
    if fake is not None:
        fake.configure(scenario, clock)
        stack.callback(fake.configure, None, None)
    view = SimulatedHost(scenario, clock)
    logs = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpumem-sim-"))
    endpoints = []
    # Frozen in time (a replay, `snapshot --at`), nothing but the machine's load delays the
    # in-process servers' answers: waited for as long as a hang would take, so a loaded
    # machine's pause never reads as a server down.
    timeout = 60.0 if at is not None else VllmEndpoint.timeout_seconds
    # One endpoint per port: servers the scenario starts on the same port one after the other
    # are one server restarted, with one log that grows with each start.
    first_on_port: dict[int, int] = {}
    for i, spec in enumerate(scenario.vllm):
        first_on_port.setdefault(spec.port, i)
    log_on_port: dict[int, str] = {}
    for n, i in enumerate(first_on_port.values()):
        log_file = f"{logs}/vllm-{n}.log"  # what a real server logs at start-up about its memory
        server = stack.enter_context(FakeVllmServer(scenario, clock, server_index=i, log_file=log_file))
        view.alias_port(server.port, scenario.vllm[i].port)
        endpoints.append(VllmEndpoint(url=server.url, name=f"sim-{n}", log_file=log_file,
                                      timeout_seconds=timeout))
        log_on_port[scenario.vllm[i].port] = log_file
    # The lines servers write while they run go to their port's log, as a restart's would.
    logged = {i: log_on_port[spec.port] for i, spec in enumerate(scenario.vllm) if spec.log_lines}
    probes = None
    if any(p.allocator is not None for p in scenario.processes):
        from .sim.probes import SimulatedProbes

        # The probes' shared directory, private to this run (config's allocator.probe_dir is
        # a real host's and is not read while simulating).
        probes = SimulatedProbes(scenario, clock, stack.enter_context(
            tempfile.TemporaryDirectory(prefix="gpumem-sim-probe-")))
    sim_logs = None
    if logged:
        from .sim.logs import SimulatedLogs

        sim_logs = SimulatedLogs(scenario, clock, logged)
    return Host(gpu, fake, view, clock, scenario=Played(scenario.name, start, scenario.duration),
                sim_endpoints=tuple(endpoints), sim_probes=probes,
                sim_logs=sim_logs, _cleanup=stack)


def make_sampler(config: Config, host: Host, one_shot: bool = False) -> Sampler:
    """The configuration-dependent part: endpoints, log files, what to read. `one_shot`: for a
    single sample (`snapshot`), where failures are not retried. The sampler orders the sources
    by what each needs (sources/source.py). Raises ConfigError."""
    from .sources.host import HostSource

    endpoints = [_endpoint(ep, f"vllm.endpoints[{i}]") for i, ep in enumerate(config.vllm.endpoints)]
    endpoints += host.sim_endpoints
    sources: list[Source] = [
        host.gpu.source(host.gpu_library, host.view.memory, now=host.clock.now,
                        retry_initial_seconds=config.gpu.retry_initial_seconds,
                        retry_max_seconds=config.gpu.retry_max_seconds,
                        label=f"simulated {host.gpu.title}" if host.simulated else host.gpu.title,
                        retry=not one_shot),
        HostSource(host.view, read_cmdline=config.host.read_cmdline),
    ]
    allocator = _allocator_source(config, host)
    if allocator is not None:
        sources.append(allocator)
    if host.pods is not None:
        from .sources.kubelet import KubeletSource
        sources.append(KubeletSource(host.pods))
    if endpoints:
        from .sources.vllm import VllmSource
        sources.append(VllmSource(endpoints, host=host.view))
    log_files = list(config.logs.files) + [ep.log_file for ep in config.vllm.endpoints if ep.log_file]
    if host.sim_logs is not None:  # the simulated servers that write to their logs as they run
        log_files += list(host.sim_logs.files.values())
    if log_files:
        from .sources.logs import LogSource
        logs: Source = LogSource(log_files)
        if host.sim_logs is not None:
            from .sim.logs import LoggedSource
            logs = LoggedSource(host.sim_logs, logs)
        sources.append(logs)
    return Sampler(sources, now=host.clock.now)


def _allocator_source(config: Config, host: Host) -> Source | None:
    """The `allocator` source: the configured probe directory on a real host; when simulated,
    the scenario's own probes' directory (if any process has one)."""
    from .sources.allocator import AllocatorSource

    if host.simulated:
        if config.allocator.probe_dir:
            log.info("allocator: allocator.probe_dir is not read while simulating")
        if host.sim_probes is None:
            return None
        from .sim.probes import ProbedSource

        # No real PID namespace or owner to compare: the simulated files say 0 (unreadable), and
        # a simulated pid may be some real process's.
        return ProbedSource(host.sim_probes, AllocatorSource(host.sim_probes.directory,
                                                             pid_namespace=lambda pid: None,
                                                             process_owner=lambda pid: None))
    if not config.allocator.probe_dir:
        return None
    return AllocatorSource(config.allocator.probe_dir, proc_root=config.host.proc_root)


def build(config: Config, simulate: str | None = None, speed: float = 1.0,
          at: float | None = None, one_shot: bool = False) -> Runtime:
    """A host and a sampler over it (snapshot, tests, benchmarks)."""
    host = open_host(config, simulate, speed, at)
    try:
        return Runtime(host, make_sampler(config, host, one_shot))
    except BaseException:
        host.close()
        raise
