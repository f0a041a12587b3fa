"""The configuration file's schema: one section class per mapping of the file, with each key's
type, default and meaning, and (RESTART) whether a reload changes it or only a restart does.
`run`, `check-config`, SIGHUP reload and docs/configuration.md all read it from here.

Files the configuration names (the web config, bearer tokens, the kubelet's token and CA) are
checked here too, so a file that `check-config` accepts is one that `run` starts with.
"""
from __future__ import annotations

import os
import ssl
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from .. import thresholds, units
from ..analysis.registry import DETECTORS
from ..boundedio import read_head
from ..sources import gpu as gpu_backends
from ..sources.httpclient import public_url
from ..sources.vllm_endpoint import DEFAULT_IDLE_READ_SECONDS, metrics_url
from ..tlsfiles import ca_context
from .detectors import DetectorsConfig, detector_settings
from .fields import (
    DEFAULT_PORT,
    EMPTY,
    RESTART,
    ConfigError,
    Count,
    Doc,
    Listen,
    ListenOrOff,
    Path,
    PositiveSeconds,
    Ratio,
    Regex,
    Seconds,
    Section,
    Size,
    Text,
    fail,
    no_nul,
    parse_listen,
    show,
    url_check,
)
from .web import load_web_config

if TYPE_CHECKING:
    from ..analysis.engine import AnalysisConfig

MAX_TOKEN_BYTES = 64 << 10
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"

ResponseBytes = Annotated[Size, Field(ge=units.KiB, le=units.GiB)]
MetricsUrl = Annotated[str, Field(max_length=2048), AfterValidator(url_check("http(s)://host:port/metrics")),
                      Doc("URL")]
PodsUrl = Annotated[str, Field(max_length=2048), AfterValidator(url_check("http(s)://host:port/pods", optional=True)),
                    Doc("URL")]


def read_secret_file(path: str, where: str = "") -> str:
    """A token from a file: bounded, stripped, never echoed in errors. Raises ConfigError,
    whose message starts with `where`."""
    prefix = f"{where}: " if where else ""
    try:
        token = read_head(os.path.expanduser(path), MAX_TOKEN_BYTES)[0].decode("utf-8", errors="replace").strip()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{prefix}cannot read token file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not token:
        raise ConfigError(f"{prefix}token file {path} is empty")
    return token


def _token_problem(path: str) -> str | None:
    try:
        read_secret_file(path)
    except ConfigError as exc:
        return str(exc)
    return None


def _readable_token(path: str) -> str:
    problem = _token_problem(path) if path else None
    if problem:
        raise fail(problem)
    return path


def _ca_problem(path: str) -> str | None:
    try:
        ca_context(path)  # bounded: a FIFO or a huge file is refused, never waited on
    except (OSError, ssl.SSLError, ValueError) as exc:
        return f"cannot load CA certificates from {path}: {getattr(exc, 'strerror', None) or exc}"
    return None


def _web_config(path: str) -> str:
    if path:
        try:
            load_web_config(path)
        except ConfigError as exc:
            raise fail("\n  ".join(["invalid web config file:", *exc.problems])) from None
    return path


TokenFile = Annotated[Path, AfterValidator(_readable_token)]


def _existing_directory(path: str) -> str:
    if path and not os.path.isdir(os.path.expanduser(path)):
        raise fail(f"{path} is not a directory" if os.path.exists(os.path.expanduser(path))
                   else f"directory {path} does not exist")
    return path


ProbeDirectory = Annotated[str, Field(max_length=4096), AfterValidator(no_nul), AfterValidator(_existing_directory),
                           Doc("directory")]


class EndpointConfig(Section):
    """One vLLM server (`vllm.endpoints[]`); a bare URL string is the same as `{url: ...}`."""

    url: MetricsUrl = Field(
        description="The server's /metrics URL (a bare http://host:port gets /metrics).")
    name: Text = Field("", description=(
        "The `endpoint` label (default: the URL without credentials, query or fragment). Each page is listed once."))
    bearer_token_file: TokenFile = Field("", description=(
        "A file holding a token sent as `Authorization: Bearer`; read at start and on reload, never "
        "logged. HTTP_PROXY and ~/.netrc are not used: they would see it."))
    timeout_seconds: PositiveSeconds = Field(2.0, description="Total deadline per scrape, a slow drip included.")
    max_response_bytes: ResponseBytes = Field(8 << 20, description="A larger answer is refused.")
    by_name: bool = Field(True, description=(
        "Ask for only the families read, by name (`/metrics/?name[]=...`, where the URL ends in /metrics "
        "and has no query): vLLM then renders 4 KB, not its whole page (50 KB for one engine, more for "
        "each data-parallel engine), on its API server's event loop. Each scrape's line in the server's "
        "access log is then about 700 bytes, not 60. Where that page fails and the whole page answers, "
        "the whole page is read, and asked by name again an hour later."))
    idle_read_seconds: Seconds = Field(DEFAULT_IDLE_READ_SECONDS, description=(
        "While the server is idle (nothing running or waiting at its last read, and its processes using "
        "no more CPU than at rest), its page is read this often instead of every tick: a request costs "
        "its processes CPU at once, and the page is then read at the next tick. Works where the server's "
        "processes are found on this host; 0 reads the page every tick. `gpumem_vllm_page_age_seconds` "
        "says how old the page shown is."))
    pid_file: Path = Field("", description=(
        "Which GPU processes belong to this server. Default: the process listening on the URL's port "
        "and its descendants (V1's EngineCore and Worker_TP* children). This overrides it: a file "
        "holding the server's PID."))
    container_id: Text = Field("", description="... or the server's container ID.")
    process_pattern: Regex = Field("", description="... or a regex searched in the process name.")
    log_file: Path = Field("", description="The server's log: start-up memory profile and out-of-memory events.")

    @model_validator(mode="before")
    @classmethod
    def _bare_url(cls, data: Any) -> Any:
        return {"url": data} if isinstance(data, str) else data

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.container_id and not self.container_id.strip():
            yield "container_id", "must not be blank"


class HistoryConfig(Section):
    raw_seconds: PositiveSeconds = Field(3600.0, description=(
        "Full-resolution samples kept; the detectors and the flight recorder look back this far."))
    retention_seconds: PositiveSeconds = Field(6 * 3600.0, description="Downsampled history kept for trends.")

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.raw_seconds > self.retention_seconds:
            yield "raw_seconds", "must not exceed history.retention_seconds"


def _gpu_backend(name: str) -> str:
    known = [b.name for b in gpu_backends.BACKENDS]
    if name not in known:
        raise fail(f"expected one of {', '.join(known)}, got {show(name)}")
    return name


GpuBackendName = Annotated[str, Field(max_length=64), AfterValidator(_gpu_backend),
                           Doc("one of " + ", ".join(f"`{b.name}`" for b in gpu_backends.BACKENDS))]


class GpuConfig(Section):
    backend: Annotated[GpuBackendName, RESTART] = Field(gpu_backends.DEFAULT, description=(
        "The vendor library GPU memory is read through (each is a backend in sources/gpu.py)."))
    retry_initial_seconds: PositiveSeconds = Field(5.0, description=(
        "Back-off while the library or the driver is unavailable ..."))
    retry_max_seconds: PositiveSeconds = Field(300.0, description="... doubling up to this.")


class HostConfig(Section):
    proc_root: Path = Field("/proc", description="Where the host's /proc is (e.g. /host/proc in a container).")
    read_cmdline: bool = Field(False, description="Read process command lines; they can hold tokens, so opt in only.")


class LogsConfig(Section):
    files: Annotated[tuple[Path, ...], Field(strict=False, max_length=1000)] = Field(
        (), description="Server logs tailed for out-of-memory events.")


class VllmConfig(Section):
    endpoints: Annotated[tuple[EndpointConfig, ...], Field(strict=False, max_length=1000)] = Field(
        (), description="vLLM servers to scrape (keys below).")

    def problems(self) -> Iterator[tuple[str, str]]:
        # One page listed twice, whatever the names, would count its server's memory and counters
        # twice; two endpoints of one label would export every series twice, which Prometheus
        # refuses.
        pages: dict[tuple[str, ...], int] = {}
        first: dict[str, int] = {}
        for i, ep in enumerate(self.endpoints):
            page = _page(ep.url)
            if page in pages:
                other = self.endpoints[pages[page]].url
                what = ("the same URL" if ep.url == other else
                        "the URLs differ only in the fragment (after #), which is never sent"
                        if urlsplit(ep.url)._replace(fragment="") == urlsplit(other)._replace(fragment="")
                        else "the same scheme, host, port, path and query, as a scrape asks for them")
                yield f"endpoints.{i}", (f"reads the page endpoints[{pages[page]}] reads ({what}): list it once; "
                                         "twice, its server's memory and counters would count twice")
                continue
            pages[page] = i
            label = ep.name or public_url(ep.url)
            if label in first:
                yield f"endpoints.{i}", (f"its `endpoint` label {label!r} is endpoints[{first[label]}]'s too "
                                         + _why_one_label(self.endpoints[first[label]], ep))
            first.setdefault(label, i)


def _page(url: str) -> tuple[str, ...]:
    """The page a scrape of `url` reads: the fragment never leaves the client, a host name has
    no letter case, the scheme's port may be left out, and a URL without a path reads /metrics."""
    parts = urlsplit(metrics_url(url))
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower(), 0)
    except ValueError:  # refused with its own message by the URL's check
        port = 0
    return (parts.scheme.lower(), (parts.hostname or "").lower(), str(port), parts.path, parts.query,
            parts.username or "", parts.password or "")


def _why_one_label(a: EndpointConfig, b: EndpointConfig) -> str:
    """What two endpoints of one `endpoint` label (and two pages) have in common, and what to do."""
    if a.name and b.name:
        return "(both are named so): give each a distinct `name`"
    if a.name or b.name:
        return "(one's `name` is the other's URL): give each a distinct `name`"
    one, other = urlsplit(a.url), urlsplit(b.url)
    # The label is scheme://host[:port]/path: what else differs is what it leaves out.
    left_out = [part for part, differs in (
        ("user or password", (one.username, one.password) != (other.username, other.password)),
        ("query", one.query != other.query)) if differs]
    return f"(the URLs differ in their {' and '.join(left_out) or 'spelling'}, which the label leaves out): " \
        "give each a distinct `name`"


class AdmissionConfig(Section):
    close_above: Ratio = Field(thresholds.ADMISSION_CLOSE_ABOVE, description=(
        "/admission and gpumem_admission_open close above this utilisation ..."))
    open_below: Ratio = Field(thresholds.ADMISSION_OPEN_BELOW, description=(
        "... and reopen below this one. Memory vLLM reserves by design (gpu_memory_utilization) "
        "never closes it; see docs/metrics.md."))

    def problems(self) -> Iterator[tuple[str, str]]:
        if not self.open_below < self.close_above:
            yield "", ("need 0 < open_below < close_above <= 1 "
                       f"(got open_below={self.open_below:g}, close_above={self.close_above:g})")


class RecorderConfig(Section):
    """The flight recorder: off while `directory` is empty."""

    directory: Path = Field("", description=(
        "On an out-of-memory event, a newly critical finding or a vLLM process that disappeared, "
        "the last window of samples is written here as a trace. Off while empty."))
    window_seconds: PositiveSeconds = Field(3600.0, description=(
        "Samples each trace holds; at most history.raw_seconds."))
    tail_seconds: Seconds = Field(300.0, description=(
        "How long the recorder keeps recording after a trigger before it writes the trace."))
    max_files: Annotated[Count, Field(ge=1)] = Field(20, description="Oldest traces rotated out by count ...")
    max_total_bytes: Annotated[Size, Field(ge=units.MiB)] = Field(512 << 20, description="... and by total size.")
    debounce_seconds: Seconds = Field(300.0, description="At most one trace per trigger kind this often.")


class AllocatorHistoryConfig(Section):
    """Allocation history on demand (docs/probe.md): off unless `enabled`."""

    enabled: bool = Field(False, description=(
        "When a leak or fragmentation finding is first raised for a probed process, ask its probe "
        "(a control file in allocator.probe_dir, which must then be writable by the exporter) to "
        "record PyTorch's allocation history and dump it there for pytorch.org/memory_viz. "
        "Recording slows the serving process's allocations while it lasts: see docs/probe.md."))
    record_seconds: Annotated[PositiveSeconds, Field(le=600.0)] = Field(120.0, description=(
        "How long the probe records (the probe refuses more than 600)."))
    max_entries: Annotated[Count, Field(ge=1, le=1_000_000)] = Field(100_000, description=(
        "Allocation events kept, the newest (the probe refuses more than 1,000,000); bounds the "
        "dump's size and the memory recording takes."))
    min_interval_seconds: Annotated[Seconds, Field(ge=900.0)] = Field(3600.0, description=(
        "At most one request per process this often (the probe itself records at most once per "
        "15 minutes)."))


class AllocatorConfig(Section):
    """PyTorch's allocator numbers from the in-process probe (docs/probe.md): off while
    `probe_dir` is empty."""

    probe_dir: ProbeDirectory = Field("", description=(
        "The directory the vLLM processes' probes write to (their GPUMEM_PROBE_DIR, shared with "
        "the exporter, e.g. /run/gpumem-probe). Read once per sample; per-process torch "
        "allocated/reserved, non-torch and retry series come from it. Off while empty."))
    history: Annotated[AllocatorHistoryConfig, RESTART] = Field(default_factory=EMPTY, description=(
        "Allocation history on demand from the probes (opt-in)."))

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.history.enabled and not self.probe_dir:
            yield "history.enabled", "needs allocator.probe_dir"


def _enabled(value: Any) -> Any:
    return ("true" if value else "false") if isinstance(value, bool) else value  # YAML's true


class KubeletConfig(Section):
    """Pod and namespace labels for GPU processes, from the node's kubelet."""

    enabled: Annotated[Literal["auto", "true", "false"], BeforeValidator(_enabled)] = Field("auto", description=(
        "auto: on inside a Kubernetes pod (the service account token is present)."))
    url: PodsUrl = Field("", description=(
        "Default https://$NODE_IP:10250/pods (else $NODE_NAME); http://<node>:10255/pods for the "
        "read-only port (no token sent)."))
    token_file: Path = Field(f"{SERVICE_ACCOUNT}/token", description=(
        "Bearer token for the kubelet (needs RBAC get on nodes/proxy); empty: send none."))
    ca_file: Path = Field(f"{SERVICE_ACCOUNT}/ca.crt", description="CA that signed the kubelet's serving certificate.")
    insecure_skip_verify: bool = Field(False, description=(
        "Kubelet serving certificates are often self-signed: see deploy/kubernetes."))
    refresh_seconds: PositiveSeconds = Field(60.0, description="The pod list is fetched at most this often ...")
    unknown_pod_refresh_seconds: PositiveSeconds = Field(10.0, description=(
        "... or this often while a process's pod UID is not in it."))
    timeout_seconds: PositiveSeconds = Field(2.0, description="Total deadline per fetch.")
    max_response_bytes: ResponseBytes = Field(32 << 20, description="A larger pod list is refused.")

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.unknown_pod_refresh_seconds > self.refresh_seconds:
            yield "unknown_pod_refresh_seconds", "must not exceed kubelet.refresh_seconds"
        # The files matter where the kubelet is used: switched on, or (auto) where a service
        # account token is present. The token goes only over https, the CA only verifies it.
        used = self.enabled == "true" or (self.enabled == "auto" and os.path.isfile(self.token_file))
        if used and not self.url.startswith("http://"):
            token = _token_problem(self.token_file) if self.token_file else None
            ca = _ca_problem(self.ca_file) if self.ca_file and not self.insecure_skip_verify else None
            yield from [(key, problem) for key, problem in (("token_file", token), ("ca_file", ca)) if problem]


class Config(Section):
    """The whole file."""

    listen: Annotated[Listen, RESTART] = Field(f"0.0.0.0:{DEFAULT_PORT}", description=(
        "HOST:PORT to serve /metrics and the rest on."))
    health_listen: Annotated[ListenOrOff, RESTART] = Field("", description=(
        "A second HOST:PORT, without TLS or authentication, that serves only /healthz and "
        "/admission (for probes and load balancers when basic auth is on). Empty: off."))
    interval_seconds: PositiveSeconds = Field(5.0, description=(
        "Sampling interval (independent of the scrape interval)."))
    stale_after_seconds: Seconds = Field(0.0, description=(
        "/healthz turns 503 when no sample completed for this long; 0: three intervals, or two and the "
        "longest vllm.endpoints[].timeout_seconds where that is longer (a tick waits that long for a server "
        "found hung)."))
    web_config_file: Annotated[Path, AfterValidator(_web_config), RESTART] = Field("", description=(
        "TLS and basic auth, in Prometheus exporter-toolkit's web config format (see below)."))
    history: Annotated[HistoryConfig, RESTART] = Field(default_factory=EMPTY, description=(
        "The samples kept for the detectors."))
    gpu: GpuConfig = Field(default_factory=EMPTY, description=(
        "The GPU vendor's library. `nvml`, the section's old name, is still read (with a warning)."))
    host: Annotated[HostConfig, RESTART] = Field(default_factory=EMPTY, description="Processes and memory of the host.")
    logs: LogsConfig = Field(default_factory=EMPTY, description="Server logs.")
    admission: AdmissionConfig = Field(default_factory=EMPTY, description="The admission signal, with hysteresis.")
    recorder: Annotated[RecorderConfig, RESTART] = Field(default_factory=EMPTY, description="The flight recorder.")
    kubelet: Annotated[KubeletConfig, RESTART] = Field(default_factory=EMPTY, description=(
        "Pod names for processes (Kubernetes)."))
    vllm: VllmConfig = Field(default_factory=EMPTY, description="vLLM servers.")
    allocator: AllocatorConfig = Field(default_factory=EMPTY, description=(
        "PyTorch allocator numbers from the probe inside vLLM's processes (opt-in)."))
    detectors: DetectorsConfig = Field(default_factory=EMPTY, description=(
        "The detectors' settings, one section per detector (each declares its own). The thresholds "
        "the detectors share with the shipped alert rules are not here: see exporter/thresholds.py."))

    @property
    def effective_stale_after(self) -> float:
        # A tick waits for a vLLM server found hung for its whole timeout (once: sources/vllm.py):
        # a healthy exporter's sample may be that much later.
        slowest = max((e.timeout_seconds for e in self.vllm.endpoints), default=0.0)
        return self.stale_after_seconds or max(3 * self.interval_seconds, 2 * self.interval_seconds + slowest)

    def analysis(self) -> AnalysisConfig:
        """The detectors' settings that come from this file."""
        from ..analysis.engine import AnalysisConfig

        return AnalysisConfig(admission_close_above=self.admission.close_above,
                              admission_open_below=self.admission.open_below,
                              history_raw_seconds=self.history.raw_seconds,
                              history_retention_seconds=self.history.retention_seconds,
                              detectors=detector_settings(self.detectors),
                              gpu_tools=gpu_backends.backend(self.gpu.backend).tools)

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.health_listen:
            port = parse_listen(self.health_listen)[1]
            if port and port == parse_listen(self.listen)[1]:
                yield "health_listen", "must use another port than listen"
        r = self.recorder
        if r.directory and r.window_seconds > self.history.raw_seconds:
            yield "recorder.window_seconds", (f"must be at most history.raw_seconds ({self.history.raw_seconds:g}), "
                                              "the full-resolution history kept")
        # How much raw history each detector looks back, as it declares it (analysis.detector).
        raw, settings = self.history.raw_seconds, detector_settings(self.detectors)
        for spec in DETECTORS:
            for key, factor, seconds in spec.history_needs(settings[spec.name]):
                if seconds > raw:
                    times = f"{factor:g} x " if factor != 1 else ""
                    yield "history.raw_seconds", (f"is {raw:g}; must be at least {times}detectors.{spec.name}.{key}"
                                                  f" ({seconds:g}), the history that detector reads")
