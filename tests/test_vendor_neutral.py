"""NVML's names stay in its module, its fake and its own alert (#20 item 4): the metrics' help and
the shared findings' advice are vendor-neutral, and a finding's vendor commands come from the GPU
backend's declaration (sources/gpu.py), with the GPU's index, so another backend would not serve
NVIDIA's wording."""
from __future__ import annotations

import re

import pytest

from exporter.analysis.engine import Analyzer
from exporter.catalogue.families import FAMILIES
from exporter.config import build
from exporter.model import GpuSample, GpuTools
from exporter.sources import gpu as backends
from exporter.sources.nvml import NvmlSource
from helpers.timeline import T0, GiB, gpu, proc, snap, vllm_proc

VENDOR = re.compile(r"nvml|nvidia|xid", re.IGNORECASE)
OTHER_TOOLS = GpuTools(tool="amd-smi", reset="amd-smi reset -G {gpu}", inspect="amd-smi static -g {gpu}",
                       list_processes="amd-smi process", device_files="/dev/kfd /dev/dri/*",
                       kernel_errors="amdgpu errors", lost_error="amdgpu: GPU reset begin")


def test_no_metric_help_names_a_vendor():
    """The HELP line every scrape carries; the docs may say what NVML does as the default backend."""
    named = [(f.name, f.help) for f in FAMILIES if VENDOR.search(f.help)]
    assert named == []


def _advice(config, lost_error="gpu_is_lost") -> dict[str, tuple[str, ...]]:
    """The advice of the findings about a lost GPU 1 and stale memory on GPU 0."""
    analyzer = Analyzer(config.analysis(), log_findings=False)
    server = vllm_proc(10, 40 * GiB, start=T0)
    for e in range(0, 600, 10):
        lost = GpuSample(index="1", uuid="GPU-1", up=e < 300, error="" if e < 300 else lost_error,
                         total_bytes=80 * GiB, used_bytes=41 * GiB if e < 300 else None,
                         processes=(vllm_proc(11, 40 * GiB, start=T0),) if e < 300 else ())
        result = analyzer.update(snap(T0 + e, [gpu([server, proc(5, GiB)], used=20 * GiB + 41 * GiB), lost]))
    return {f.kind: f.advice for f in result.findings}


def test_the_nvml_backend_advises_its_own_commands_with_the_gpu_index():
    advice = _advice(build())
    lost = " ".join(advice["gpu_unavailable"])
    assert "`nvidia-smi -r -i 1`" in lost and "Xid 79" in lost and "`nvidia-smi -q -i 1`" in lost
    assert "-i N" not in lost
    stale = " ".join(advice["stale_memory"])
    assert "nvidia-smi --query-compute-apps" in stale and "`nvidia-smi -r -i 0`" in stale


@pytest.fixture
def other_backend(monkeypatch):
    monkeypatch.setattr(backends, "BACKENDS", (*backends.BACKENDS, backends.GpuBackend(
        "othersmi", library="exporter_no_such_vendor_library", title="Other SMI", source=NvmlSource,
        tools=OTHER_TOOLS)))


def test_another_backend_serves_its_own_commands_and_no_nvidia_wording(other_backend):
    advice = _advice(build({"gpu": {"backend": "othersmi"}}))
    lost, stale = " ".join(advice["gpu_unavailable"]), " ".join(advice["stale_memory"])
    assert "`amd-smi reset -G 1`" in lost and "amdgpu: GPU reset begin" in lost
    assert "`amd-smi process`" in stale and "`fuser -v /dev/kfd /dev/dri/*`" in stale
    assert not VENDOR.search(lost + stale), lost + stale


@pytest.mark.parametrize("error", ["gpu_is_lost", "reset_required"])
def test_without_a_backend_the_advice_is_in_vendor_neutral_words(error):
    """A replayed trace knows no backend: the same advice, with no vendor's command in it."""
    analyzer = Analyzer(log_findings=False)
    lost = GpuSample(index="1", uuid="GPU-1", up=False, error=error)
    (finding,) = [f for f in analyzer.update(snap(T0, [lost])).findings if f.kind == "gpu_unavailable"]
    text = " ".join(finding.advice)
    assert not VENDOR.search(text) and "reset" in text, text
