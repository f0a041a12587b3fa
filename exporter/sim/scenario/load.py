"""Scenario files: built-ins by name, files by path, YAML text; every error names its file."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

from ...config.yamlfile import YamlError, parse_yaml
from .evaluate import Scenario
from .schema import from_dict
from .validate import ScenarioError

SCENARIO_DIR = Path(__file__).parent.parent / "scenarios"
MAX_SCENARIO_BYTES = 4 * 1024 * 1024  # scenario files are hand-written; refuse anything huge


def _parse_yaml(text: str, source: str) -> Any:
    # The configuration's YAML reader: plain data, duplicate keys refused, errors at file:line.
    # Aliases stay allowed (built-in scenarios share one worker's memory curve between processes
    # with `&worker` / `*worker`), with their expansion bounded so an alias bomb is refused.
    try:
        return parse_yaml(text, source, allow_aliases=True)
    except YamlError as e:
        raise ScenarioError(str(e)) from None


def loads(text: str, source: str = "<string>") -> Scenario:
    """A scenario from YAML text; `source` (a file name) starts every error message."""
    if len(text) > MAX_SCENARIO_BYTES:
        raise ScenarioError(f"{source}: scenario larger than {MAX_SCENARIO_BYTES} bytes")
    data = _parse_yaml(text, source)
    try:
        return from_dict(data, source)
    except ScenarioError as e:
        raise ScenarioError(f"{source}: {e}") from None


def _builtin_path(name: str) -> Path | None:
    if re.match(r"^[a-z0-9][a-z0-9_-]*$", name):
        path = SCENARIO_DIR / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def load(name_or_path: str | Path) -> Scenario:
    """A built-in scenario by name (see `builtin()`) or a YAML file by path."""
    path = _builtin_path(str(name_or_path)) or Path(name_or_path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SCENARIO_BYTES + 1)
    except OSError as e:
        names = ", ".join(listed.name for listed in builtin())
        raise ScenarioError(f"{name_or_path}: no such scenario file or built-in name "
                            f"({e.strerror}); built-in: {names}") from None
    if len(raw) > MAX_SCENARIO_BYTES:
        raise ScenarioError(f"{path}: scenario larger than {MAX_SCENARIO_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ScenarioError(f"{path}: not UTF-8 text") from None
    return loads(text, str(path))


class Listed(NamedTuple):
    name: str
    description: str
    duration: str  # as the file says it ("3h"), to pick a speed by


def builtin() -> list[Listed]:
    """Every built-in scenario, by name."""
    out = []
    for path in sorted(SCENARIO_DIR.glob("*.yaml")):
        try:
            data = _parse_yaml(path.read_text(encoding="utf-8"), str(path))
            data = data if isinstance(data, dict) else {}
            desc, duration = data.get("description", ""), data.get("duration", "")
        except (OSError, UnicodeDecodeError, ScenarioError):
            desc, duration = "(unreadable)", ""
        out.append(Listed(path.stem, str(desc), str(duration)))
    return out
