"""Pod name and namespace for a pod UID, from the node's kubelet (`GET /pods`).

The cgroup path gives a process's pod UID (sources/cgroup.py); the kubelet's pod list of its own
node turns that into names. Its authenticated port (https://<node>:10250/pods) needs a service
account token allowed `get` on `nodes/proxy`; the read-only port (http://<node>:10255/pods),
where a cluster still enables it, needs nothing.

Why not the pod-resources gRPC socket (the one dcgm-exporter reads)? It tells which pod holds
which *device*, not which pod a *process* is in, and reading it needs grpcio, which is not a
dependency of this project. The pod UID in the cgroup path is exact for every process.

Cost and failure: the list is cached and fetched at most every `refresh_seconds`, and at most
every `unknown_refresh_seconds` when a UID is not in it (a pod started since the last fetch).
Every fetch has a deadline and a size bound; a failed fetch keeps the last good list (pod UIDs
are never reused, so an old entry is never wrong, at worst missing) and is recorded, never
raised. Outside Kubernetes (no token file, no node address) the lookup is simply absent.

`KubeletSource` is the `kubelet` source: it names the pod of every GPU process that runs in
one. The pod list (`KubeletPods`) lives as long as the host and outlasts a reload's sources.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import requests
import urllib3

from ..boundedio import read_head
from ..model import Snapshot, SourceError
from ..tlsfiles import ca_context
from .httpclient import HttpFailure, get, new_session
from .source import POD_NAMES, PROCESS_IDENTITY, Reading

log = logging.getLogger("exporter.sources.kubelet")

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_TOKEN_FILE = f"{SERVICE_ACCOUNT_DIR}/token"
DEFAULT_CA_FILE = f"{SERVICE_ACCOUNT_DIR}/ca.crt"
KUBELET_PORT = 10250
MAX_TOKEN_BYTES = 64 << 10
MAX_ERRORS_KEPT = 100  # errors waiting to be collected; more are counted as dropped
_RUNTIME_PREFIXES = ("containerd://", "cri-o://", "docker://", "crio://")


@dataclass(frozen=True)
class Pod:
    uid: str
    name: str
    namespace: str
    containers: Mapping[str, str]  # full container id (64 hex) -> container name


class KubeletError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def parse_pod_list(data: Any) -> dict[str, Pod]:
    """A kubelet `/pods` answer (a v1 PodList) -> {pod UID: Pod}. Items that are not the right
    shape are skipped: one odd pod must not hide the others."""
    if not isinstance(data, dict) or not isinstance(data.get("items"), list):
        raise KubeletError("parse", "not a PodList: no items list")
    pods: dict[str, Pod] = {}
    for item in data["items"]:
        meta = item.get("metadata") if isinstance(item, dict) else None
        if not isinstance(meta, dict):
            continue
        uid, name, namespace = meta.get("uid"), meta.get("name"), meta.get("namespace", "")
        if not (isinstance(uid, str) and uid and isinstance(name, str) and isinstance(namespace, str)):
            continue
        pods[uid.lower()] = Pod(uid=uid.lower(), name=name, namespace=namespace,
                                containers=_container_ids(item.get("status")))
    return pods


def _container_ids(status: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    if not isinstance(status, dict):
        return out
    for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
        statuses = status.get(key)
        if not isinstance(statuses, list):
            continue
        for cs in statuses:
            if not isinstance(cs, dict):
                continue
            cid, cname = cs.get("containerID"), cs.get("name")
            if isinstance(cid, str) and isinstance(cname, str):
                for prefix in _RUNTIME_PREFIXES:
                    if cid.startswith(prefix):
                        cid = cid[len(prefix):]
                        break
                out[cid.lower()] = cname
    return out


class KubeletPods:
    """Cached pod UID -> Pod lookups against one kubelet. `lookup` never raises."""

    def __init__(self, url: str, token_file: str | None = None, ca_file: str | None = None,
                 insecure_skip_verify: bool = False, timeout_seconds: float = 2.0,
                 max_response_bytes: int = 32 << 20, refresh_seconds: float = 60.0,
                 unknown_refresh_seconds: float = 10.0, now: Callable[[], float] = time.monotonic):
        self.url = url
        self.token_file = token_file
        self.timeout_seconds = timeout_seconds
        self.max_response_bytes = max_response_bytes
        self.refresh_seconds = refresh_seconds
        self.unknown_refresh_seconds = unknown_refresh_seconds
        self.now = now
        self.fetches = 0  # attempts, successful or not (tests and benchmarks read it)
        self.up: bool | None = None  # None until the first fetch
        self._pods: dict[str, Pod] = {}
        self._fetched_at = float("-inf")
        self._attempted_at = float("-inf")
        self._errors: list[SourceError] = []
        self._dropped_errors = 0
        self._lock = threading.Lock()
        self._ca_file = None if insecure_skip_verify else ca_file
        self._insecure = insecure_skip_verify
        self._session: requests.Session | None = None  # made at the first fetch: it reads the CA
        if insecure_skip_verify:
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)

    def lookup(self, pod_uid: str) -> Pod | None:
        """The pod with this UID, refreshing the cached list when it is old or lacks the UID."""
        if not pod_uid:
            return None
        uid = pod_uid.lower()
        with self._lock:  # one fetch at a time; concurrent callers share its result
            now = self.now()
            since_try = now - self._attempted_at
            stale = now - self._fetched_at >= self.refresh_seconds
            unknown = uid not in self._pods
            # Failed fetches are retried no faster than unknown UIDs trigger them.
            if (stale or unknown) and since_try >= self.unknown_refresh_seconds:
                self._refresh(now)
            return self._pods.get(uid)

    def container_name(self, pod: Pod, container_id: str) -> str:
        """The name of a container of `pod` from its (full or 12-character) id; '' if unknown."""
        cid = container_id.lower()
        if not cid:
            return ""
        if cid in pod.containers:
            return pod.containers[cid]
        return next((n for full, n in pod.containers.items() if full.startswith(cid)), "")

    def take_errors(self) -> tuple[SourceError, ...]:
        """Faults since the last call, for the daemon's error counters (source "kubelet")."""
        with self._lock:
            errors = tuple(self._errors)
            if self._dropped_errors:
                errors += (SourceError("kubelet", "errors_dropped", f"{self._dropped_errors} more"),)
            self._errors, self._dropped_errors = [], 0
            return errors

    def close(self) -> None:
        if self._session is not None:
            self._session.close()

    def _connect(self) -> requests.Session:
        """The session, with the CA read through the bounded reader (a FIFO or a huge file in its
        place is an error, never a hang: #21 L3). Made again after a TLS failure, so a rotated CA
        is read then."""
        if self._session is None:
            try:
                context = ca_context(self._ca_file) if self._ca_file and self.url.startswith("https:") else None
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise KubeletError("tls", f"cannot load CA certificates from {self._ca_file}: "
                                          f"{getattr(exc, 'strerror', None) or exc}") from None
            self._session = new_session(context)  # no proxy from the environment: it would see the token
            self._session.verify = not self._insecure
        return self._session

    # -- fetching ---------------------------------------------------------------------------
    def _refresh(self, now: float) -> None:
        self._attempted_at = now
        self.fetches += 1
        try:
            self._pods = parse_pod_list(self._fetch())
            self._fetched_at = now
            if self.up is not True:
                log.info("kubelet pod list from %s: %d pods", self.url, len(self._pods))
            self.up = True
        except KubeletError as exc:
            self._record(exc.kind, str(exc))
        except Exception as exc:  # never let an unforeseen fault stop sampling
            self._record("unexpected", f"{type(exc).__name__}: {exc}")

    def _record(self, kind: str, message: str) -> None:
        # Warn when it starts failing; repeats of a lasting fault only at debug level.
        log.log(logging.DEBUG if self.up is False else logging.WARNING,
                "kubelet pod list from %s failed (%s): %s; keeping %d cached pods",
                self.url, kind, message, len(self._pods))
        self.up = False
        if len(self._errors) < MAX_ERRORS_KEPT:
            self._errors.append(SourceError("kubelet", kind, message[:500]))
        else:
            self._dropped_errors += 1

    def _fetch(self) -> Any:
        headers = {"Accept": "application/json"}
        if self.token_file:
            headers["Authorization"] = f"Bearer {read_token(self.token_file)}"
        session = self._connect()
        request = session.prepare_request(requests.Request("GET", self.url, headers=headers))
        try:  # the kubelet never redirects /pods; one that does is not followed
            answer = get(session, request, timeout=self.timeout_seconds,
                         max_bytes=self.max_response_bytes, clock=self.now)
        except HttpFailure as exc:
            if exc.kind == "tls":
                session.close()
                self._session = None
            raise KubeletError(exc.kind, exc.message) from None
        if answer.status != 200:
            raise KubeletError("http_status", f"HTTP {answer.status}")
        try:
            return json.loads(answer.body)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise KubeletError("parse", f"not JSON: {_short(exc)}") from None


def read_token(path: str) -> str:
    """The service account token, read on every fetch (projected tokens rotate). Bounded; the
    token itself never appears in an error."""
    try:
        token = read_head(path, MAX_TOKEN_BYTES)[0].decode("ascii", errors="replace").strip()
    except OSError as exc:
        raise KubeletError("token_unreadable", f"cannot read token file {path}: {exc.strerror or exc}") from None
    if not token:
        raise KubeletError("token_unreadable", f"token file {path} is empty")
    return token


def _short(exc: Exception) -> str:
    return str(exc)[:300]


def default_url(env: Mapping[str, str] | None = None) -> str:
    """https://<node>:10250/pods, the node's address from the downward API (NODE_IP, else
    NODE_NAME); '' when neither is set (not in a pod, or the manifest does not pass them)."""
    env = os.environ if env is None else env
    host = env.get("NODE_IP") or env.get("NODE_NAME") or ""
    if not host:
        return ""
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"https://{host}:{KUBELET_PORT}/pods"


def in_kubernetes(token_file: str = DEFAULT_TOKEN_FILE, env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return bool(env.get("KUBERNETES_SERVICE_HOST")) and os.path.isfile(token_file)


class PodLookup(Protocol):
    up: bool | None

    def lookup(self, pod_uid: str) -> Pod | None: ...

    def take_errors(self) -> tuple[SourceError, ...]: ...


def pod_name(pods: PodLookup, pod_uid: str) -> tuple[str, str]:
    """(pod, namespace) for a pod UID; ('', '') outside a pod or while the kubelet does not
    know it."""
    if not pod_uid:
        return "", ""
    try:
        pod = pods.lookup(pod_uid)
    except Exception:  # lookup promises not to raise; a broken one must still not stop sampling
        pod = None
    return ("", "") if pod is None else (pod.name, pod.namespace)


class KubeletSource:
    """The `kubelet` source: names the pod of every GPU process that runs in one, from the pod
    UID the host source read in its cgroup."""

    name = "kubelet"
    needs = (PROCESS_IDENTITY,)
    gives = (POD_NAMES,)

    def __init__(self, pods: PodLookup):
        self.pods = pods  # a KubeletPods, owned by the host: it outlives a reload's sources

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
