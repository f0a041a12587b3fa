"""Finding a vLLM server's processes and tagging GPU processes with their server."""
from __future__ import annotations

import logging

import pytest

from exporter.model import GpuSample, ProcessSample, VllmSample
from exporter.sources.hostview import ProcessInfo
from exporter.sources.vllm_endpoint import VllmEndpoint
from exporter.sources.vllm_procs import (
    PidFileError,
    ServerPids,
    assign_roles,
    is_local_host,
    read_pid_file,
    server_pids,
)


class FakeHost:
    """A HostView over a made-up process tree: {pid: (name, ppid, cgroup)}."""

    def __init__(self, processes, listeners=None):
        self.processes = processes
        self.listeners = listeners or {}
        self.lookups = 0

    def process(self, pid, with_cmdline=False):
        self.lookups += 1
        if pid not in self.processes:
            return None
        name, ppid, cgroup = self.processes[pid]
        return ProcessInfo(pid=pid, name=name, rss_bytes=None, start_time=None, ppid=ppid, cgroup=cgroup)

    def parent(self, pid):
        info = self.process(pid)
        return info.ppid if info else None

    def pid_listening_on(self, port):
        return self.listeners.get(port)

    def memory(self):
        return None


CGROUP_A = "0::/kubepods/pod1234/cri-containerd-aaaabbbbcccc.scope\n"
CGROUP_B = "0::/system.slice/docker-ddddeeeeffff.scope\n"
# Two V1 servers: API server -> EngineCore -> TP workers, plus an unrelated trainer.
TREE = {
    1: ("systemd", 0, ""),
    100: ("vllm", 1, CGROUP_A),
    101: ("VLLM::EngineCor", 100, CGROUP_A),
    102: ("VLLM::Worker_TP", 101, CGROUP_A),
    103: ("VLLM::Worker_TP", 101, CGROUP_A),
    200: ("python3", 1, CGROUP_B),
    201: ("VLLM::EngineCor", 200, CGROUP_B),
    300: ("train.py", 1, ""),
}


def host():
    return FakeHost(dict(TREE), listeners={8000: 100, 8001: 200})


def test_the_listener_is_the_servers_root():
    assert server_pids(VllmEndpoint("http://127.0.0.1:8000/metrics"), host()) == (100,)
    assert server_pids(VllmEndpoint("http://localhost:8001"), host()) == (200,)


def test_nobody_listening_or_remote_host():
    assert server_pids(VllmEndpoint("http://127.0.0.1:9999/metrics"), host()) == ()
    # a server on another machine is not our process, even if a local one shares the port
    assert server_pids(VllmEndpoint("http://192.0.2.10:8000/metrics"), host()) == ()


def test_pid_file_override(tmp_path):
    pid_file = tmp_path / "vllm.pid"
    pid_file.write_text("200\n")
    endpoint = VllmEndpoint("http://192.0.2.10:8000/metrics", pid_file=str(pid_file))
    assert server_pids(endpoint, host()) == (200,)


@pytest.mark.parametrize("content, reason", [
    (b"", "does not hold a PID"),
    (b"abc\n", "does not hold a PID"),
    (b"-5", "does not hold a PID"),
    (b"0", "out-of-range"),
    (b"99999999999", "out-of-range"),
    (b"1" * 200, "longer than"),
    (b"\xff\xfe", "does not hold a PID"),
])
def test_bad_pid_files(tmp_path, content, reason):
    pid_file = tmp_path / "vllm.pid"
    pid_file.write_bytes(content)
    with pytest.raises(PidFileError, match=reason):
        read_pid_file(str(pid_file))


def test_bad_pid_file_yields_no_pids_and_one_warning(tmp_path, caplog):
    endpoint = VllmEndpoint("http://127.0.0.1:8000/metrics", pid_file=str(tmp_path / "missing.pid"))
    resolve = ServerPids()  # what the sampling loop uses: it says each problem once
    with caplog.at_level(logging.WARNING):
        assert resolve(endpoint, host()) == ()
        assert resolve(endpoint, host()) == ()
    warnings = [r for r in caplog.records if "cannot read PID file" in r.getMessage()]
    assert len(warnings) == 1


def test_container_override_picks_candidates_in_that_cgroup():
    endpoint = VllmEndpoint("http://10.1.2.3:8000/metrics", container_id="aaaabbbbcccc")
    assert server_pids(endpoint, host(), candidates=[102, 103, 201, 300, 999]) == (102, 103)


def test_process_pattern_override():
    endpoint = VllmEndpoint("http://10.1.2.3:8000/metrics", process_pattern=r"^VLLM::")
    assert server_pids(endpoint, host(), candidates=[102, 201, 300]) == (102, 201)


def test_is_local_host():
    assert is_local_host("127.0.0.1") and is_local_host("localhost") and is_local_host("[::1]")
    assert is_local_host("0.0.0.0")
    assert not is_local_host("192.0.2.10") and not is_local_host("vllm.example.invalid")


def gpu(index, *pids):
    return GpuSample(index=index, uuid=f"GPU-{index}", total_bytes=80 * 2**30,
                     processes=tuple(ProcessSample(pid=p, used_bytes=2**30, role="vllm", endpoint="stale")
                                     for p in pids))


def test_assign_roles_tags_descendants_of_a_server_root_and_others():
    gpus = (gpu("0", 102, 300), gpu("1", 103, 201))
    samples = (VllmSample(endpoint="chat", up=True, pids=(100,)),
               VllmSample(endpoint="embed", up=False, pids=(200,)))
    tagged = assign_roles(gpus, samples, host())
    roles = {(g.index, p.pid): (p.role, p.endpoint) for g in tagged for p in g.processes}
    assert roles == {("0", 102): ("vllm", "chat"), ("0", 300): ("other", ""),
                     ("1", 103): ("vllm", "chat"), ("1", 201): ("vllm", "embed")}
    assert gpus[0].processes[1].endpoint == "stale"  # inputs are not mutated


def test_assign_roles_uses_the_parent_the_host_look_up_gave():
    """enrich() filled each GPU process's ppid: only ancestors above it are read again."""
    fake = host()
    gpus = (GpuSample(index="0", uuid="GPU-0", processes=(
        ProcessSample(pid=102, used_bytes=1, ppid=101), ProcessSample(pid=103, used_bytes=1, ppid=101),
        ProcessSample(pid=300, used_bytes=1, ppid=1))),)
    tagged = assign_roles(gpus, (VllmSample(endpoint="chat", up=True, pids=(100,)),), fake)
    assert [p.endpoint for p in tagged[0].processes] == ["chat", "chat", ""]
    assert fake.lookups == 1  # 101, the EngineCore; 102, 103 and 300 came with their parent


def test_assign_roles_finds_workers_spawned_after_the_pid_list():
    tree = dict(TREE)
    tree[104] = ("VLLM::Worker_TP", 101, CGROUP_A)  # new child, not in the sample's pids
    tagged = assign_roles((gpu("0", 104),), (VllmSample(endpoint="chat", up=True, pids=(100,)),),
                          FakeHost(tree))
    assert (tagged[0].processes[0].role, tagged[0].processes[0].endpoint) == ("vllm", "chat")


def test_assign_roles_survives_vanished_processes_and_parent_loops():
    tree = {500: ("a", 501, ""), 501: ("b", 500, "")}  # a corrupt tree must not hang us
    fake = FakeHost(tree)
    tagged = assign_roles((gpu("0", 500, 777),), (VllmSample(endpoint="x", up=True, pids=(1000,)),), fake)
    assert [p.role for p in tagged[0].processes] == ["other", "other"]
    assert fake.lookups <= 2 + 1  # parents are looked up once each per call


def test_assign_roles_reads_nothing_when_no_server_has_a_process():
    fake = host()
    tagged = assign_roles((gpu("0", 102, 300),), (VllmSample(endpoint="chat", up=False),), fake)
    assert [p.role for p in tagged[0].processes] == ["other", "other"]
    assert fake.lookups == 0
