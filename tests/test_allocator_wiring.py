"""The allocator probe's numbers end to end: config -> make_sampler -> the `allocator` source
(after nvml and host, timed and reported by the one collect wrapper) -> per-process series;
the simulator's probes (scenario `allocator`, files in the real probe's format); and the built-in
fragmentation and leak scenarios seen through them."""
from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import types
from functools import partial
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.cli import main
from exporter.clock import FixedClock
from exporter.config import ConfigError, build
from exporter.model import AllocatorStats, GpuSample, ProcessSample, Snapshot, State
from exporter.runtime import make_sampler, open_host
from exporter.serve.exposition import build_registry
from exporter.sim.probes import SimulatedProbes
from exporter.sim.scenario import ScenarioError, loads
from exporter.sources.allocator import parse

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
MiB = 1 << 20
PROCESS_LABELS = {"gpu", "uuid", "pid", "process", "role", "container", "pod", "namespace"}
CONTRACT = ("gpumem_process_torch_allocated_bytes", "gpumem_process_torch_reserved_bytes",
            "gpumem_process_non_torch_bytes", "gpumem_process_alloc_retries_total")
ALL_SERIES = CONTRACT + ("gpumem_process_torch_inactive_split_bytes", "gpumem_process_torch_ooms_total")


def series(snapshot: Snapshot) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = build_registry(lambda: State(snapshot=snapshot), now=lambda: snapshot.timestamp)
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def one(found, name, pid=None):
    values = [v for labels, v in found.get(name, []) if pid is None or labels["pid"] == str(pid)]
    assert len(values) == 1, (name, found.get(name))
    return values[0]


# -- configuration --------------------------------------------------------------------------

def test_the_allocator_is_off_unless_a_probe_directory_is_configured():
    assert build({}).allocator.probe_dir == ""


def test_the_probe_directory_must_exist_and_be_a_directory(tmp_path):
    assert build({"allocator": {"probe_dir": str(tmp_path)}}).allocator.probe_dir == str(tmp_path)
    with pytest.raises(ConfigError, match=r"allocator\.probe_dir: .*does not exist"):
        build({"allocator": {"probe_dir": str(tmp_path / "missing")}})
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"allocator\.probe_dir: .*is not a directory"):
        build({"allocator": {"probe_dir": str(tmp_path / "file")}})
    with pytest.raises(ConfigError, match=r"allocator\.directory: "):
        build({"allocator": {"directory": str(tmp_path)}})


def test_check_config_reports_a_missing_probe_directory(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"allocator:\n  probe_dir: {tmp_path / 'nope'}\n")
    result = CliRunner().invoke(main, ["check-config", str(config)])
    assert result.exit_code != 0 and "allocator.probe_dir" in result.output


# -- the source in a sampler on a (non-simulated) host -----------------------------------------

@pytest.fixture
def host():
    """The steady scenario's fake NVML and processes, treated as a real host: the allocator
    source comes from the configuration, as on a GPU node."""
    h = open_host(build({}), simulate="steady", at=3600)
    h.scenario = None  # played, but read as a real host
    yield h
    h.close()


def write_probe_file(directory: Path, p: ProcessSample, gpu: GpuSample, written_at: float, **numbers: int) -> None:
    own = p.ns_pid if p.ns_pid is not None else p.pid
    device = {"index": 0, "uuid": gpu.uuid.removeprefix("GPU-"), "allocated_bytes": numbers.get("allocated", GiB),
              "reserved_bytes": numbers.get("reserved", 2 * GiB), "inactive_split_bytes": 256 * MiB,
              "alloc_retries": numbers.get("retries", 3), "ooms": 1}
    doc = {"schema": 1, "pid": own, "pid_ns": 0, "start_time": p.start_time, "written_at": written_at,
           "interval": 5.0, "devices": [device]}
    (directory / f"gpumem-0-{own}.json").write_text(json.dumps(doc))


def test_configured_the_source_runs_after_nvml_and_host_and_attaches_the_numbers(tmp_path, host):
    sampler = make_sampler(build({"allocator": {"probe_dir": str(tmp_path)}}), host)
    names = [s.name for s in sampler.sources]
    assert names.index("allocator") > max(names.index("nvml"), names.index("host"))

    first = sampler.sample()
    assert first.source_up("allocator") is True and first.errors == ()
    gpu = first.gpus[0]
    probed, unprobed = gpu.processes[0], gpu.processes[1:]
    write_probe_file(tmp_path, probed, gpu, first.timestamp, reserved=probed.used_bytes - 700 * MiB)

    snap = sampler.sample()
    by_pid = {p.pid: p for p in snap.gpus[0].processes}
    assert by_pid[probed.pid].allocator.reserved_bytes == probed.used_bytes - 700 * MiB
    assert all(by_pid[p.pid].allocator is None for p in unprobed)
    found = series(snap)
    assert one(found, "gpumem_process_non_torch_bytes", probed.pid) == 700 * MiB
    assert one(found, "gpumem_process_alloc_retries_total", probed.pid) == 3
    for name in ALL_SERIES:  # only the probed process has them: absent, not zero, for the rest
        assert [labels["pid"] for labels, _ in found[name]] == [str(probed.pid)]
        assert set(found[name][0][0]) == PROCESS_LABELS
    sampler.close()


def test_a_missing_directory_turns_the_source_down_and_is_counted(tmp_path, host):
    directory = tmp_path / "probe"
    directory.mkdir()
    sampler = make_sampler(build({"allocator": {"probe_dir": str(directory)}}), host)
    directory.rmdir()  # gone after the configuration was checked
    snap = sampler.sample()
    status = next(s for s in snap.sources if s.source == "allocator")
    assert not status.up and "No such file" in status.error
    assert [(e.source, e.kind) for e in snap.errors] == [("allocator", "dir_missing")]
    assert snap.source_up("nvml") and all(p.allocator is None for g in snap.gpus for p in g.processes)
    up = {labels["source"]: v for labels, v in series(snap)["gpumem_exporter_source_up"]}
    assert up["allocator"] == 0 and up["nvml"] == 1


def test_unconfigured_no_allocator_source_runs(host):
    assert "allocator" not in [s.name for s in make_sampler(build({}), host).sources]


# -- exposition -------------------------------------------------------------------------------

def process(used, **stats):
    return ProcessSample(pid=42, used_bytes=used, name="python3", role="vllm",
                         allocator=AllocatorStats(**stats) if stats else None)


def snapshot_of(*processes):
    return Snapshot(timestamp=1.0, gpus=(GpuSample(index="0", uuid="GPU-x", processes=processes),))


def test_non_torch_is_nvml_used_minus_torch_reserved():
    assert process(10 * GiB, reserved_bytes=8 * GiB).non_torch_bytes == 2 * GiB
    assert process(8 * GiB, reserved_bytes=8 * GiB).non_torch_bytes == 0


def test_asleep_the_released_sleep_pool_is_taken_out_of_reserved_first():
    # vLLM sleep mode: 60 GiB of the 70 GiB reserved is the CuMem pool, released behind torch's back.
    asleep = process(11 * GiB, reserved_bytes=70 * GiB, cumem_bytes=60 * GiB)
    assert asleep.non_torch_bytes == GiB


def test_reserved_above_used_with_nothing_to_explain_it_gives_no_number():
    assert process(7 * GiB, reserved_bytes=8 * GiB).non_torch_bytes is None
    assert process(GiB, reserved_bytes=70 * GiB, cumem_bytes=60 * GiB).non_torch_bytes is None
    assert process(None, reserved_bytes=GiB).non_torch_bytes is None
    assert process(GiB).non_torch_bytes is None  # no probe
    found = series(snapshot_of(process(7 * GiB, reserved_bytes=8 * GiB)))
    assert "gpumem_process_non_torch_bytes" not in found
    assert one(found, "gpumem_process_torch_reserved_bytes") == 8 * GiB


def test_numbers_a_torch_does_not_report_are_absent():
    found = series(snapshot_of(process(10 * GiB, allocated_bytes=GiB, reserved_bytes=2 * GiB)))
    assert one(found, "gpumem_process_torch_allocated_bytes") == GiB
    for name in ("gpumem_process_alloc_retries_total", "gpumem_process_torch_ooms_total",
                 "gpumem_process_torch_inactive_split_bytes"):
        assert name not in found


# -- scenario validation ---------------------------------------------------------------------

SCENARIO = """
name: probed
duration: 1h
gpus: [{memory: 80GiB}]
host: {memory: 64GiB}
processes:
  - pid: 100
    name: worker
    gpu: 0
    memory: 20GiB
    allocator: %s
"""


@pytest.mark.parametrize("allocator, message", [
    ("{cached: 1GiB}", r"processes\[0\]\.allocator\.non_torch: required key is missing"),
    ("{non_torch: 1GiB, interval: 0.1}", r"processes\[0\]\.allocator\.interval: must be between 0\.5 and 300"),
    ("{non_torch: 1GiB, retries: 3}", r"processes\[0\]\.allocator\.retries: unknown key"),
    ("{non_torch: 1GiB, alloc_retries: {linear: {from: 0, rate: -1/min}}}",
     r"processes\[0\]\.allocator\.alloc_retries: a counter may only use components that never decrease"),
    ("{non_torch: lots}", r"processes\[0\]\.allocator\.non_torch"),
    ("[1, 2]", r"processes\[0\]\.allocator: expected a mapping"),
    ("{non_torch: 1GiB, alloc_conf: [expandable_segments]}", r"processes\[0\]\.allocator\.alloc_conf"),
])
def test_bad_allocator_data_is_a_clear_scenario_error(allocator, message):
    with pytest.raises(ScenarioError, match=message):
        loads(SCENARIO % allocator)


def test_a_process_without_a_gpu_cannot_have_a_probe():
    text = SCENARIO.replace("    gpu: 0\n    memory: 20GiB\n", "") % "{non_torch: 1GiB}"
    with pytest.raises(ScenarioError, match=r"processes\[0\]\.allocator: the process has no 'gpu'"):
        loads(text)


def test_the_probes_numbers_add_up_to_what_nvml_shows():
    scenario = loads(SCENARIO % "{non_torch: 600MiB, cached: 2GiB, inactive_split: 3GiB, start: 30}")
    assert scenario.state_at(10).process(100).probe is None  # CUDA not initialised yet: no file
    numbers = scenario.state_at(60).process(100).probe.devices["0"]
    assert numbers.reserved_bytes == 20 * GiB - 600 * MiB
    assert numbers.allocated_bytes == numbers.reserved_bytes - 2 * GiB
    assert numbers.inactive_split_bytes == 2 * GiB  # never more than the cache


# -- the simulator's probe files ----------------------------------------------------------------

_names = itertools.count()


def real_probe_document(tmp_path):
    """What the real probe writes, against the stand-in torch.cuda the probe's own tests use."""
    sys.path.insert(0, str(ROOT / "probe"))
    try:
        from gpumem_probe.probe import Probe, initialised_cuda
    finally:
        sys.path.remove(str(ROOT / "probe"))
    spec = importlib.util.spec_from_file_location(
        f"standin_cuda_wiring_{next(_names)}", ROOT / "tests/fixtures/probe/standin_torch/torch/cuda.py")
    cuda = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cuda)
    cuda.reset(devices=1, initialised=True)
    cuda.set_stats(0, reserved=GiB, allocated=GiB // 2, device_allocs=1)
    modules = {"torch": types.SimpleNamespace(cuda=cuda, __version__="2.6.0+cu124")}
    probe = Probe(str(tmp_path), 5.0, cuda=partial(initialised_cuda, modules), modules=modules,
                  clock=lambda: 1_700_000_000.0)
    return probe.document(cuda)


def test_simulated_probe_files_have_the_real_probes_format_and_name(tmp_path):
    real = real_probe_document(tmp_path)
    host = open_host(build({}), simulate="fragmentation", at=3000)
    try:
        host.sim_probes.write()
        files = sorted(Path(host.sim_probes.directory).iterdir())
        assert [f.name for f in files] == ["gpumem-0-9650.json"]  # the EngineCore; the API server has no GPU
        doc = json.loads(files[0].read_bytes())
        assert set(doc) == set(real) and set(doc["devices"][0]) == set(real["devices"][0])
        assert set(doc["errors"]) == set(real["errors"])
        report = parse(files[0].read_bytes())  # the exporter's reader accepts it
        assert report.pid == 9650 and report.start_time == host.clock.start
        assert report.devices[0][0] == host.view.scenario.gpus[0].uuid.removeprefix("GPU-")
    finally:
        host.close()


def test_a_stopped_process_has_its_file_removed(tmp_path):
    text = (SCENARIO % "{non_torch: 1GiB}").replace("    memory: 20GiB\n", "    memory: 20GiB\n    stop: 600\n")
    clock = FixedClock(1_700_000_000.0, 300)
    probes = SimulatedProbes(loads(text), clock, str(tmp_path))
    probes.write()
    assert [p.name for p in tmp_path.iterdir()] == ["gpumem-0-100.json"]
    clock.advance(600)
    probes.write()
    assert list(tmp_path.iterdir()) == []  # as the probe's exit handler removes it


# -- the built-in scenarios, through `snapshot --simulate` ------------------------------------------

def snapshot_series(name, at):
    result = CliRunner(env={"GPUMEM_RUN_CONFIG": None}).invoke(
        main, ["--log-level", "warning", "snapshot", "--simulate", name, "--at", str(at)])
    assert result.exit_code == 0, result.output
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(result.stdout):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_snapshot_of_the_fragmentation_scenario_prints_the_contract_series():
    found = snapshot_series("fragmentation", 3600)
    for name in CONTRACT:
        labels, _ = found[name][0]
        assert set(labels) == PROCESS_LABELS and labels["pid"] == "9650", name
    assert ({labels["source"]: v for labels, v in found["gpumem_exporter_source_up"]}["allocator"]) == 1


def test_fragmentation_retries_climb_and_the_cache_is_mostly_inactive_splits():
    early, later, late = (snapshot_series("fragmentation", t) for t in (900, 2400, 3600))
    retries = [one(s, "gpumem_process_alloc_retries_total") for s in (early, later, late)]
    assert retries[0] == 0 and 0 < retries[1] < retries[2]
    cache = one(late, "gpumem_process_torch_reserved_bytes") - one(late, "gpumem_process_torch_allocated_bytes")
    assert one(late, "gpumem_process_torch_inactive_split_bytes") > 0.75 * cache > GiB


def test_the_leak_scenarios_growth_is_non_torch():
    a, b = snapshot_series("leak", 3600), snapshot_series("leak", 18000)
    used = one(b, "gpumem_process_memory_used_bytes", 3150) - one(a, "gpumem_process_memory_used_bytes", 3150)
    non_torch = one(b, "gpumem_process_non_torch_bytes") - one(a, "gpumem_process_non_torch_bytes")
    reserved = one(b, "gpumem_process_torch_reserved_bytes") - one(a, "gpumem_process_torch_reserved_bytes")
    assert used > 800 * MiB  # 4 MiB/min over 4 h, give or take the sawtooth and noise
    assert non_torch == 4 * MiB * (18000 - 3600) // 60  # all of the trend
    assert abs(reserved) < 300 * MiB  # only the cache's breathing and noise
