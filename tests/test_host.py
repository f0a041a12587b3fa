"""LocalHost against the real /proc of this machine, with real child processes."""
import os
import socket
import subprocess
import sys
import time

import pytest

from exporter.model import GpuSample, ProcessSample
from exporter.sources.host import LocalHost, enrich


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"  # exec finished: name and RSS are the child's own
    yield proc
    proc.kill()
    proc.wait()


def test_process_identity(child):
    info = LocalHost().process(child.pid)
    assert info.pid == child.pid
    assert info.name.startswith("python")
    assert info.rss_bytes > 1 << 20
    assert abs(info.start_time - time.time()) < 60
    assert info.ppid == os.getpid()
    assert info.cgroup  # every Linux process is in some cgroup
    assert info.cmdline == ""  # not read unless asked


def test_cmdline_only_when_asked(child):
    assert "time.sleep" in LocalHost().process(child.pid, with_cmdline=True).cmdline


def test_vanished_process_is_none(child):
    pid = child.pid
    child.kill()
    child.wait()
    assert LocalHost().process(pid) is None
    assert LocalHost().descendants(pid) == []


def test_descendants():
    parent = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(60)' & wait"])
    try:
        host = LocalHost()
        deadline = time.time() + 5
        while not host.descendants(parent.pid) and time.time() < deadline:
            time.sleep(0.05)
        kids = host.descendants(parent.pid)
        assert len(kids) == 1 and host.process(kids[0]).name.startswith("python")
    finally:
        for pid in LocalHost().descendants(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()


def test_pid_listening_on():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        assert LocalHost().pid_listening_on(sock.getsockname()[1]) == os.getpid()
    finally:
        sock.close()


def test_host_memory():
    mem = LocalHost().memory()
    assert 0 < mem.available_bytes <= mem.total_bytes
    if os.path.exists("/proc/vmstat"):
        assert mem.oom_kills is not None and mem.oom_kills >= 0


def test_enrich_fills_identity_and_keeps_vanished(child):
    gpus = (GpuSample(index="0", uuid="GPU-x", processes=(
        ProcessSample(pid=child.pid, used_bytes=100), ProcessSample(pid=2**22 + 7, used_bytes=5))),)
    out = enrich(gpus, LocalHost())
    alive, gone = out[0].processes
    assert alive.name.startswith("python") and alive.host_rss_bytes and alive.start_time
    assert alive.identity == (child.pid, alive.start_time)
    assert gone == gpus[0].processes[1]  # exited before we looked: what NVML said is kept
