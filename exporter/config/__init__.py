"""Configuration: a YAML file, overridden by environment variables, overridden by flags, all
checked against one schema (schema.py; the web config file's in web.py). Every problem is
reported at once, each naming its key path; unknown keys are errors (a typo must not silently
fall back to a default). docs/configuration.md is generated from the schema (docs.py).
"""
from .fields import DEFAULT_PORT, ConfigError, parse_listen
from .loading import build, file_form, load, load_file
from .schema import (
                     AdmissionConfig,
                     Config,
                     EndpointConfig,
                     GpuConfig,
                     HistoryConfig,
                     HostConfig,
                     KubeletConfig,
                     LogsConfig,
                     RecorderConfig,
                     VllmConfig,
                     read_secret_file,
)
from .yamlfile import MAX_YAML_BYTES as MAX_CONFIG_BYTES

__all__ = ["DEFAULT_PORT", "MAX_CONFIG_BYTES", "AdmissionConfig", "Config", "ConfigError", "EndpointConfig",
           "GpuConfig", "HistoryConfig", "HostConfig", "KubeletConfig", "LogsConfig", "RecorderConfig",
           "VllmConfig", "build", "file_form", "load", "load_file", "parse_listen", "read_secret_file"]
