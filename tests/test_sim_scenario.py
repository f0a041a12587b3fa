"""Scenario loading, validation, curves and the state-at-time function."""
from __future__ import annotations

import copy
import re
import statistics

import pytest
import yaml

from exporter.clock import FixedClock
from exporter.sim import scenario as sc
from exporter.sim.scenario import ScenarioError, load, parse_curve, validate

GiB, MiB = 2**30, 2**20

BASE = {
    "name": "t",
    "description": "test scenario",
    "duration": "1h",
    "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory": "80GiB", "reserved": "512MiB", "count": 2}],
    "host": {"memory": "512GiB", "available": "400GiB"},
    "processes": [
        {"pid": 100, "name": "vllm", "rss": "1GiB"},
        {"pid": 101, "ppid": 100, "name": "worker", "gpu": 0, "memory": "10GiB", "rss": "2GiB"},
        {"pid": 102, "ppid": 100, "name": "worker", "gpu": 1,
         "memory": [{"linear": {"rate": "2MiB/min"}}], "rss": "2GiB"},
    ],
    "vllm": [{"port": 8000, "pid": 100, "model": "m",
              "cache_config": {"gpu_memory_utilization": 0.9, "num_gpu_blocks": 1000}}],
}


def build(mutate=None) -> sc.Scenario:
    data = copy.deepcopy(BASE)
    if mutate:
        mutate(data)
    return sc.from_dict(data)


def curve(value, bytes_=True, **kw):
    return parse_curve(value, "c", bytes_=bytes_, **kw)


# ---- units ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    (1024, 1024), ("80GiB", 80 * GiB), ("512MiB", 512 * MiB), ("1.5GiB", 1.5 * GiB),
    ("2GB", 2e9), ("-2GiB", -2 * GiB), ("100 B", 100),
])
def test_sizes(text, expected):
    assert sc.parse_size(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("2MiB/min", 2 * MiB / 60), ("100MiB/h", 100 * MiB / 3600), ("1GiB/s", GiB), (5, 5),
    ("12/min", 0.2), ("-20MiB/min", -20 * MiB / 60),
])
def test_rates(text, expected):
    assert sc.parse_rate(text) == pytest.approx(expected)


@pytest.mark.parametrize("text,expected", [(90, 90), ("90s", 90), ("30m", 1800), ("6h", 21600), ("1d", 86400)])
def test_durations(text, expected):
    assert sc.parse_duration(text) == expected


@pytest.mark.parametrize("bad", ["80 gigs", "GiB", True, None, [1]])
def test_bad_size_names_the_path(bad):
    with pytest.raises(ScenarioError, match=r"^where: expected a size"):
        sc.parse_size(bad, "where")


# ---- validation: every error names the key path ------------------------------------------------


VALIDATION_CASES = [
    (lambda d: d["processes"][2].update(memory=[{"linear": {"rate": "fast"}}]),
     "processes[2].memory[0].linear.rate: expected a rate like '2MiB/min'"),
    (lambda d: d.update(colour="red"), "colour: unknown key"),
    (lambda d: d["gpus"][0].update(vram="80GiB"), "gpus[0].vram: unknown key"),
    (lambda d: d["gpus"][0].pop("memory"), "gpus[0].memory: required key is missing"),
    (lambda d: d["gpus"][0].update(reserved="90GiB"), "gpus[0].reserved: must be less than memory"),
    (lambda d: d.pop("name"), "name: required key is missing"),
    (lambda d: d.update(duration="forever"), "duration: expected seconds or a duration"),
    (lambda d: d.update(description="two\nlines"), "description: must be one line"),
    (lambda d: d["processes"][1].update(gpu=5), "processes[1].gpu: no GPU 5"),
    (lambda d: d["processes"][1].update(gpu=[0, 0]), "processes[1].gpu: a GPU is listed twice"),
    (lambda d: d["processes"][1].update(name="x" * 65), "processes[1].name: a process name"),
    (lambda d: d["processes"][1].update(pid=100), "pid 100 is used by two processes alive at the same time"),
    (lambda d: d["processes"][1].update(kind="display"), "processes[1].kind: expected compute or graphics"),
    (lambda d: d["processes"][1].update(container="xyz"), "processes[1].container: expected a 64-character"),
    (lambda d: d["processes"][1].update(pod_uid="1b4e28ba-2fa1-11d2-883f-0016d3cca427"),
     "processes[1].pod_uid: a pod needs a container id"),
    (lambda d: d["processes"][1].update(stop=0), "processes[1].stop: must be after start"),
    (lambda d: d["processes"][1].pop("memory"), "processes[1].memory: required for a process on a GPU"),
    (lambda d: d["processes"][0].update(memory="1GiB"), "processes[0].memory: the process has no 'gpu'"),
    (lambda d: d["processes"][1].update(memory=[{"spline": {}}]),
     "processes[1].memory[0].spline: unknown curve component"),
    (lambda d: d["processes"][1].update(memory=[{"ramp": {"kv_cache": "1GiB"}}]),
     "processes[1].memory[0].ramp.weights: required key is missing"),
    (lambda d: d["processes"][1].update(memory=[{"step": {"at": 5, "to": 1, "by": 1}}]),
     "processes[1].memory[0].step: give exactly one of 'to' or 'by'"),
    (lambda d: d["processes"][1].update(memory=[{"linear": {"rate": 1, "from": 10, "until": 5}}]),
     "processes[1].memory[0].linear.until: must not be before 'from'"),
    (lambda d: d["processes"][1].update(memory=[{"noise": {"stddev": "1GiB", "colour": "pink"}}]),
     "processes[1].memory[0].noise.colour: unknown key"),
    (lambda d: d["processes"][1].update(memory_by_gpu={1: "1GiB"}),
     "processes[1].memory_by_gpu.1: the process is not on GPU 1"),
    (lambda d: d["host"].update(psi_some="high"), "host.psi_some: expected a number"),
    (lambda d: d["host"].update(oom_kills=[{"noise": {"stddev": 1}}]), "host.oom_kills: a counter may only use"),
    (lambda d: d["vllm"][0].update(pid=999), "vllm[0].pid: no process with pid 999"),
    (lambda d: d["vllm"][0].update(port=70000), "vllm[0].port: must be between 1 and 65535"),
    (lambda d: d["vllm"].append(copy.deepcopy(d["vllm"][0])), "vllm[1].port: port 8000 is used by two servers"),
    (lambda d: d["vllm"][0]["cache_config"].update(gpu_memory_utilization=1.5),
     "vllm[0].cache_config.gpu_memory_utilization: must be at most 1"),
    (lambda d: d["vllm"][0].update(preemptions={"sawtooth": {"period": 5, "amplitude": 3}}),
     "vllm[0].preemptions: a counter may only use"),
    (lambda d: d["vllm"][0].update(prefix_cache_hit_ratio=2),
     "vllm[0].prefix_cache_hit_ratio: must be between 0 and 1"),
    (lambda d: d.update(faults=[{"kind": "meteor"}]), "faults[0].kind: expected one of"),
    (lambda d: d.update(faults=[{"kind": "gpu_lost"}]), "faults[0].gpu: required for gpu_lost"),
    (lambda d: d.update(faults=[{"kind": "gpu_lost", "gpu": 0, "at": 10, "until": 5}]),
     "faults[0].until: must be after 'at'"),
    (lambda d: d.update(faults=[{"kind": "init_failure", "error": "oops"}]),
     "faults[0].error: expected one of library_not_found"),
    (lambda d: d.update(faults=[{"call": "rm -rf", "error": "Timeout"}]),
     "faults[0].call: expected a name of the GPU library"),
    (lambda d: d.update(faults=[{"call": "nvmlDeviceGetUUID", "error": "Time out"}]),
     "faults[0].error: expected a name of the GPU library"),
    (lambda d: d.update(faults=[{"kind": "vllm_slow", "delay": 600}]), "faults[0].delay: at most 60 seconds"),
    (lambda d: d.update(faults=[{"kind": "vllm_http_error", "status": 200}]),
     "faults[0].status: expected an HTTP error status"),
    (lambda d: d.update(gpus=[]), "gpus: at least one GPU is needed"),
    (lambda d: d.update(gpus={"name": "x"}), "gpus: expected a list"),
]


@pytest.mark.parametrize("mutate,message", VALIDATION_CASES, ids=[m for _, m in VALIDATION_CASES])
def test_validation_errors_name_the_key(mutate, message):
    with pytest.raises(ScenarioError) as err:
        build(mutate)
    assert message in str(err.value)


def test_base_scenario_is_valid():
    s = build()
    assert [g.index for g in s.gpus] == [0, 1]
    assert len({g.uuid for g in s.gpus}) == 2 and all(g.uuid.startswith("GPU-") for g in s.gpus)


def test_yaml_errors_and_non_mapping_documents():
    with pytest.raises(ScenarioError, match="not valid YAML"):
        sc.loads("name: [unclosed")
    with pytest.raises(ScenarioError, match="expected a mapping"):
        sc.loads("- just\n- a list\n")


def test_errors_in_a_file_name_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: t\nduration: 1h\ngpus: [unclosed\n")
    with pytest.raises(ScenarioError, match="^" + re.escape(f"{path}:4:1: not valid YAML: ")):
        sc.load(path)
    path.write_text(yaml.safe_dump({**BASE, "colour": "red"}))
    with pytest.raises(ScenarioError, match="^" + re.escape(f"{path}: colour: unknown key")):
        sc.load(path)


def test_oversized_file_is_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (sc.MAX_SCENARIO_BYTES + 10))
    with pytest.raises(ScenarioError, match="larger than"):
        sc.load(big)


def test_unknown_name_lists_builtins():
    with pytest.raises(ScenarioError, match=r"built-in: .*steady"):
        sc.load("no-such-scenario")


def test_load_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(BASE))
    s = sc.load(str(path))
    assert s.name == "t" and s.source == str(path)


def test_pid_may_be_reused_after_the_first_process_exits():
    def reuse(d):
        d["processes"][1]["stop"] = 100
        d["processes"].append({"pid": 101, "name": "other", "start": 200, "rss": "1MiB"})
    s = build(reuse)
    assert s.state_at(50).process(101).name == "worker"
    assert s.state_at(150).process(101) is None
    assert s.state_at(250).process(101).name == "other"


# ---- curves -----------------------------------------------------------------------------------


def test_constant_and_shorthand():
    assert curve("1GiB")(123) == GiB
    assert curve([{"constant": 5}], bytes_=False)(0) == 5


def test_step_to_and_by():
    c = curve([{"step": {"at": 100, "from": "1GiB", "to": "3GiB"}}])
    assert (c(99.9), c(100), c(500)) == (GiB, 3 * GiB, 3 * GiB)
    c = curve([{"constant": "1GiB"}, {"step": {"at": "10m", "by": "-512MiB"}}])
    assert (c(599), c(600)) == (GiB, 512 * MiB)


def test_linear_from_until():
    c = curve({"linear": {"from": 60, "rate": "6MiB/min", "until": 660}})
    assert c(0) == 0 and c(60) == 0
    assert c(120) == pytest.approx(6 * MiB)
    assert c(660) == pytest.approx(60 * MiB) and c(10_000) == pytest.approx(60 * MiB)


def test_sawtooth_rises_then_drops():
    c = curve({"sawtooth": {"period": 100, "amplitude": "1GiB"}})
    assert c(0) == 0 and c(50) == pytest.approx(GiB / 2) and c(99) == pytest.approx(0.99 * GiB)
    assert c(100) == 0


def test_staircase():
    c = curve({"staircase": {"every": 300, "step": "1GiB", "from": 100, "until": 1000}})
    assert [c(t) for t in (0, 399, 400, 700, 1000, 5000)] == [0, 0, GiB, 2 * GiB, 3 * GiB, 3 * GiB]


def test_ramp_phases():
    c = curve({"ramp": {"at": 10, "non_torch": "1GiB", "weights": "10GiB", "load_seconds": 100,
                        "profile_peak": "4GiB", "profile_seconds": 20, "kv_cache": "50GiB",
                        "cuda_graphs": "2GiB", "graph_seconds": 40}})
    assert c(5) == 0
    assert c(10) == GiB  # context first
    assert c(60) == pytest.approx(6 * GiB)  # half the weights loaded
    assert c(115) == pytest.approx(15 * GiB)  # profiling spike
    assert c(130) == pytest.approx(61 * GiB)  # KV preallocated, graphs being captured
    assert c(150) == pytest.approx(62 * GiB)
    assert c(10_000) == pytest.approx(63 * GiB)  # plateau


def test_noise_is_a_pure_function_of_seed_and_time():
    a = curve({"noise": {"stddev": 10, "seed": 42}}, bytes_=False)
    b = curve({"noise": {"stddev": 10, "seed": 42}}, bytes_=False)
    other = curve({"noise": {"stddev": 10, "seed": 43}}, bytes_=False)
    ts = [i * 1.0 for i in range(3000)]
    values = [a(t) for t in ts]
    assert values == [b(t) for t in reversed(ts)][::-1]  # order of evaluation does not matter
    assert values != [other(t) for t in ts]
    assert abs(statistics.fmean(values)) < 1.0
    assert statistics.pstdev(values) == pytest.approx(10, rel=0.1)
    assert a(5.2) == a(5.9)  # one value per `every` (1 s) bucket


def test_counter_curves_refuse_decreasing_components():
    with pytest.raises(ScenarioError, match="counter"):
        curve({"step": {"at": 1, "from": 5, "to": 1}}, bytes_=False, counter=True)
    assert curve({"linear": {"rate": "3/min"}}, bytes_=False, counter=True)(600) == pytest.approx(30)


def test_non_byte_curves_refuse_units():
    with pytest.raises(ScenarioError, match="c: expected a number"):
        curve("5GiB", bytes_=False)


# ---- state ------------------------------------------------------------------------------------


def test_process_curves_run_on_process_time_and_lifetime_is_half_open():
    def late(d):
        d["processes"][2].update(start=1000, stop=2000)
    s = build(late)
    assert s.state_at(999).process(102) is None
    p = s.state_at(1600).process(102)
    assert p.gpu_bytes["1"] == int(600 * 2 * MiB / 60)  # 10 min of its own life at 2 MiB/min
    assert s.state_at(2000).process(102) is None


def test_memory_is_clamped_to_zero_and_to_the_gpu():
    def extremes(d):
        d["processes"][1]["memory"] = "-5GiB"
        d["processes"][2]["memory"] = "500GiB"
    st = build(extremes).state_at(10)
    assert st.process(101).gpu_bytes["0"] == 0
    usable = 80 * GiB - 512 * MiB
    assert st.process(102).gpu_bytes["1"] == usable
    assert st.gpus[1].used_bytes == usable and st.gpus[1].free_bytes == 0


def test_gpu_used_is_processes_plus_stale_memory():
    def stale(d):
        d["stale_memory"] = [{"gpu": 0, "bytes": "20GiB", "at": 100, "until": 200}]
    s = build(stale)
    assert s.state_at(99).gpus[0].used_bytes == 10 * GiB
    g = s.state_at(150).gpus[0]
    assert (g.used_bytes, g.stale_bytes) == (30 * GiB, 20 * GiB)
    assert s.state_at(200).gpus[0].used_bytes == 10 * GiB


def test_tensor_parallel_process_with_per_gpu_curves():
    def tp(d):
        d["processes"][1].update(gpu=[0, 1], memory="3GiB", memory_by_gpu={1: "4GiB"})
        d["processes"].pop(2)
    p = build(tp).state_at(10).process(101)
    assert dict(p.gpu_bytes) == {"0": 3 * GiB, "1": 4 * GiB}


def test_host_can_subtract_process_memory():
    def sub(d):
        d["host"]["subtract_processes"] = True
    st = build(sub).state_at(0)
    assert st.host.available_bytes == 400 * GiB - (1 + 2 + 2) * GiB  # RSS only: GPUs not unified


def test_vllm_state_counters_and_liveness():
    def srv(d):
        d["processes"][0].update(start=100, stop=1000)
        d["vllm"][0].update(preemptions={"linear": {"from": 200, "rate": "6/min"}},
                            prefix_cache_queries={"linear": {"rate": "600/min"}},
                            prefix_cache_hit_ratio=0.25, kv_cache_usage=1.7)
    s = build(srv)
    assert s.state_at(50).vllm[0].up is False
    v = s.state_at(800).vllm[0]
    assert v.up and v.preemptions_total == 60 and v.kv_cache_usage == 1.0  # clamped ratio
    assert v.prefix_cache_hits_total == v.prefix_cache_queries_total // 4
    assert v.started_at == 100


def test_faults_are_active_in_half_open_windows():
    def faults(d):
        d["faults"] = [{"kind": "gpu_lost", "gpu": 1, "at": 600, "until": 1200},
                       {"call": "nvmlDeviceGetMemoryInfo", "version": 2, "error": "function_not_found"}]
    s = build(faults)
    kinds = lambda t: sorted(f.kind for f in s.state_at(t).faults)  # noqa: E731
    assert kinds(599) == ["call_error"]
    assert kinds(600) == kinds(1199) == ["call_error", "gpu_lost"]
    assert kinds(1200) == ["call_error"]
    assert s.faults[1].error == "function_not_found"  # as written: the fake NVML reads the name (test_sim_fake_nvml)


def test_state_is_deterministic_and_memoised():
    a, b = sc.load("steady"), sc.load("steady")
    assert a.state_at(1234.5) == b.state_at(1234.5)
    assert a.state_at(77) is a.state_at(77)
    assert a.state_at(78) is not a.state_at(77)


def test_state_for_rounds_clock_time_down_to_the_resolution():
    s = build()
    clock = FixedClock(1_700_000_000, 10.7)
    assert s.state_for(clock).t == 10.0
    s.resolution = 0
    assert s.state_for(clock).t == 10.7


# ---- built-in scenarios ----------------------------------------------------------------------

REQUIRED = {"steady", "leak", "contention", "unified-memory", "stale-memory", "pressure",
            "gpu-lost", "fragmentation", "fleet-8x64"}


def test_builtin_list_has_every_required_scenario_with_a_description_and_its_duration():
    found = {listed.name: listed for listed in sc.builtin()}
    assert set(found) >= REQUIRED
    for name, listed in found.items():
        assert listed.description and "\n" not in listed.description, name
        assert sc.load(name).duration == validate.parse_duration(listed.duration), name


@pytest.mark.parametrize("name", [listed.name for listed in sc.builtin()])
def test_every_builtin_loads_and_evaluates(name):
    s = sc.load(name)
    assert s.name == name
    for t in (0, 1, 30, 90, 600, 1800, 3600, s.duration - 1, s.duration):
        st = s.state_at(t)
        for g in st.gpus:
            assert 0 <= g.used_bytes <= g.total_bytes - g.reserved_bytes
        assert 0 <= st.host.available_bytes <= st.host.total_bytes
        for v in st.vllm:
            assert 0 <= v.kv_cache_usage <= 1


def _ratio(s, t, gpu=0):
    g = s.state_at(t).gpus[gpu]
    return g.used_bytes / g.total_bytes


def test_steady_has_a_vllm_tree_and_no_trend():
    s = sc.load("steady")
    st = s.state_at(3600)
    assert {p.pid for p in st.processes} == {2100, 2150, 2201, 2202}
    early = statistics.fmean(s.state_at(t).process(2201).gpu_bytes["0"] for t in range(600, 1200, 7))
    late = statistics.fmean(s.state_at(t).process(2201).gpu_bytes["0"] for t in range(20_000, 20_600, 7))
    assert abs(late - early) < 64 * MiB


def test_leak_grows_about_4mib_per_minute():
    s = sc.load("leak")
    mean = lambda t0: statistics.fmean(s.state_at(t).process(3150).gpu_bytes["0"] for t in range(t0, t0 + 300))  # noqa: E731
    growth = mean(3600) - mean(600)
    assert growth == pytest.approx(50 * 4 * MiB, rel=0.1)
    assert s.state_at(3600).process(3150).rss_bytes > s.state_at(600).process(3150).rss_bytes + 900 * MiB


def test_contention_notebook_appears_at_30_min_and_grows():
    s = sc.load("contention")
    assert s.state_at(1799).process(5230) is None
    first = s.state_at(1810).process(5230).gpu_bytes["0"]
    later = s.state_at(5000).process(5230).gpu_bytes["0"]  # 9 steps of 1 GiB in its first 45 min
    assert later > first + 8 * GiB
    assert _ratio(s, 5000) > 0.95


def test_unified_memory_host_available_falls_and_psi_rises():
    s = sc.load("unified-memory")
    assert s.gpus[0].unified
    avail = [s.state_at(t).host.available_bytes for t in (600, 3600, 7200, 10_000)]
    assert avail == sorted(avail, reverse=True) and avail[0] - avail[-1] > 40 * GiB
    assert s.state_at(9000).host.psi_some_avg10 > s.state_at(3000).host.psi_some_avg10 + 10
    assert s.state_at(10_300).host.oom_kills == 1 and s.state_at(10_300).process(7300) is None


def test_stale_memory_stays_after_the_server_exits():
    s = sc.load("stale-memory")
    st = s.state_at(700)
    assert [p for p in st.processes if "0" in p.gpu_bytes] == [] and st.gpus[0].used_bytes == 20 * GiB
    assert s.state_at(1500).gpus[0].stale_bytes == 20 * GiB


def test_pressure_crosses_90_and_falls_below_80():
    s = sc.load("pressure")
    assert _ratio(s, 900) < 0.80
    assert _ratio(s, 1500) > 0.90
    assert _ratio(s, 3300) < 0.80


def test_fragmentation_preempts_while_memory_is_free():
    s = sc.load("fragmentation")
    a, b = s.state_at(1800), s.state_at(3000)
    assert b.vllm[0].preemptions_total > a.vllm[0].preemptions_total > 0
    assert b.gpus[0].free_bytes / b.gpus[0].total_bytes > 0.3


def test_fleet_evaluates_every_process_on_its_gpu():
    # How fast this is belongs to bench/scenario_eval.py, not to a test.
    s = sc.load("fleet-8x64")
    assert len(s.processes) == 512 and len(s.gpus) == 8
    for t in range(100, 105):
        st = s.state_at(t)
        assert len(st.processes) == 512
        for g in st.gpus:
            on_gpu = [p.gpu_bytes[str(g.index)] for p in st.processes if str(g.index) in p.gpu_bytes]
            assert len(on_gpu) == 64 and g.used_bytes == sum(on_gpu)
            assert all(GiB - 64 * MiB < b < GiB + 128 * MiB for b in on_gpu)  # 1 GiB + sawtooth + noise


def test_replace_processes_swaps_the_list_in_place():
    def doc(pid, name):
        return {"name": "n", "description": "", "duration": 3600, "gpus": [{"memory": "80GiB"}],
                "host": {"memory": "64GiB"}, "processes": [{"pid": pid, "name": name, "gpu": 0, "memory": "1GiB"}]}
    scenario = sc.from_dict(doc(100, "first"))
    assert [p.pid for p in scenario.state_at(600).processes] == [100]
    scenario.replace_processes(sc.from_dict(doc(777, "late")).processes)
    after = scenario.state_at(600)  # same t: the remembered state must not be served
    assert [p.pid for p in after.processes] == [777] and after.process(777).name == "late"


def test_an_alias_bomb_scenario_is_refused(tmp_path):
    """Aliases are allowed in scenarios (built-ins share curves), but their expansion is bounded."""
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdef", "bcdefg", strict=True):
        lines.append(f"{name}: &{name} [{','.join(['*' + prev] * 9)}]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ScenarioError, match="expands to more than"):
        load(str(path))


def test_the_old_nvml_spelling_of_a_version_mismatch_is_read_with_a_warning(caplog):
    """Scenario faults speak no vendor's words: `lib_rm_version_mismatch` (NVML's) is now
    `version_mismatch`; the old spelling still loads, and says so (#20)."""
    def old(d):
        d["faults"] = [{"kind": "init_failure", "error": "lib_rm_version_mismatch", "until": 60}]
    with caplog.at_level("WARNING", logger="exporter.sim.scenario"):
        s = build(old)
    assert s.faults[0].error == "version_mismatch"
    assert any("faults[0].error: 'lib_rm_version_mismatch' is deprecated, say 'version_mismatch'" in r.getMessage()
               for r in caplog.records)
def test_a_servers_log_lines_are_written_when_the_clock_passes_them(tmp_path):
    """`vllm[].log`: lines the server writes while it runs, appended in time order just before
    the `logs` source reads, each once."""
    from exporter.sim.logs import SimulatedLogs

    scenario = build(lambda d: d["vllm"][0].update(log=[{"at": "20m", "line": "second"},
                                                       {"at": 600, "line": "first"}]))
    path = tmp_path / "vllm-0.log"
    path.write_text("start-up\n")
    clock = FixedClock(1_700_000_000.0, 0)
    logs = SimulatedLogs(scenario, clock, {0: str(path)})
    seen = []
    for at in (0, 599, 600, 601, 1199, 1200, 3000):
        clock.at = at
        logs.write()
        seen.append(path.read_text().splitlines())
    assert seen[0] == seen[1] == ["start-up"]
    assert seen[2] == seen[3] == seen[4] == ["start-up", "first"]
    assert seen[5] == seen[6] == ["start-up", "first", "second"]


@pytest.mark.parametrize("log, message", [
    ([{"at": 10, "line": "a\nb"}], "vllm[0].log[0].line: one line"),
    ([{"at": 10}], "vllm[0].log[0]"),
    ({"at": 10, "line": "x"}, "vllm[0].log"),
])
def test_bad_log_lines_name_the_key(log, message):
    with pytest.raises(ScenarioError, match=re.escape(message)):
        build(lambda d: d["vllm"][0].update(log=log))
