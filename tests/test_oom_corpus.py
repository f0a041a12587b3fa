"""The OOM corpus: real messages from public issue trackers, each against its label.

Every file in tests/fixtures/oom_corpus is parsed and classified as `explain` would; the
events found must be the labelled ones, with the labelled numbers and class. A labelled miss
(`missed:`) or misclassification (`got_class:`) is asserted too, so fixing one shows up as a
failure that asks for the label to be updated. `python tests/test_oom_corpus.py` prints the
score: found / missed / false positives / right class.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from exporter.analysis.oom import CLASSES, classify
from exporter.model import OOM_KINDS, OomEvent
from exporter.sources.oom_messages import parse_lines
from exporter.units import bytes_in_message

CORPUS = Path(__file__).parent / "fixtures" / "oom_corpus"
FILES = sorted(CORPUS.glob("*.log"))
SIZES = {"requested": "requested_bytes", "total": "total_bytes", "free": "free_bytes",
         "reserved_unallocated": "reserved_unallocated_bytes", "this_process": "process_bytes",
         "victim_rss": "process_bytes"}
COUNTS = ("victim_pid", "batch", "max_model_len", "max_model_len_fits")


@dataclass
class Entry:
    path: Path
    label: dict
    lines: list[str]

    @property
    def expected(self) -> list[dict]:
        return self.label.get("events") or []


def load(path: Path) -> Entry:
    text = path.read_text(encoding="utf-8")
    _, header, body = text.split("---\n", 2)
    return Entry(path, yaml.safe_load(header), body.splitlines())


def run(entry: Entry) -> list[OomEvent]:
    return [classify(m) for m in parse_lines(entry.lines, source=entry.path.name)]


def size(text) -> int:
    number, unit = str(text).split()
    value = bytes_in_message(number, unit)
    assert value is not None, text
    return value


def close(got: int | None, want) -> bool:
    """A label is printed like the message, to two decimals of its unit: equal to that precision
    (half a unit in the last place, plus the sums of rounded parts the parser adds up)."""
    number, unit = str(want).split()
    ulp = size(f"0.01 {unit}") if "." in number else 1
    return got is not None and abs(got - size(want)) <= ulp


def matches(event: OomEvent, want: dict) -> list[str]:
    """What differs between a found event and its label ([] when it matches)."""
    wrong = []
    if event.kind != want["kind"]:
        wrong.append(f"kind {event.kind} != {want['kind']}")
    if "gpu" in want and event.gpu != (None if want["gpu"] is None else str(want["gpu"])):
        wrong.append(f"gpu {event.gpu} != {want['gpu']}")
    for key, attr in SIZES.items():
        if key in want and not close(getattr(event, attr), want[key]):
            wrong.append(f"{key} {getattr(event, attr)} != {want[key]}")
    for key in COUNTS:
        if key in want and getattr(event, key) != want[key]:
            wrong.append(f"{key} {getattr(event, key)} != {want[key]}")
    if "others" in want:
        others = want["others"] or {}
        got = dict(event.other_processes)
        if set(got) != set(others) or not all(close(got[p], s) for p, s in others.items()):
            wrong.append(f"others {event.other_processes} != {want['others']}")
    return wrong


def expected_class(want: dict) -> str | None:
    return want.get("got_class", want.get("class"))


# ------------------------------------------------------------------ the test

def test_corpus_size_and_labels():
    entries = [load(p) for p in FILES]
    ooms = [e for e in entries if e.expected]
    assert len(ooms) >= 60, "the corpus holds at least 60 OOM and near-OOM messages"
    assert any(not e.expected for e in entries), "and look-alikes that are not OOMs"
    for e in entries:
        assert e.label.get("source") and e.label.get("url", "").startswith("https://"), e.path
        assert e.expected or e.label.get("why"), f"{e.path.name}: a look-alike says why"
        for want in e.expected:
            assert want["kind"] in OOM_KINDS, e.path
            assert want.get("class") in (*CLASSES, None), e.path
            assert want.get("why") or want.get("missed"), f"{e.path.name}: every label says why"
            if "got_class" in want:
                assert want.get("class_note"), f"{e.path.name}: a known misclassification says why"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_entry(path):
    entry = load(path)
    found = run(entry)
    wanted = [w for w in entry.expected if not w.get("missed")]
    assert [e.kind for e in found] == [w["kind"] for w in wanted], [e.message for e in found]
    for event, want in zip(found, wanted, strict=True):
        assert not matches(event, want), (matches(event, want), event)
        if expected_class(want) is not None:
            assert event.klass == expected_class(want), event.verdict
        assert event.klass in CLASSES and event.verdict and event.advice


# ------------------------------------------------------------------ the score

def score(entries: list[Entry]) -> dict:
    """Found / missed / false positives / right class over the whole corpus. An expected event
    is found when an event of its kind is reported for it; the class is right when it equals
    the label's (events whose label has no class are not counted for class)."""
    totals = dict.fromkeys(("entries", "oom_entries", "lookalike_entries", "expected", "found",
                            "missed", "false_positives", "classed", "right_class"), 0)
    for entry in entries:
        totals["entries"] += 1
        totals["oom_entries" if entry.expected else "lookalike_entries"] += 1
        found = run(entry)
        pool = list(found)
        for want in entry.expected:
            totals["expected"] += 1
            hit = next((e for e in pool if not matches(e, {"kind": want["kind"]})), None)
            if hit is None:
                totals["missed"] += 1
                continue
            pool.remove(hit)
            totals["found"] += 1
            if want.get("class") is not None:
                totals["classed"] += 1
                totals["right_class"] += hit.klass == want["class"]
        totals["false_positives"] += len(pool)
    return totals


if __name__ == "__main__":
    figures = score([load(p) for p in FILES])
    print(f"corpus: {figures['entries']} files ({figures['oom_entries']} with OOM messages,"
          f" {figures['lookalike_entries']} look-alikes)")
    print(f"expected events {figures['expected']}: found {figures['found']},"
          f" missed {figures['missed']}; false positives {figures['false_positives']};"
          f" right class {figures['right_class']} of {figures['classed']} classed")
    sys.exit(0)
