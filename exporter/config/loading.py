"""From a file (and the flags and environment that override it) to a checked Config."""
from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from .fields import ConfigError, problems_of
from .schema import Config
from .yamlfile import YamlError, read_yaml

log = logging.getLogger("exporter.config")

# Sections renamed, old name -> new: the old name is still read, with a warning.
RENAMED = {"nvml": "gpu"}


def load_file(path: str, duplicates: list[str] | None = None) -> dict[str, Any]:
    """The file's mapping, as written. Raises ConfigError. With `duplicates` (a list), a key
    the file gives twice is added to it as a problem instead of raised (its last value kept),
    so the rest of the file can still be checked."""
    try:
        data = read_yaml(path, "config", duplicates=duplicates)
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


def _renamed(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """The file's mapping with each section under its current name (RENAMED), the names it
    used (new -> old, so a problem names the key as the file wrote it), and the problems of a
    file that gives both names."""
    used, problems = {}, []
    for old, new in RENAMED.items():
        if old not in data:
            continue
        if new in data:
            problems.append(f"{old}: the old name of {new}; give {new} only")
            data = {key: value for key, value in data.items() if key != old}
            continue
        log.warning("config: %r is deprecated and will be removed: call the section %r (read as %r now; "
                    "check-config prints the file with the new name)", old, new, new)
        data = {(new if key == old else key): value for key, value in data.items()}
        used[new] = old
    return data, used, problems


def _as_written(problem: str, used: dict[str, str]) -> str:
    for new, old in used.items():
        if problem.startswith((new + ".", new + ":")):
            return old + problem[len(new):]
    return problem


def build(file_data: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """The file's values, then the overrides (flags and environment, keyed by dotted key path;
    None or () leaves a key alone), checked as one. Raises ConfigError with every problem."""
    data, used, problems = _renamed(dict(file_data or {}))
    for key, value in (overrides or {}).items():
        if value is not None and value != ():
            _override(data, key, value)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(problems + [_as_written(p, used) for p in problems_of(exc, Config)]) from None
    if problems:
        raise ConfigError(problems)
    return config


# The sections Config.analysis() reads. A replay (`analyze --config`) checks only these: the files
# the rest names (TLS, tokens, the probe directory) are the daemon's host's, not the replay's.
ANALYSIS_SECTIONS = ("admission", "history", "detectors", "gpu")


def load(path: str | None = None, overrides: dict[str, Any] | None = None,
         sections: tuple[str, ...] | None = None) -> Config:
    """The file checked as one with the overrides: every problem at once, keys the file gives
    twice among them. With `sections`, the file's other sections are left out, unread.
    Raises ConfigError."""
    duplicates: list[str] = []
    data = load_file(path, duplicates) if path else None
    if data and sections is not None:
        kept = {*sections, *(old for old, new in RENAMED.items() if new in sections)}
        data = {key: value for key, value in data.items() if key in kept}
    try:
        config = build(data, overrides)
    except ConfigError as exc:
        raise ConfigError(duplicates + exc.problems) from None
    if duplicates:
        raise ConfigError(duplicates)
    return config


def file_form(config: Config) -> dict[str, Any]:
    """The configuration as a file would say it (nested, sizes as 8MiB): `build` accepts it back."""
    return config.model_dump(mode="json")
