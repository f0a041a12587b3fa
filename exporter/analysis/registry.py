"""Every detector the engine runs, in the order it runs them, registered in this one place.

Each module declares itself (analysis.detector.DetectorSpec: its config section, its finding
kinds, the alert each kind raises); the engine, the configuration schema and the alert rules
generator (alerts/generate.py) read this list and nothing else. A new detector is a module with
a DETECTOR, its name in the import below and its DETECTOR in DETECTORS.
"""
from __future__ import annotations

from typing import Any

# One module a line, alphabetical, with the trailing comma (isort keeps the list open), so adding a
# detector is one line here and one in DETECTORS, and stays within ruff's rules.
from . import (
    contention,
    fragmentation,
    kv_cache,
    leak_detector,
    oom_findings,
    pressure,
    sleep,
    stale,
    unavailable,
)
from .detector import DetectorSpec, FindingKind

DETECTORS: tuple[DetectorSpec[Any], ...] = (
    leak_detector.DETECTOR,
    fragmentation.DETECTOR,
    contention.DETECTOR,
    stale.DETECTOR,
    pressure.DETECTOR,
    oom_findings.DETECTOR,
    sleep.DETECTOR,
    kv_cache.DETECTOR,
    unavailable.DETECTOR,
)


def finding_kinds() -> tuple[FindingKind, ...]:
    """Every finding kind a detector declares, in the detectors' order."""
    return tuple(k for spec in DETECTORS for k in spec.kinds)
