"""The sources whose workings live in their own modules, fitted to the Source protocol:

  kubelet  pod names and namespaces for the pod UIDs the host source read from cgroups
           (kubelet.KubeletPods: a cached pod list, refreshed when old or missing a UID)
  vllm     each endpoint's /metrics (vllm.VllmSource), its start-up memory profile
           (vllm_log.ProfileCache), and which GPU processes serve it (vllm_procs.assign_roles)
  logs     out-of-memory events in the tailed server logs (logs.LogSource)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from ..model import GpuSample, Snapshot, VllmSample
from .hostview import HostView
from .source import Reading
from .vllm_procs import assign_roles

if TYPE_CHECKING:
    from .kubelet import KubeletPods, Pod
    from .logs import LogSource
    from .vllm import VllmSource
    from .vllm_log import ProfileCache


class PodLookup(Protocol):
    def lookup(self, pod_uid: str) -> Pod | None: ...


def pod_name(pods: PodLookup, pod_uid: str) -> tuple[str, str]:
    """(pod, namespace) for a pod UID; ('', '') outside a pod or while the kubelet does not
    know it. `pods` is a kubelet.KubeletPods (anything with lookup(uid) -> Pod | None)."""
    if not pod_uid:
        return "", ""
    try:
        pod = pods.lookup(pod_uid)
    except Exception:  # lookup promises not to raise; a broken one must still not stop sampling
        pod = None
    return ("", "") if pod is None else (pod.name, pod.namespace)


class PodNames:
    """The `kubelet` source: names the pod of every GPU process that runs in one."""

    name = "kubelet"

    def __init__(self, pods: KubeletPods):
        self.pods = pods

    def collect(self, snapshot: Snapshot) -> Reading:
        names: dict[str, tuple[str, str]] = {}
        gpus = []
        for gpu in snapshot.gpus:
            procs = []
            for p in gpu.processes:
                if p.pod_uid:
                    if p.pod_uid not in names:
                        names[p.pod_uid] = pod_name(self.pods, p.pod_uid)
                    pod, namespace = names[p.pod_uid]
                    p = dataclasses.replace(p, pod=pod, namespace=namespace)
                procs.append(p)
            gpus.append(dataclasses.replace(gpu, processes=tuple(procs)))
        # Up until a fetch fails: before the first pod process there is nothing to ask.
        return Reading(dataclasses.replace(snapshot, gpus=tuple(gpus)),
                       up=self.pods.up is not False, errors=self.pods.take_errors())

    def close(self) -> None:
        pass  # the pod list lives as long as the host (runtime.Host closes it)


class VllmServers:
    """The `vllm` source: scrapes every endpoint, attaches each server's memory profile and
    marks the GPU processes that serve it (role "vllm", its endpoint)."""

    name = "vllm"

    def __init__(self, scraper: VllmSource, host: HostView, profiles: ProfileCache | None = None):
        self.scraper = scraper  # vllm.VllmSource
        self.host = host
        self.profiles = profiles  # vllm_log.ProfileCache, or None
        self._roles: dict[tuple[int, float | None], tuple[str, str]] = {}  # process identity -> (role, endpoint)

    def collect(self, snapshot: Snapshot) -> Reading:
        samples: tuple[VllmSample, ...] = tuple(self.scraper.sample(
            candidates=[p.pid for g in snapshot.gpus for p in g.processes]))
        if self.profiles is not None:
            samples = tuple(self.profiles.attach(samples))
        gpus = self._sticky_roles(assign_roles(snapshot.gpus, samples, self.host))
        down = [s for s in samples if not s.up]
        return Reading(dataclasses.replace(snapshot, vllm=samples, gpus=gpus), up=not down,
                       error=down[0].error if down else "")

    def _sticky_roles(self, gpus: Iterable[GpuSample]) -> tuple[GpuSample, ...]:
        """A process serves its server for life. When a server shuts down, its listener goes
        first and its workers free their GPU memory a moment later: keep their role meanwhile,
        so the exit is seen as a serving process's exit."""
        roles: dict[tuple[int, float | None], tuple[str, str]] = {}
        out: list[GpuSample] = []
        for gpu in gpus:
            procs = []
            for p in gpu.processes:
                if p.role == "other" and p.start_time is not None and p.identity in self._roles:
                    role, endpoint = self._roles[p.identity]
                    p = dataclasses.replace(p, role=role, endpoint=endpoint)
                if p.role != "other" and p.start_time is not None:
                    roles[p.identity] = (p.role, p.endpoint)
                procs.append(p)
            out.append(dataclasses.replace(gpu, processes=tuple(procs)))
        self._roles = roles  # only processes alive now: bounded by the process table
        return tuple(out)

    def close(self) -> None:
        self.scraper.close()


class OomLogs:
    """The `logs` source: out-of-memory events found in this tick's new log lines, stamped
    with the tick's time."""

    name = "logs"

    def __init__(self, tailer: LogSource):
        self.tailer = tailer  # logs.LogSource

    def collect(self, snapshot: Snapshot) -> Reading:
        events, errors = self.tailer.sample(now=snapshot.timestamp)
        return Reading(dataclasses.replace(snapshot, log_events=tuple(events)), up=not errors,
                       errors=tuple(errors))

    def close(self) -> None:
        self.tailer.close()
