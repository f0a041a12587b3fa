"""Real GPU memory series from public repositories (../shared/real-traces, beside the checkout;
INDEX.tsv names each one's source and label): replayed through the live detectors, the leak-free
ones raise no finding at all.

The series labelled `leak` there are 13 s to 6 min long, far shorter than the leak detector's
minimum observation window (which keeps warm-up from being called a leak), so they are loaded
here only to prove they parse; whether they are caught is not asserted. So that silence on the
leak-free ones means something, each long enough for the detector has a slow leak laid over its
real noise and steps, and that must be caught.
"""
from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest

from exporter.postmortem.analyze import replay
from exporter.postmortem.trace import read_traces

REAL_TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "real-traces"


def _index() -> list[dict[str, str]]:
    if not (REAL_TRACES / "INDEX.tsv").is_file():
        return []
    with open(REAL_TRACES / "INDEX.tsv", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


INDEX = _index()
pytestmark = pytest.mark.skipif(not INDEX, reason=f"no real traces at {REAL_TRACES} (shared/ beside the checkout)")


@pytest.mark.parametrize("entry", [e for e in INDEX if e["label"] == "no_leak"], ids=lambda e: e["file"])
def test_a_leak_free_real_series_raises_no_finding(entry):
    snapshots = read_traces([str(REAL_TRACES / entry["file"])])
    assert len(snapshots) >= 5
    findings = replay(snapshots)
    assert findings == [], [(f.kind, f.severity, f.summary) for f in findings]


@pytest.mark.parametrize("entry", [e for e in INDEX if e["label"] == "leak"], ids=lambda e: e["file"])
def test_a_leaking_real_series_loads_and_replays(entry):
    snapshots = read_traces([str(REAL_TRACES / entry["file"])])
    assert len(snapshots) >= 5 and all(s.gpus for s in snapshots)
    replay(snapshots)  # must not raise


def _with_leak(snapshots, mib_per_minute):
    """The same series with every process (and its GPU) growing steadily from the first sample."""
    t0 = snapshots[0].timestamp
    out = []
    for snap in snapshots:
        extra = int((snap.timestamp - t0) / 60 * mib_per_minute * (1 << 20))
        gpus = tuple(dataclasses.replace(
            g, used_bytes=None if g.used_bytes is None else g.used_bytes + extra,
            processes=tuple(p if p.used_bytes is None else dataclasses.replace(p, used_bytes=p.used_bytes + extra)
                            for p in g.processes)) for g in snap.gpus)
        out.append(dataclasses.replace(snap, gpus=gpus))
    return out


def _long_enough(entry):
    snapshots = read_traces([str(REAL_TRACES / entry["file"])])
    return snapshots[-1].timestamp - snapshots[0].timestamp >= 45 * 60


@pytest.mark.parametrize("entry", [e for e in INDEX if e["label"] == "no_leak" and _long_enough(e)],
                         ids=lambda e: e["file"])
def test_a_slow_leak_laid_over_a_real_series_is_caught(entry):
    snapshots = read_traces([str(REAL_TRACES / entry["file"])])
    leaks = [f for f in replay(_with_leak(snapshots, 4)) if f.kind == "leak"]
    assert leaks, "4 MiB/min over the real series went unseen"
