"""A GPU vendor is one backend: a source module, its simulated library, one line in
sources/gpu.BACKENDS. Nothing else (configuration, runtime, sampler, exposition, CLI) names a
vendor: here a second backend, declared only in the registry, is chosen by `gpu.backend`,
loaded with its own fake and sampled end to end."""
from __future__ import annotations

import sys
import types
from dataclasses import replace

import pytest
from prometheus_client import generate_latest

from exporter.config import ConfigError, build
from exporter.daemon import Daemon
from exporter.model import VllmSample
from exporter.runtime import build as build_runtime
from exporter.serve.exposition import build_registry
from exporter.sim import fake_nvml
from exporter.sources import gpu
from exporter.sources.nvml import NvmlSource
from exporter.sources.source import GPUS


class OtherSource(NvmlSource):
    """Stands in for another vendor's source: the same interface under its own name."""

    name = "othersmi"


@pytest.fixture
def second_backend(monkeypatch):
    """What a vendor's contribution amounts to: the registry line, and sim/fake_<name>.py."""
    monkeypatch.setattr(gpu, "BACKENDS", (*gpu.BACKENDS, gpu.GpuBackend(
        "othersmi", library="exporter_no_such_vendor_library", title="Other SMI", source=OtherSource)))
    fake = types.ModuleType("exporter.sim.fake_othersmi")
    configured = []

    def configure(scenario, clock):
        configured.append(scenario.name if scenario is not None else None)
        fake_nvml.configure(scenario, clock)

    fake.configure = configure
    fake.__getattr__ = lambda name: getattr(fake_nvml, name)  # the NVML-shaped stand-in answers the calls
    monkeypatch.setitem(sys.modules, "exporter.sim.fake_othersmi", fake)
    return configured


def test_nvml_is_the_default_backend_and_its_source_gives_the_gpus():
    assert build().gpu.backend == gpu.DEFAULT == "nvml"
    nvml = gpu.backend("nvml")
    assert nvml.source is NvmlSource and nvml.library == "pynvml" and NvmlSource.gives == (GPUS,)


def test_a_backend_declared_only_in_the_registry_is_chosen_loaded_and_sampled(second_backend):
    config = build({"gpu": {"backend": "othersmi"}})
    runtime = build_runtime(config, simulate="steady", at=600)
    try:
        assert second_backend == ["steady"]  # its own fake, bound to the scenario
        assert [s.name for s in runtime.sampler.sources][:2] == ["othersmi", "host"]
        state = Daemon(runtime.sampler, runtime.clock, 5.0).tick()
    finally:
        runtime.close()
    assert second_backend[-1] is None  # released with the host
    assert state.snapshot.source_up("othersmi") is True and state.snapshot.gpus
    text = generate_latest(build_registry(lambda: state, runtime.clock.now)).decode()
    assert 'gpumem_exporter_source_up{source="othersmi"} 1.0' in text
    assert "gpumem_gpu_memory_used_bytes{" in text


def test_a_backend_whose_library_is_missing_on_a_real_host_is_a_clear_error(second_backend):
    with pytest.raises(ConfigError) as err:
        build_runtime(build({"gpu": {"backend": "othersmi"}}))
    assert ("gpu.backend: othersmi needs the Python module 'exporter_no_such_vendor_library', which cannot "
            "be imported") in str(err.value)


@pytest.mark.parametrize("simulate", [None, "steady"])
def test_backend_none_reads_no_gpu_and_is_never_down(simulate, caplog):
    """A host with no GPU to read (vLLM's CPU backend): `gpu.backend: none` gives no GPU and no
    error, where `nvml` would report its library missing and retry for ever; simulated, the
    scenario's GPUs are not read either."""
    from exporter.serve import status

    runtime = build_runtime(build({"gpu": {"backend": "none"}}), simulate=simulate, at=600 if simulate else None)
    try:
        states = [Daemon(runtime.sampler, runtime.clock, 5.0).tick() for _ in range(2)]
    finally:
        runtime.close()
    state = states[-1]
    assert state.snapshot.source_up("none") is True and state.snapshot.gpus == ()
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING") and "GPU" in r.getMessage()]
    text = generate_latest(build_registry(lambda: state, runtime.clock.now)).decode()
    assert 'gpumem_exporter_source_up{source="none"} 1.0' in text and "gpumem_gpu_memory_used_bytes{" not in text
    page = status.render(state, "host", 1.0, 15.0)
    assert "No GPU is read on this host (gpu.backend none)" in page and "Is the driver installed" not in page
    assert "<td>gpu: none (gpu.backend)</td><td>" in page and "<td>none</td>" not in page
    # A server whose processes are not on this host (served elsewhere): nothing here to weigh its
    # memory against, and no GPU to have found a process on.
    elsewhere = replace(state, snapshot=replace(state.snapshot, vllm=(VllmSample(endpoint="remote", up=True),)))
    row = status.render(elsewhere, "host", 1.0, 15.0).split("<td>remote</td>")[1].split("</tr>")[0]
    assert "not known: no GPU here, and none of its processes found on this host" in row, row
    assert "no GPU process found" not in row
