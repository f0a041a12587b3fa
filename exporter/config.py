"""Configuration: a YAML file, overridden by environment variables, overridden by flags.

Every problem is reported as a ConfigError whose message names the key path and what is wrong,
and unknown keys are rejected (a typo must not silently fall back to a default).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from .boundedio import read_head

MAX_CONFIG_BYTES = 1 << 20
DEFAULT_PORT = 9842

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10,
               "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    pass


def parse_size(value: Any, where: str) -> int:
    """An int of bytes, or a string like '8MiB'."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a size like 8MiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where}: must not be negative")
        return value
    m = _SIZE_RE.match(str(value)[:64])
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"{where}: expected a size like 8MiB or 1048576, got {str(value)[:64]!r}")
    size = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if not math.isfinite(size) or size > 1 << 62:
        raise ConfigError(f"{where}: {str(value)[:64]!r} is too large")
    return int(size)


def parse_listen(value: str, where: str = "listen") -> tuple[str, int]:
    """'HOST:PORT', ':PORT' or '[v6]:PORT'."""
    m = re.match(r"^(?:\[([^\]]+)\]|([^:\[\]]*)):(\d{1,5})$", str(value).strip())
    if not m or not 0 <= int(m.group(3)) <= 65535:
        raise ConfigError(f"{where}: expected HOST:PORT (e.g. 0.0.0.0:{DEFAULT_PORT}), got {value!r}")
    return (m.group(1) or m.group(2) or "0.0.0.0", int(m.group(3)))


@dataclass(frozen=True)
class EndpointConfig:
    url: str
    name: str = ""
    bearer_token_file: str = ""  # a file, so the token stays out of config dumps and ps
    timeout_seconds: float = 2.0
    max_response_bytes: int = 8 << 20
    pid_file: str = ""
    container_id: str = ""
    process_pattern: str = ""
    log_file: str = ""


@dataclass(frozen=True)
class AdmissionConfig:
    close_above: float = 0.90
    open_below: float = 0.80


@dataclass(frozen=True)
class RecorderConfig:
    """The flight recorder (exporter/recorder.py): off while `directory` is empty."""

    directory: str = ""
    window_seconds: float = 3600.0  # how much full-resolution history each file holds
    max_files: int = 20
    max_total_bytes: int = 512 << 20
    debounce_seconds: float = 300.0  # at most one file per trigger kind this often


@dataclass(frozen=True)
class KubeletConfig:
    """Pod names for processes, from the node's kubelet (exporter/sources/kubelet.py)."""

    enabled: str = "auto"  # auto: on inside a Kubernetes pod (service account token present)
    url: str = ""  # "": https://$NODE_IP (else $NODE_NAME):10250/pods
    token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"  # "": send none
    ca_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    insecure_skip_verify: bool = False
    refresh_seconds: float = 60.0
    unknown_pod_refresh_seconds: float = 10.0
    timeout_seconds: float = 2.0
    max_response_bytes: int = 32 << 20


@dataclass(frozen=True)
class Config:
    listen: str = f"0.0.0.0:{DEFAULT_PORT}"
    interval_seconds: float = 5.0
    web_config_file: str = ""
    stale_after_seconds: float = 0.0  # /healthz turns 503 past this; 0 = 3 intervals
    history_raw_seconds: float = 3600.0
    history_retention_seconds: float = 6 * 3600.0
    nvml_retry_initial_seconds: float = 5.0
    nvml_retry_max_seconds: float = 300.0
    proc_root: str = "/proc"
    read_cmdline: bool = False  # command lines can hold tokens: opt in only
    log_files: tuple[str, ...] = ()
    vllm_endpoints: tuple[EndpointConfig, ...] = ()
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    kubelet: KubeletConfig = field(default_factory=KubeletConfig)
    recorder: RecorderConfig = field(default_factory=RecorderConfig)

    @property
    def effective_stale_after(self) -> float:
        return self.stale_after_seconds or 3 * self.interval_seconds


# The YAML file's shape: nested sections map onto the flat fields above.
_FILE_LAYOUT: dict[str, Any] = {
    "listen": "listen",
    "interval_seconds": "interval_seconds",
    "web_config_file": "web_config_file",
    "stale_after_seconds": "stale_after_seconds",
    "history": {"raw_seconds": "history_raw_seconds", "retention_seconds": "history_retention_seconds"},
    "nvml": {"retry_initial_seconds": "nvml_retry_initial_seconds",
             "retry_max_seconds": "nvml_retry_max_seconds"},
    "host": {"proc_root": "proc_root", "read_cmdline": "read_cmdline"},
    "logs": {"files": "log_files"},
    "vllm": {"endpoints": "vllm_endpoints"},
    "admission": "admission",
    "kubelet": "kubelet",
    "recorder": "recorder",
}


def _unknown_key(key: str, known, where: str) -> ConfigError:
    close = difflib.get_close_matches(str(key), list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(sorted(known))})"
    return ConfigError(f"{where}{key}: unknown key{hint}")


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check one scalar against the field's declared type."""
    if typ in ("float", float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if typ in ("bool", bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if typ in ("int", int):
        return parse_size(value, where)
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def _build(cls, data: Any, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where.rstrip('.') or 'config'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(key, fields, where)
        values[key] = _coerce(value, fields[key].type, f"{where}{key}")
    try:
        return cls(**values)
    except TypeError as exc:  # a required field is missing
        missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in values]
        raise ConfigError(f"{where.rstrip('.')}: missing required key {missing[0] if missing else ''}") from exc


def _endpoints(items: Any, where: str) -> tuple[EndpointConfig, ...]:
    if not isinstance(items, list):
        raise ConfigError(f"{where}: expected a list of endpoints")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = {"url": item}
        out.append(_build(EndpointConfig, item, f"{where}[{i}]."))
    return tuple(out)


def _flatten(data: dict, layout: dict, where: str, out: dict) -> None:
    for key, value in data.items():
        if key not in layout:
            raise _unknown_key(key, layout, where)
        target = layout[key]
        path = f"{where}{key}"
        if isinstance(target, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: expected a mapping")
            _flatten(value, target, path + ".", out)
        elif target == "vllm_endpoints":
            out[target] = _endpoints(value, path)
        elif target == "admission":
            out[target] = _build(AdmissionConfig, value, path + ".")
        elif target == "recorder":
            out[target] = _build(RecorderConfig, value, path + ".")
        elif target == "kubelet":
            if isinstance(value, dict) and isinstance(value.get("enabled"), bool):
                value = {**value, "enabled": "true" if value["enabled"] else "false"}  # YAML's true
            out[target] = _build(KubeletConfig, value, path + ".")
        elif target == "log_files":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{path}: expected a list of file paths")
            out[target] = tuple(value)
        else:
            ftype = {f.name: f.type for f in dataclasses.fields(Config)}[target]
            out[target] = _coerce(value, ftype, path)


def validate(config: Config) -> Config:
    """Checks that concern more than one value."""
    parse_listen(config.listen)
    for key, value in (("interval_seconds", config.interval_seconds),
                       ("history.raw_seconds", config.history_raw_seconds),
                       ("history.retention_seconds", config.history_retention_seconds),
                       ("nvml.retry_initial_seconds", config.nvml_retry_initial_seconds),
                       ("nvml.retry_max_seconds", config.nvml_retry_max_seconds)):
        if value <= 0:
            raise ConfigError(f"{key}: must be positive")
    if config.stale_after_seconds < 0:
        raise ConfigError("stale_after_seconds: must not be negative (0: three intervals)")
    if config.history_raw_seconds > config.history_retention_seconds:
        raise ConfigError("history.raw_seconds: must not exceed history.retention_seconds")
    a = config.admission
    if not 0 < a.open_below < a.close_above <= 1:
        raise ConfigError("admission: need 0 < open_below < close_above <= 1 "
                          f"(got open_below={a.open_below}, close_above={a.close_above})")
    _validate_kubelet(config.kubelet)
    r = config.recorder
    if r.directory:
        if not 0 < r.window_seconds <= config.history_raw_seconds:
            raise ConfigError("recorder.window_seconds: must be positive and at most history.raw_seconds "
                              f"({config.history_raw_seconds:g}), the full-resolution history kept")
        if r.max_files < 1 or r.max_total_bytes < 1 << 20 or r.debounce_seconds < 0:
            raise ConfigError("recorder: need max_files >= 1, max_total_bytes >= 1MiB, debounce_seconds >= 0")
    for i, ep in enumerate(config.vllm_endpoints):
        if not re.match(r"^https?://[^/\s]+", ep.url):
            raise ConfigError(f"vllm.endpoints[{i}].url: expected http(s)://host:port/metrics, got {ep.url!r}")
        if ep.timeout_seconds <= 0:
            raise ConfigError(f"vllm.endpoints[{i}].timeout_seconds: must be positive")
        if ep.process_pattern:
            try:
                re.compile(ep.process_pattern)
            except re.error as exc:
                raise ConfigError(f"vllm.endpoints[{i}].process_pattern: not a valid regex: {exc}") from exc
    return config


def _validate_kubelet(k: KubeletConfig) -> None:
    if k.enabled not in ("auto", "true", "false"):
        raise ConfigError(f"kubelet.enabled: expected auto, true or false, got {k.enabled!r}")
    if k.url and not re.match(r"^https?://[^/\s]+/\S*$", k.url):
        raise ConfigError(f"kubelet.url: expected http(s)://host:port/pods, got {k.url!r}")
    for key in ("refresh_seconds", "unknown_pod_refresh_seconds", "timeout_seconds"):
        if getattr(k, key) <= 0:
            raise ConfigError(f"kubelet.{key}: must be positive")
    if k.unknown_pod_refresh_seconds > k.refresh_seconds:
        raise ConfigError("kubelet.unknown_pod_refresh_seconds: must not exceed kubelet.refresh_seconds")
    if k.max_response_bytes < 1024:
        raise ConfigError("kubelet.max_response_bytes: must be at least 1KiB")


def load_file(path: str) -> dict:
    try:
        raw, more = read_head(path, MAX_CONFIG_BYTES)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from exc
    if more:
        raise ConfigError(f"{path}: config file larger than {MAX_CONFIG_BYTES} bytes")
    try:
        data = yaml.safe_load(raw.decode("utf-8", errors="replace"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    return data


def build(file_data: dict | None = None, overrides: dict | None = None) -> Config:
    """File values, then overrides (env and flags, already merged by the CLI), validated."""
    values: dict = {}
    if file_data:
        _flatten(file_data, _FILE_LAYOUT, "", values)
    for key, value in (overrides or {}).items():
        if value is None or value == ():
            continue
        if key == "vllm_endpoints":
            value = _endpoints(list(value), "--vllm-endpoint")
        values[key] = value
    return validate(Config(**values))


def load(path: str | None = None, overrides: dict | None = None) -> Config:
    return build(load_file(path) if path else None, overrides)


def read_secret_file(path: str, where: str) -> str:
    """A bearer token from a file: bounded, stripped, never echoed in errors."""
    try:
        return read_head(os.path.expanduser(path), 64 << 10)[0].decode("utf-8", errors="replace").strip()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read token file {path}: {exc.strerror or exc}") from exc
