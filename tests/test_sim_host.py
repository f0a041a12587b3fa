"""SimulatedHost: the HostView answers for a scenario's made-up processes."""
from __future__ import annotations

import copy
import re

import pytest

from exporter.clock import FixedClock
from exporter.model import HostMemory
from exporter.sim import fake_nvml as nv
from exporter.sim import scenario as sc
from exporter.sim.host import SimulatedHost
from exporter.sources.hostview import ProcessInfo

GiB, MiB = 2**30, 2**20
START = 1_700_000_000.0
CONTAINER = "3f1c" + "0" * 56 + "beef"
POD = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"

DOC = {
    "name": "host-test", "description": "host test", "duration": 3600,
    "gpus": [{"memory": "80GiB"}],
    "host": {"memory": "256GiB", "available": [{"constant": "200GiB"}, {"linear": {"rate": "-1GiB/min"}}],
             "psi_some": {"linear": {"rate": "1/min"}}, "psi_full": 0.5,
             "oom_kills": {"staircase": {"every": 600, "step": 1}}},
    "processes": [
        {"pid": 100, "name": "vllm", "cmdline": "vllm serve m --api-key sk-secret", "rss": "1GiB"},
        {"pid": 110, "ppid": 100, "name": "VLLM::EngineCor", "rss": "2GiB"},
        {"pid": 120, "ppid": 110, "name": "VLLM::Worker_TP", "gpu": 0, "memory": "5GiB",
         "rss": [{"constant": "3GiB"}, {"linear": {"rate": "1MiB/s"}}], "start": 10, "stop": 500},
        {"pid": 200, "name": "python3", "container": CONTAINER, "pod_uid": POD, "namespace": "ml",
         "ns_pid": 7, "rss": "1GiB"},
        {"pid": 201, "name": "python3", "container": CONTAINER, "pod_uid": POD, "qos": "guaranteed", "rss": "1GiB"},
        {"pid": 202, "name": "python3", "container": CONTAINER, "rss": "1GiB"},
        {"pid": 300, "ppid": 301, "name": "loop-a", "rss": 1},
        {"pid": 301, "ppid": 300, "name": "loop-b", "rss": 1},
    ],
    "vllm": [{"port": 8000, "pid": 100, "model": "m",
              "cache_config": {"gpu_memory_utilization": 0.9, "num_gpu_blocks": 100}}],
}


@pytest.fixture
def env():
    clock = FixedClock(START, 60.0)
    return SimulatedHost(sc.from_dict(copy.deepcopy(DOC)), clock), clock


def test_process_info(env):
    host, _ = env
    info = host.process(120)
    assert isinstance(info, ProcessInfo)
    assert (info.pid, info.name, info.ppid) == (120, "VLLM::Worker_TP", 110)
    assert info.start_time == START + 10
    assert info.rss_bytes == 3 * GiB + 50 * MiB  # 50 s into its own life at 1 MiB/s
    assert info.cmdline == ""  # only read when asked for
    assert info.cgroup == "0::/user.slice/user-1000.slice/session-2.scope\n"


def test_cmdline_only_when_asked(env):
    host, _ = env
    assert host.process(100, with_cmdline=True).cmdline == "vllm serve m --api-key sk-secret"
    assert host.process(100).cmdline == ""


def test_dead_and_unknown_processes_are_none(env):
    host, clock = env
    clock.at = 5
    assert host.process(120) is None  # not started yet
    clock.at = 500
    assert host.process(120) is None  # exited
    assert host.process(99999) is None


def test_kubernetes_cgroup_shapes(env):
    host, _ = env
    uid = POD.replace("-", "_")
    burstable = host.process(200)
    assert burstable.cgroup == (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice"
                                f"/cri-containerd-{CONTAINER}.scope\n")
    assert burstable.ns_pid == 7
    guaranteed = host.process(201).cgroup
    assert guaranteed == f"0::/kubepods.slice/kubepods-pod{uid}.slice/cri-containerd-{CONTAINER}.scope\n"
    assert host.process(202).cgroup == f"0::/system.slice/docker-{CONTAINER}.scope\n"
    # The container id can be read back with the usual pattern.
    assert re.search(r"([0-9a-f]{64})\.scope", burstable.cgroup).group(1) == CONTAINER


def test_pid_listening_on_the_port_its_fake_server_bound(env):
    host, _ = env
    host.alias_port(41234, 8000)  # the fake vLLM server of the scenario's port 8000 bound 41234
    assert host.pid_listening_on(41234) == 100
    assert host.pid_listening_on(9999) is None


def test_the_scenario_port_itself_is_nobody_s(env):
    """The port the scenario file names is a number in a file: a real vLLM may listen on it
    (defect 1 of #18: a real endpoint on 8000 took the simulated server's processes)."""
    host, _ = env
    assert host.pid_listening_on(8000) is None
    host.alias_port(41234, 8000)
    assert host.pid_listening_on(8000) is None


def test_listener_follows_a_restart_on_the_same_port():
    host = SimulatedHost(sc.load("stale-memory"), clock := FixedClock(START, 300))
    host.alias_port(41234, 8000)
    assert host.pid_listening_on(41234) == 4100
    clock.at = 700
    assert host.pid_listening_on(41234) is None
    clock.at = 1000
    assert host.pid_listening_on(41234) == 4300
    assert host.process(4350).ppid == 4300


def test_memory(env):
    host, clock = env
    clock.at = 600
    mem = host.memory()
    assert mem == HostMemory(total_bytes=256 * GiB, available_bytes=190 * GiB,
                             psi_some_avg10=10.0, psi_full_avg10=0.5, oom_kills=1)


def test_host_and_fake_nvml_share_one_timeline():
    scenario = sc.load("stale-memory")
    clock = FixedClock(START, 599)
    host = SimulatedHost(scenario, clock)
    nv.configure(scenario, clock)
    try:
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses_v3(h)] == [4150]
        assert host.process(4150) is not None
        clock.at = 600
        assert nv.nvmlDeviceGetComputeRunningProcesses_v3(h) == []
        assert host.process(4150) is None
        assert nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2).used == 20 * GiB
    finally:
        nv.configure(None, None)


def test_a_real_endpoint_on_the_scenario_s_port_takes_none_of_its_processes():
    """#18 defect 1, end to end as a user meets it: `--simulate steady` (its server on port 8000)
    beside `--vllm-endpoint http://127.0.0.1:8000/metrics`, whether or not anything answers
    there. The simulated server keeps its processes; the real endpoint gets none of them."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "exporter", "snapshot", "--simulate", "steady", "--at", "600",
                          "--vllm-endpoint", "http://127.0.0.1:8000/metrics", "--format", "json"],
                         capture_output=True, text=True, timeout=120, check=True)
    snapshot = json.loads(out.stdout)["snapshot"]
    owners = {p["pid"]: p["endpoint"] for g in snapshot["gpus"] for p in g["processes"]}
    assert owners == {2201: "sim-0", 2202: "sim-0"}
    servers = {v["endpoint"]: v["pids"] for v in snapshot["vllm"]}
    assert servers == {"sim-0": [2100], "http://127.0.0.1:8000/metrics": []}
