"""CONTRIBUTING's recipes work as written: the registry edit that adds a detector stays lint-clean,
the test helper it names drives the one detector interface, and the "Add a metric" recipe names
every file it changes."""
from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from exporter.analysis.detector import DetectorSpec, FindingKind, Tick
from exporter.model import Finding
from helpers.timeline import T0, GiB, gpu, proc, run_detector, snap, timeline
from helpers.tools import HANG, REPO

CONTRIBUTING = (REPO / "CONTRIBUTING.md").read_text()
REGISTRY = REPO / "exporter" / "analysis" / "registry.py"


def _section(title: str) -> str:
    start = CONTRIBUTING.index(f"## {title}")
    end = CONTRIBUTING.find("\n## ", start + 1)
    return CONTRIBUTING[start:end]


def _add_detector(source: str, module: str) -> str:
    """The registry with one more detector module, edited the way its import is written: a name
    on a line of its own in an open list, or added to the one-line import."""
    one_line = re.search(r"^from \. import ([a-z_, ]+)$", source, re.MULTILINE)
    if one_line:
        names = sorted([*one_line.group(1).split(", "), module])
        source = source.replace(one_line.group(0), "from . import " + ", ".join(names))
    else:
        block = re.search(r"^from \. import \(\n((?:    [a-z_]+,\n)+)\)", source, re.MULTILINE)
        assert block, "registry.py: no `from . import` of the detector modules"
        names = sorted([*re.findall(r"    ([a-z_]+),", block.group(1)), module])
        source = source.replace(block.group(1), "".join(f"    {n},\n" for n in names))
    return source.replace("DETECTORS: tuple[DetectorSpec[Any], ...] = (\n",
                          f"DETECTORS: tuple[DetectorSpec[Any], ...] = (\n    {module}.DETECTOR,\n")


def test_adding_a_detector_to_the_registry_stays_lint_clean():
    """The recipe's registry edit (a module name with a long name among the others) passes ruff as
    it is: no reformatting by hand, no line over 120 columns."""
    edited = _add_detector(REGISTRY.read_text(), "host_memory_bandwidth_contention")
    assert edited.count("host_memory_bandwidth_contention") == 2
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--stdin-filename", str(REGISTRY),
                             "-"], input=edited, capture_output=True, text=True, cwd=REPO, timeout=HANG)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_recipe_says_both_registry_edits():
    recipe = _section("Add a detector")
    assert "`from . import (...)`" in recipe and "`<name>.DETECTOR,`" in recipe
    assert "one line in the registry" not in recipe


@dataclass(frozen=True)
class _Config:
    min_bytes: int = GiB


def _big_processes(tick: Tick, config: _Config) -> list[Finding]:
    """A detector written as the recipe says: one call, (tick, config)."""
    return [Finding(kind="big", severity="warning", first_detected_at=tick.now, gpu=g.index, pid=p.pid)
            for g in tick.snapshot.gpus for p in g.processes if (p.used_bytes or 0) >= config.min_bytes
            and not any(f.pid == p.pid for f in tick.active)]


SPEC = DetectorSpec(name="big", help="", config=_Config, create=lambda: _big_processes,
                    kinds=(FindingKind("big", help="", scenario="steady", raw_alerts=("X",)),))


def test_run_detector_calls_the_one_interface_a_tick_per_snapshot():
    """The helper the recipe names calls `detector(tick, config)` with the tick's history and the
    findings it returned the tick before as the active ones, as the engine does."""
    snaps = timeline(40, 10, lambda e: snap(T0 + e, [gpu([proc(7, (0.5 + e / 20) * GiB)])]))
    per_tick = run_detector(SPEC, snaps, _Config())
    assert [[f.pid for f in found] for found in per_tick] == [[], [7], [], [7], []]
    assert per_tick[1][0].first_detected_at == T0 + 10


def test_the_recipes_name_the_helpers_as_they_are():
    recipe = _section("Add a detector")
    assert "run_detector(<name>.DETECTOR, snapshots, config)" in recipe
    assert "detect(tick: Tick, config)" in recipe
    helper = Path(REPO / "tests" / "helpers" / "timeline.py").read_text()
    assert "def run_detector(spec: DetectorSpec, snapshots, config=None)" in helper


def test_add_a_metric_names_the_goldens_and_the_changelog():
    recipe = _section("Add a metric")
    assert "UPDATE_GOLDEN=1" in recipe and "tests/test_golden_snapshots.py" in recipe
    assert "CHANGELOG.md" in recipe


def test_the_finding_kinds_help_goes_where_its_comment_says():
    """FindingKind.help is written into docs/runbooks/README.md's table of finding kinds."""
    source = (REPO / "exporter" / "analysis" / "detector.py").read_text()
    comment = re.search(r"^    help: str  # (.*)$", source[source.index("class FindingKind"):], re.MULTILINE)
    assert comment and "docs/runbooks/README.md" in comment.group(1)
    from exporter.analysis.registry import finding_kinds

    runbooks = (REPO / "docs" / "runbooks" / "README.md").read_text()
    assert all(k.help in runbooks for k in finding_kinds())
