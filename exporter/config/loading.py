"""From a file (and the flags and environment that override it) to a checked Config."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .fields import ConfigError, problems_of
from .schema import Config
from .yamlfile import YamlError, read_yaml


def load_file(path: str) -> dict[str, Any]:
    """The file's mapping, as written. Raises ConfigError."""
    try:
        data = read_yaml(path, "config")
    except YamlError as exc:
        raise ConfigError(str(exc)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    return data


def _override(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.c` in a copy of the file's mapping; a section that is not a mapping stays as
    written, for the schema to report."""
    *parents, last = dotted.split(".")
    node = data
    for key in parents:
        child = node.get(key, {})
        if not isinstance(child, dict):
            return
        node[key] = node = dict(child)
    node[last] = list(value) if isinstance(value, tuple) else value


def build(file_data: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """The file's values, then the overrides (flags and environment, keyed by dotted key path;
    None or () leaves a key alone), checked as one. Raises ConfigError with every problem."""
    data = dict(file_data or {})
    for key, value in (overrides or {}).items():
        if value is not None and value != ():
            _override(data, key, value)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(problems_of(exc, Config)) from None


def load(path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    return build(load_file(path) if path else None, overrides)


def file_form(config: Config) -> dict[str, Any]:
    """The configuration as a file would say it (nested, sizes as 8MiB): `build` accepts it back."""
    return config.model_dump(mode="json")
