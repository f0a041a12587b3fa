"""The metric catalogue (exporter/catalogue/) is the one declaration of every family: the exposition
serves exactly what it declares, docs/metrics.md is what it generates, and every `gpumem_` name
used anywhere in the repository (rules, dashboards, docs, runbooks, code, deploy, tests) is one it
declares."""
from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from exporter.catalogue import docs
from exporter.catalogue.families import BY_NAME, FAMILIES, SECTIONS
from exporter.catalogue.family import UNITS, Stability, Type
from exporter.model import AllocatorStats, AllocHistoryStats, KvCache, ListenerStats, ReloadStats
from exporter.postmortem import promquery, trace
from exporter.serve.exposition import StateCollector
from helpers.dashboards import DASHBOARD_FILES, label_values_selector, load, queries, variable_queries
from helpers.rules import PROMETHEUS_METRICS, load_groups, metric_names, recording_rules
from helpers.state import make_state
from helpers.tools import REPO

METRICS_DOC = REPO / "docs" / "metrics.md"


def full_state():
    """make_state() with every optional part filled in, so that every family has a series."""
    state = make_state()
    snap, analysis = state.snapshot, state.analysis
    gpu = snap.gpus[0]
    probed = dataclasses.replace(gpu.processes[0], allocator=AllocatorStats(
        allocated_bytes=512 << 20, reserved_bytes=768 << 20, inactive_split_bytes=64 << 20, alloc_retries=2, ooms=0))
    gpu = dataclasses.replace(gpu, processes=(probed, *gpu.processes[1:]))
    server = snap.vllm[0]
    server = dataclasses.replace(server, engines=tuple(dataclasses.replace(
        e, sleep_state="weights_offloaded", requests_waiting_by_reason=(("capacity", 1.0), ("deferred", 0.0)),
        request_preemptions_total=3.0, requests_finished_total=40.0) for e in server.engines),
        admission_rejections=(("meta-llama/Llama-3.1-8B", "max_num_queued_reqs", 2.0),))
    kv = KvCache(endpoint="llama", model="meta-llama/Llama-3.1-8B", engine="0", capacity_tokens=432_000,
                 capacity_bytes=60 << 30, usage_ratio=0.42, used_tokens=181_440, used_bytes=25 << 30,
                 max_model_len=32_768, max_concurrency=13.2)
    return dataclasses.replace(
        state,
        snapshot=dataclasses.replace(snap, gpus=(gpu,), vllm=(server, *snap.vllm[1:])),
        analysis=dataclasses.replace(analysis, kv_caches=(kv,)),
        alloc_history=AllocHistoryStats(requests_total={"written": 1}, results_total={"done": 1}),
        reload=ReloadStats(successful=True, last_success_at=snap.timestamp))


def served() -> dict[str, object]:
    """The families a scrape of the full state serves, parsed back from the text format, by the
    name they are queried by (a counter's with `_total`)."""
    registry = CollectorRegistry(auto_describe=False)
    listener = ListenerStats("listen", open_connections=3, refused_total={"peer_connections": 2}, evicted_total=1)
    registry.register(StateCollector(full_state, lambda: 1_000_005.0, lambda: (listener,)))
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        out[family.name + ("_total" if family.type == "counter" else "")] = family
    return out


# -- the exposition serves what is declared, as declared ---------------------------------------
def test_the_exposition_serves_every_declared_family_and_nothing_else():
    assert sorted(served()) == sorted(BY_NAME)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_a_served_family_has_its_declared_type_help_and_labels(name):
    declared, family = BY_NAME[name], served()[name]
    assert (family.type, family.documentation) == (declared.type.value, declared.help)
    for sample in family.samples:
        if not sample.name.endswith("_created"):
            assert sorted(sample.labels) == sorted(declared.labels), sample


# -- the declarations follow the naming rules the docs promise ---------------------------------
@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_a_declaration_follows_the_naming_rules(family):
    assert re.fullmatch(r"gpumem_[a-z][a-z0-9_]*[a-z0-9]", family.name)
    assert family.name.endswith("_total") == (family.type is Type.COUNTER)
    base = family.name.removesuffix("_total")
    if family.unit:
        assert family.unit in UNITS and base.endswith(f"_{family.unit}"), f"{family.name}: unit {family.unit}"
    else:
        assert not any(base.endswith(f"_{unit}") for unit in UNITS), f"{family.name}: declare its unit"
    assert len(set(family.labels)) == len(family.labels)
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", label) and not label.startswith("__") for label in family.labels)
    for text in (family.help, family.doc):
        assert text and text == text.strip() and "\n" not in text and "|" not in text
    assert family.section in SECTIONS


def test_names_are_unique():
    assert len(BY_NAME) == len(FAMILIES)


def test_every_section_describes_a_family():
    assert all(any(f.section is s for f in FAMILIES) for s in SECTIONS)


def test_the_docs_are_what_the_catalogue_generates():
    assert METRICS_DOC.read_text() == docs.render(), (
        "docs/metrics.md is stale: python -m exporter.catalogue.docs > docs/metrics.md")


# -- what reads the exporter's series reads declared ones --------------------------------------
def test_the_shipped_rules_read_only_stable_families():
    used = set().union(*(metric_names(r["expr"]) for g in load_groups() for r in g["rules"]))
    unstable = sorted(n for n in used if n in BY_NAME and BY_NAME[n].stability is not Stability.STABLE)
    assert unstable == [], "an alert or recording rule reads an experimental family"


SELECTOR = re.compile(r"(?<![\w:])(gpumem_\w+)\s*\{([^{}]*)\}")
MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
TARGET_LABELS = {"instance", "job"}  # Prometheus adds them to every series it scrapes


def unknown_labels(expr: str) -> set[str]:
    """`family{label}` for each label matched in a selector of a declared family that the family
    does not have."""
    out = set()
    for m in SELECTOR.finditer(expr):
        family = BY_NAME.get(m.group(1))
        matchers = re.sub(r'"(?:[^"\\]|\\.)*"', '""', m.group(2))  # label values hold anything
        if family is not None:
            out |= {f"{family.name}{{{label}}}" for label in MATCHER.findall(matchers)
                    if label not in family.labels and label not in TARGET_LABELS}
    return out


def test_unknown_labels_reads_selectors():
    assert unknown_labels('sum(gpumem_gpu_up{gpu="0", uuid=~"a|b}"}) + gpumem_admission_open{instance="x"}') == set()
    assert unknown_labels('gpumem_admission_open{uuid="x", gpu!="1"}') == {"gpumem_admission_open{uuid}"}


def test_rules_and_dashboards_select_only_labels_their_families_have():
    exprs = [r["expr"] for g in load_groups() for r in g["rules"]]
    exprs += [v for g in load_groups() for r in g["rules"] for v in (r.get("annotations") or {}).values()]
    for path in DASHBOARD_FILES:
        dashboard = load(path)
        exprs += [e for _, e in queries(dashboard)]
        exprs += [label_values_selector(q) for q in variable_queries(dashboard)]
    assert set().union(*map(unknown_labels, exprs)) == set()


def test_the_postmortem_readers_ask_prometheus_for_declared_series():
    names = {*trace.PROMETHEUS_METRICS, *trace.VLLM_PROMETHEUS_METRICS, *promquery._REQUIRED}
    assert names and names <= set(BY_NAME)


# -- no undeclared gpumem_ name anywhere in the repository -------------------------------------
# A name, optionally a recording rule's `level:` before it and `:operations` after it; then what
# makes it a pattern rather than a name: a brace list (`_{a,b}_total`), a glob or a regex tail.
MENTION = re.compile(r"(?<![\w:])(?:[A-Za-z_]\w*:)?gpumem_\w*(?::\w*)?"
                     r"(?P<braces>\{[a-z_]+(?:,[a-z_]+)+\}\w*)?(?P<pattern>\*|\\w)?")
PACKAGE = re.compile(r"gpumem_probe(?::\w*)?")  # the probe's import package and its entry point


def _text_files(root: Path):
    """The repository's own text files: those git tracks or would track (not what it ignores,
    such as the virtual environments, whose vLLM and torch alone are most of a gigabyte)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in sorted(filter(None, listed)):
        path = root / name
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            if b"\0" not in data[:8192]:
                yield path, data.decode("utf-8", errors="replace")


def undeclared(text: str, recorded: set[str]) -> set[str]:
    """The gpumem_ names or patterns in `text` that match no declared family."""
    names = {n for f in FAMILIES for n in f.sample_names}
    bad = set()
    for m in MENTION.finditer(text):
        word = m.group(0)
        if m.group("braces"):
            name = word[:m.start("braces") - m.start()]
        else:
            name = word.removesuffix(m.group("pattern") or "")
        if PACKAGE.fullmatch(name) and not m.group("braces"):
            continue
        if ":" in name:  # a recording rule's name
            ok = name in recorded
        elif m.group("braces"):
            head, _, rest = m.group("braces")[1:].partition("}")
            ok = all(f"{name}{part}{rest}" in names for part in head.split(","))
        elif m.group("pattern") or name.endswith("_"):
            ok = any(n.startswith(name) for n in names)
        else:
            ok = name in names
        if not ok:
            bad.add(word)
    return bad


def test_undeclared_finds_names_patterns_and_rules():
    recorded = {"instance_gpu:gpumem_memory_utilization:ratio"}
    text = ("gpumem_gpu_up{gpu=\"0\"} gpumem_gpu_memory_* gpumem_process_torch_ gpumem_probe:register "
            "instance_gpu:gpumem_memory_utilization:ratio gpumem_vllm_kv_cache_capacity_{tokens,bytes} "
            "gpumem_exporter_errors gpumem_exporter_errors_created")
    assert undeclared(text, recorded) == set()
    # Written in pieces, so that the repository-wide check below does not find them in this file.
    wrong = {p.replace("~", "gpumem_") for p in (
        "~gpu_upp", "~nothing_*", "~vllm_kv_cache_capacity_{tokens,pages}", "instance_gpu:~not_recorded:ratio",
        "~gpu_up_total")}
    assert undeclared(" ".join(sorted(wrong)), recorded) == wrong


def test_every_gpumem_name_in_the_repository_is_declared():
    recorded = {r["record"] for r in recording_rules()} | PROMETHEUS_METRICS
    found = {}
    for path, text in _text_files(REPO):
        for word in undeclared(text, recorded):
            found.setdefault(word, str(path.relative_to(REPO)))
    assert found == {}, "declare these in exporter/catalogue/families.py, or fix the name"
