"""The shipped Grafana dashboards and the PromQL inside them."""
from __future__ import annotations

import json
import re
from pathlib import Path

from helpers.tools import REPO

GRAFANA = REPO / "grafana"
DASHBOARD_FILES = sorted((GRAFANA / "dashboards").glob("*.json"))

# Grafana's own variables, and what stands in for them when promtool checks an expression.
# The allocator probe's series (docs/probe.md): absent for a process without gpu-memory-probe.
PROBE_SERIES = ("gpumem_process_torch_", "gpumem_process_non_torch_bytes", "gpumem_process_alloc_retries_total")
BUILTINS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    panels = []
    for p in dashboard.get("panels", []):
        panels.append(p)
        panels.extend(p.get("panels", []))  # panels inside collapsed rows
    return panels


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every annotation query."""
    found = [(f"panel {p['title']!r}", t["expr"]) for p in all_panels(dashboard) for t in p.get("targets", [])]
    found += [(f"annotation {a['name']!r}", a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a]
    return found


def variable_queries(dashboard: dict) -> list[str]:
    return [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def substitute(expr: str) -> str:
    """Grafana variables replaced the way a dashboard with "All" selected sends them."""
    return VARIABLE.sub(lambda m: BUILTINS.get(m.group(1) or m.group(2), ".*"), expr)


def label_values_selector(query: str) -> str:
    """label_values(selector, label) -> selector; a plain expression stays as it is."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\)\s*", query)
    return m.group(1) if m else query
