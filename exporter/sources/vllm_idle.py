"""Which vLLM pages need reading this tick: an idle server's page is read less often.

A server with nothing running or waiting says the same on its page until a request comes, and a
request costs its processes CPU at once: the API server parses and tokenises it, the engine
schedules it, the workers compute. On vLLM 0.32's CPU backend one 16-token request cost its
processes 1.2 s of CPU, against 60-80 ms per 5 s at rest. Reading the page is most of what a
server costs the exporter (#18: about 1.5 ms of CPU per page and tick), so an idle server's page is
read again only when:
- its processes used more CPU over the last tick than at their resting rate (the lowest of the last
  RESTING_TICKS ticks' rates, which learns a worker that polls) plus BUSY_MARGIN of one core, and
  at least CPU_RESOLUTION more;
- its processes changed (a restart, a worker gone), or their CPU time cannot be read: a server
  whose processes are alive and at rest has the listener it had, so an idle page costs no look-up
  of the listener either;
- `idle_read_seconds` have passed since the page was read: what the CPU cannot show (a hung API
  server, a /sleep call costing less than the margin) is seen that late at most.
A page that showed work, failed, or held values the exporter dropped is read again every tick, as
is every page of a server whose processes are unknown (a remote one) and every page where
`idle_read_seconds` is 0.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from ..model import GpuSample, VllmSample
from .hostview import HostView
from .vllm_endpoint import VllmEndpoint

BUSY_MARGIN = 0.02  # of one core above the resting rate: a request costs far more, the idle jitter far less
CPU_RESOLUTION = 0.03  # seconds: below this the kernel's 10 ms clock ticks cannot tell work from rest
RESTING_TICKS = 12  # a minute at the default interval


@dataclass
class _Server:
    page: VllmSample | None = None  # the last page read, as read; None: read the next one
    read_at: float = 0.0  # the tick it was read in (snapshot time)
    processes: tuple[int, ...] = ()  # the server's processes at the last tick
    cpu_seconds: float | None = None  # theirs, summed, at cpu_at
    cpu_at: float = 0.0
    rates: deque[float] = field(default_factory=lambda: deque(maxlen=RESTING_TICKS))


def at_rest(page: VllmSample) -> bool:
    """Nothing running and nothing waiting on any engine, as far as the page says."""
    return bool(page.engines) and all(e.requests_running == 0 and e.requests_waiting == 0 for e in page.engines)


class IdleReads:
    def __init__(self, host: HostView | None):
        self._host = host
        self._servers: dict[str, _Server] = {}  # by endpoint label: bounded by the configuration

    def due(self, endpoint: VllmEndpoint, now: float) -> bool:
        """Whether the endpoint's page must be read in the tick at `now`."""
        server = self._servers.get(endpoint.label)
        if server is None or self._host is None or endpoint.idle_read_seconds <= 0:
            return True
        busy = self._busy(server, now)  # measured every tick, so that each rate spans one tick
        page = server.page
        return (busy or page is None or not at_rest(page) or not page.pids
                or not 0 <= now - server.read_at < endpoint.idle_read_seconds)

    def last_page(self, endpoint: VllmEndpoint, now: float) -> VllmSample:
        """The page read last (due() said False, so there is one), and how old it is; its server's
        roots are those found when it was read."""
        server = self._servers[endpoint.label]
        assert server.page is not None
        return replace(server.page, page_age_seconds=now - server.read_at)

    def read(self, endpoint: VllmEndpoint, page: VllmSample, now: float) -> None:
        """The page read this tick. Only a clean one is shown again: a failure, a page cut short or
        holding dropped values is news each time."""
        server = self._servers.setdefault(endpoint.label, _Server())
        clean = page.up and not page.rejected_metrics and not page.truncated
        server.page, server.read_at = (page, now) if clean else (None, now)

    def tick_done(self, samples: Iterable[VllmSample], gpus: Sequence[GpuSample]) -> None:
        """Each server's processes as this tick found them (its roots, the GPU processes it owns,
        its own processes on the host), whose CPU the next tick reads."""
        on_gpu: dict[str, list[int]] = {}
        for gpu in gpus:
            for process in gpu.processes:
                if process.role == "vllm":
                    on_gpu.setdefault(process.endpoint, []).append(process.pid)
        for sample in samples:
            server = self._servers.get(sample.endpoint)
            if server is None:
                continue
            processes = tuple(sorted({*sample.pids, *on_gpu.get(sample.endpoint, ()),
                                      *(p.pid for p in sample.processes)}))
            if processes != server.processes:
                server.processes, server.cpu_seconds = processes, None

    def _busy(self, server: _Server, now: float) -> bool:
        """True when the processes worked over the last tick, or when that cannot be told."""
        if not server.processes or self._host is None:
            return True
        try:
            cpu = self._host.cpu_seconds(server.processes)
        except Exception:  # a view that cannot tell: read the page
            cpu = None
        before, since = server.cpu_seconds, server.cpu_at
        server.cpu_seconds, server.cpu_at = cpu, now
        if cpu is None or before is None or now <= since or cpu < before:
            return True  # a process gone or replaced, a clock that went back: nothing to compare
        elapsed, used = now - since, cpu - before
        resting = min(server.rates, default=None)
        server.rates.append(used / elapsed)
        return resting is None or used > resting * elapsed + max(BUSY_MARGIN * elapsed, CPU_RESOLUTION)
