"""The listener's web configuration file, in the shape of Prometheus exporter-toolkit's
(`tls_server_config`, `basic_auth_users` with bcrypt hashes), and the TLS context it gives."""
from __future__ import annotations

import re
import ssl
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError

from ..tlsfiles import load_ca, load_cert_chain
from .fields import EMPTY, ConfigError, Doc, Path, Section, fail, problems_of
from .yamlfile import YamlError, read_yaml

_TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                 "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
_CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "RequestClientCert": ssl.CERT_OPTIONAL,
                "RequireAnyClientCert": ssl.CERT_REQUIRED, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
                "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
ClientAuth = Literal["NoClientCert", "RequestClientCert", "RequireAnyClientCert", "VerifyClientCertIfGiven",
                     "RequireAndVerifyClientCert"]
TlsVersion = Literal["TLS10", "TLS11", "TLS12", "TLS13"]
_BCRYPT = re.compile(r"\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}")


def _bcrypt(value: str) -> str:
    if not _BCRYPT.fullmatch(value):
        raise fail("expected a bcrypt hash ($2y$...), never a plain password")
    return value


def _user(value: str) -> str:
    if not value or ":" in value:
        raise fail("a user name must be non-empty and without ':'")
    return value


BcryptHash = Annotated[str, AfterValidator(_bcrypt), Doc("bcrypt hash")]
User = Annotated[str, Field(max_length=256), AfterValidator(_user), Doc("user name")]


class TlsServerConfig(Section):
    cert_file: Path = Field("", description="The server certificate (PEM); TLS is on when set.")
    key_file: Path = Field("", description="Its private key (PEM).")
    client_auth_type: ClientAuth = Field("NoClientCert", description="Whether and how client certificates are checked.")
    client_ca_file: Path = Field("", description="CA for client certificates; needed when they are verified.")
    min_version: TlsVersion = Field("TLS12", description="Oldest TLS version accepted.")
    max_version: Literal["", "TLS10", "TLS11", "TLS12", "TLS13"] = Field("", description="Newest; empty: no limit.")

    def problems(self) -> Iterator[tuple[str, str]]:
        if _CLIENT_AUTH[self.client_auth_type] != ssl.CERT_NONE and not self.client_ca_file:
            yield "client_ca_file", f"needed for {self.client_auth_type}"
        if bool(self.cert_file) != bool(self.key_file):
            yield "", "cert_file and key_file go together"
        elif self.cert_file:
            try:
                _context(self)  # fail now, not at the first connection
            except ConfigError as exc:
                yield "", str(exc)


class WebConfig(Section):
    """The whole web config file."""

    tls_server_config: TlsServerConfig = Field(default_factory=EMPTY, description="TLS for the listener.")
    basic_auth_users: dict[User, BcryptHash] = Field({}, description=(
        "Users let in, each with a bcrypt hash of the password (`htpasswd -nBC 10 \"\" | tr -d ':\\n'`), "
        "never the password itself. With users set, every path needs them, /healthz and /admission "
        "included; `health_listen` serves those two without."))
    http_server_config: dict[str, Any] = Field(
        {}, description="Accepted for compatibility with exporter-toolkit files; not used.")

    @property
    def tls(self) -> bool:
        return bool(self.tls_server_config.cert_file)


def load_web_config(path: str) -> WebConfig:
    """Read and check a web config file. Raises ConfigError naming every problem."""
    duplicates: list[str] = []
    try:
        data = read_yaml(path, "web config", duplicates=duplicates)
    except YamlError as exc:
        raise ConfigError(str(exc)) from None
    problems = [f"{path}: {p}" for p in duplicates]
    try:
        config = WebConfig.model_validate({} if data is None else data)
    except ValidationError as exc:  # a hash or a password must not be echoed: no input shown
        raise ConfigError(problems + [f"{path}: {p}" for p in problems_of(exc, WebConfig, show_input=False)]) from None
    if problems:
        raise ConfigError(problems)
    return config


def ssl_context(cfg: WebConfig, where: str = "web config") -> ssl.SSLContext:
    try:
        return _context(cfg.tls_server_config)
    except ConfigError as exc:
        raise ConfigError(f"{where}: tls_server_config: {exc}") from None


def _context(tls: TlsServerConfig) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.options |= ssl.OP_NO_RENEGOTIATION  # a client's renegotiation is a handshake's cost again
    try:  # through the bounded reader: a FIFO or a huge file is refused, never waited on
        load_cert_chain(ctx, tls.cert_file, tls.key_file)
        if tls.client_ca_file:
            load_ca(ctx, tls.client_ca_file)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"cannot load certificate or key: {exc}") from None
    ctx.minimum_version = _TLS_VERSIONS[tls.min_version]
    if tls.max_version:
        ctx.maximum_version = _TLS_VERSIONS[tls.max_version]
    ctx.verify_mode = _CLIENT_AUTH[tls.client_auth_type]
    return ctx
