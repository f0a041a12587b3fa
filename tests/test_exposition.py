"""Golden exposition: pins names, labels, types and help texts of everything we render."""
import dataclasses
import os
import platform
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from exporter.model import GpuSample, ProcessSample
from exporter.serve.exposition import StateCollector
from helpers.state import make_state

GOLDEN = Path(__file__).parent / "golden" / "state.metrics"
DOCS = Path(__file__).parent.parent / "docs" / "metrics.md"


def render(state, now=1_000_005.0):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(lambda: state, lambda: now))
    text = generate_latest(registry).decode()
    return text.replace(f'python="{platform.python_version()}"', 'python="X"')


def test_golden_exposition():
    text = render(make_state())
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "exposition changed; rerun with UPDATE_GOLDEN=1 and review the diff"


def test_sample_age_is_exposed():
    text = render(make_state(t=1_000_000.0), now=1_000_012.5)
    assert "gpumem_exporter_sample_age_seconds 12.5" in text


def test_dead_process_series_disappear():
    assert 'pid="202"' in render(make_state(pids=(101, 202)))
    assert 'pid="202"' not in render(make_state(pids=(101,)))


def test_absent_fields_are_absent_not_zero():
    state = make_state()
    lost = GpuSample(index="1", uuid="GPU-lost", name="x", up=False, error="gpu_is_lost")
    unknown_use = dataclasses.replace(state.snapshot.gpus[0], processes=(ProcessSample(pid=5, used_bytes=None),))
    state = dataclasses.replace(state, snapshot=dataclasses.replace(state.snapshot, gpus=(lost, unknown_use)))
    text = render(state)
    assert 'gpumem_gpu_up{gpu="1",uuid="GPU-lost"} 0.0' in text
    assert not re.search(r'gpumem_gpu_memory_used_bytes\{gpu="1"', text)
    assert 'pid="5"' not in text


def test_a_budget_without_used_bytes_renders_without_that_series():
    """NVML may give no per-process figure for any of a server's processes: the scrape must still render."""
    state = make_state()
    unknown = dataclasses.replace(state.analysis.budgets[0], used_bytes=None)
    state = dataclasses.replace(state, analysis=dataclasses.replace(state.analysis, budgets=(unknown,)))
    text = render(state)
    assert 'gpumem_vllm_memory_budget_bytes{endpoint="llama",gpu="0",uuid="GPU-aaaa"}' in text
    assert "gpumem_vllm_memory_used_bytes{" not in text


def test_every_family_is_documented():
    names = set(re.findall(r"^# TYPE (\w+) ", render(make_state()), re.M))
    docs = DOCS.read_text()
    missing = [n for n in sorted(names) if f"`{n}`" not in docs]
    assert not missing, f"not described in docs/metrics.md: {missing}"


def test_label_values_carry_no_control_characters():
    """#21 L11: process names (any local user sets its own comm), model names and pod names come
    from outside; an escape sequence must not reach a terminal or log through /metrics."""
    state = make_state()
    gpu = state.snapshot.gpus[0]
    hostile = dataclasses.replace(gpu.processes[0], name="\x1b[2J\x1b]0;owned\x07py\tthon", pod="p\x00d")
    vllm = tuple(dataclasses.replace(v, engines=tuple(dataclasses.replace(e, model="m\x1b[31mx\x9b")
                                                      for e in v.engines)) for v in state.snapshot.vllm)
    snap = dataclasses.replace(state.snapshot, gpus=(dataclasses.replace(gpu, processes=(hostile,)),), vllm=vllm)
    text = render(dataclasses.replace(state, snapshot=snap))
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text)
    assert 'process="\ufffd[2J\ufffd]0;owned\ufffdpy\ufffdthon"' in text  # still tells the series apart
    assert 'model="m\ufffd[31mx\ufffd"' in text
