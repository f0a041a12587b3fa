"""Each built-in scenario, played through the whole live pipeline (simulated NVML, host and vLLM
server → sampler → detectors), raises the finding it is named after and no false one."""
import functools

import pytest

from exporter.cli import make_analyzer
from exporter.config import build as build_config
from exporter.runtime import build as build_runtime
from exporter.sim.scenario import load

EXPECTED = {
    "steady": set(),
    "leak": {"leak"},
    "contention": {"contention", "pressure"},  # the notebook eats the headroom: both are true
    "unified-memory": {"contention", "pressure"},
    "stale-memory": {"stale_memory"},
    "pressure": {"pressure", "contention"},  # the pressure comes from a second process
    # Its KV cache climbs to 95 % with 25 and more requests waiting and 20 preemptions a minute
    # from minute 20: saturated too, by the rule read from a real server (analysis/kv_cache.py).
    "fragmentation": {"fragmentation", "kv_saturation"},
    "gpu-lost": set(),  # shown by gpumem_gpu_up, not a finding
}


@functools.cache  # the leak scenario is played once for both tests
def play(name, step=10.0):
    config = build_config()
    runtime = build_runtime(config, simulate=name, at=0.0)
    analyzer = make_analyzer(config)
    try:
        duration = load(name).duration
        while runtime.clock.elapsed() < duration:
            analyzer.update(runtime.sampler.sample())
            runtime.clock.advance(step)
    finally:
        runtime.close()
    return analyzer, runtime.clock.start


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.slow
def test_scenario_raises_exactly_its_findings(name):
    analyzer, _ = play(name)
    assert {f.kind for f in analyzer.all_findings} == EXPECTED[name]


def test_leak_scenario_names_the_process_and_its_rate():
    analyzer, start = play("leak")
    leaks = [f for f in analyzer.all_findings if f.kind == "leak" and f.gpu is not None]
    assert leaks
    leak = leaks[0]
    spec = next(p for p in load("leak").processes if p.pid == leak.pid)
    assert leak.process == spec.name and leak.role == "vllm"
    rate_mib_min = dict(leak.evidence)["slope_bytes_per_second"] * 60 / 2**20
    assert 3.0 < rate_mib_min < 5.0  # the scenario leaks 4 MiB/min
    assert leak.first_detected_at - start < 5400  # 4 MiB/min: about an hour (bench/leak_quality.py)


@pytest.mark.slow
def test_fragmentation_scenario_is_seen_from_the_allocator_retries_before_any_oom():
    """The probe's retries start at 20 min: the finding names the process and comes from them,
    live, while no out-of-memory error has happened."""
    analyzer, start = play("fragmentation")
    from_probe = [f for f in analyzer.all_findings
                  if f.kind == "fragmentation" and f.pid is not None
                  and dict(f.evidence).get("alloc_retries_in_window", 0) > 0]
    assert from_probe, [(f.kind, f.pid, dict(f.evidence)) for f in analyzer.all_findings]
    first = min(f.first_detected_at for f in from_probe) - start
    assert 20 * 60 <= first < 30 * 60
    assert not [f for f in analyzer.all_findings if f.kind == "oom"]
    assert any("expandable_segments:True" in " ".join(f.advice) for f in from_probe)


@pytest.mark.slow
def test_leak_scenario_attributes_the_growth_to_memory_outside_torch():
    """In the leak scenario torch's reserved memory stays flat while NVML's figure grows."""
    analyzer, _ = play("leak")
    [gpu_leak] = [f for f in analyzer.all_findings if f.kind == "leak" and f.gpu is not None]
    evidence = dict(gpu_leak.evidence)
    assert evidence["component"] == "non_torch"
    assert any("NCCL_CUMEM_ENABLE=0" in a for a in gpu_leak.advice)
