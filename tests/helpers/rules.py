"""The shipped alert and recording rules, and the metric names rules and dashboards may use."""
from __future__ import annotations

import re

import yaml

from exporter.catalogue.families import FAMILIES
from helpers.tools import REPO

ALERTS_DIR = REPO / "alerts"
RULES = ALERTS_DIR / "gpu-memory-exporter.rules.yml"
ALERTMANAGER_CONFIG = ALERTS_DIR / "alertmanager.example.yml"

# The exporter's metric names, from their one declaration (exporter/catalogue/families.py). Rules
# and dashboards may use only these, their own recording rules, and Prometheus' `up` and `ALERTS`.
DECLARED_METRICS = frozenset(family.name for family in FAMILIES)
PROMETHEUS_METRICS = frozenset({"up", "ALERTS"})

_PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                    "unless", "offset", "bool", "inf", "nan", "atan2"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, keywords, labels or durations)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals: label values, regexes
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range and subquery durations
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    names = set()
    for m in re.finditer(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("("):
            continue  # a function or an aggregation
        if m.group().lower() not in _PROMQL_KEYWORDS:
            names.add(m.group())
    return names


def load_groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def alert_rules() -> list[dict]:
    return [r for g in load_groups() for r in g["rules"] if "alert" in r]


def recording_rules() -> list[dict]:
    return [r for g in load_groups() for r in g["rules"] if "record" in r]
