"""One configured vLLM server: where to scrape it, with what credentials, and how to find its
processes. Its own module because both the scraper (vllm.py) and the process look-up
(vllm_procs.py) need it, and neither should import the other for it."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from .httpclient import Secrets, public_url

DEFAULT_MAX_RESPONSE_BYTES = 8 * 1024 * 1024
# An idle server's page is read this often (vllm_idle.py): what its processes' CPU cannot show (a
# hung API server) is seen this late at most, well inside VllmEndpointDown's 10 minutes.
DEFAULT_IDLE_READ_SECONDS = 30.0


def metrics_url(url: str) -> str:
    """The page a server's URL reads: a bare http://host:port (or its /) reads /metrics."""
    parts = urlsplit(url)
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urlunsplit(parts)


@dataclass(frozen=True)
class VllmEndpoint:
    """One vLLM server to scrape, and how to find its processes."""

    url: str  # the /metrics URL; a bare http://host:port gets /metrics appended
    name: str = ""
    bearer_token: str | None = field(default=None, repr=False)  # never printed
    timeout_seconds: float = 2.0
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    pid_file: str | None = None
    container_id: str | None = None
    process_pattern: str | None = None  # regex searched in the process name (comm)
    log_file: str | None = None
    by_name: bool = True  # ask for the families read alone (vllm.only_read_url)
    idle_read_seconds: float = DEFAULT_IDLE_READ_SECONDS  # 0: every tick

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"vLLM endpoint {self.label!r}: URL must be http(s)://host[:port][/path]")
        try:
            _ = parts.port  # read only to validate: raises on a port out of range or not a number
        except ValueError:
            raise ValueError(f"vLLM endpoint {self.label!r}: invalid port") from None
        if not (isinstance(self.timeout_seconds, (int, float)) and math.isfinite(self.timeout_seconds)
                and self.timeout_seconds > 0):
            raise ValueError(f"vLLM endpoint {self.label!r}: timeout_seconds must be a positive number")
        if not isinstance(self.max_response_bytes, int) or self.max_response_bytes <= 0:
            raise ValueError(f"vLLM endpoint {self.label!r}: max_response_bytes must be a positive integer")
        if not (isinstance(self.idle_read_seconds, (int, float)) and math.isfinite(self.idle_read_seconds)
                and self.idle_read_seconds >= 0):
            raise ValueError(f"vLLM endpoint {self.label!r}: idle_read_seconds must be a number of seconds, 0 or more")
        if self.process_pattern is not None:
            try:
                re.compile(self.process_pattern)
            except re.error as exc:
                raise ValueError(f"vLLM endpoint {self.label!r}: bad process_pattern: {exc}") from None
        if self.container_id is not None and not self.container_id.strip():
            raise ValueError(f"vLLM endpoint {self.label!r}: container_id must not be empty")

    @property
    def label(self) -> str:
        """The `endpoint` label: the name, else the URL without credentials, query or fragment."""
        return self.name or public_url(self.url)

    @property
    def metrics_url(self) -> str:
        return metrics_url(self.url)

    @property
    def hostname(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    def secrets(self) -> Secrets:
        """What must never be printed or exported: the token and the URL's credentials."""
        parts = urlsplit(self.url)
        return Secrets((self.bearer_token, parts.password, parts.username))
