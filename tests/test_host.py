"""LocalHost against the real /proc of this machine, with real child processes."""
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
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


@pytest.mark.integration
def test_a_script_run_through_its_shebang_is_named_in_full(tmp_path):
    """The kernel cuts comm at 15 characters, and psutil extends a cut name from argv[0] only.
    For a script run through its shebang argv[0] is the interpreter and argv[1] the script, so a
    notebook server was named `jupyter-noteboo`. Its name is now the script's file name."""
    script = tmp_path / "jupyter-notebook-lab"
    script.write_text(f"#!{sys.executable}\nimport sys, time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    script.chmod(0o755)
    proc = subprocess.Popen([str(script), "--token=secret"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == "jupyter-noteboo"
        assert LocalHost().process(proc.pid).name == "jupyter-notebook-lab"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.integration
def test_process_identity(child):
    info = LocalHost().process(child.pid)
    assert info.pid == child.pid
    assert info.name.startswith("python")
    assert info.rss_bytes > 1 << 20
    assert abs(info.start_time - time.time()) < 60
    assert info.ppid == os.getpid()
    assert info.parent_name == psutil.Process().name()  # this test's own process started it
    assert info.cgroup  # every Linux process is in some cgroup
    assert info.cmdline == ""  # not read unless asked


@pytest.mark.integration
def test_cmdline_only_when_asked(child):
    assert "time.sleep" in LocalHost().process(child.pid, with_cmdline=True).cmdline


@pytest.mark.integration
def test_vanished_process_is_none(child):
    pid = child.pid
    child.kill()
    child.wait()
    assert LocalHost().process(pid) is None


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


@pytest.mark.integration
def test_enrich_fills_identity_and_keeps_vanished(child):
    gpus = (GpuSample(index="0", uuid="GPU-x", processes=(
        ProcessSample(pid=child.pid, used_bytes=100), ProcessSample(pid=2**22 + 7, used_bytes=5))),)
    out = enrich(gpus, LocalHost())
    alive, gone = out[0].processes
    assert alive.name.startswith("python") and alive.host_rss_bytes and alive.start_time
    assert alive.identity == (child.pid, alive.start_time)
    assert gone == gpus[0].processes[1]  # exited before we looked: what NVML said is kept


# -- a known process is cheap, a reused PID is a new process -----------------------------------
_opened: list[str] | None = None  # /proc paths opened or listed while a test records them


def _record_proc_reads(event, args):
    if _opened is not None and event in ("open", "os.listdir") and isinstance(args[0], str) \
            and args[0].startswith("/proc"):
        _opened.append(args[0])


sys.addaudithook(_record_proc_reads)  # audit hooks stay for the interpreter's life: it records when asked


def _opens_during(call) -> list[str]:
    global _opened
    _opened = []
    try:
        call()
        return _opened
    finally:
        _opened = None


@pytest.mark.integration
def test_a_known_process_costs_two_small_reads_per_tick(child):
    host = LocalHost()
    first = _opens_during(lambda: host.process(child.pid))
    assert f"/proc/{child.pid}/cgroup" in first and f"/proc/{child.pid}/status" in first
    again = _opens_during(lambda: host.process(child.pid))
    assert sorted(again) == [f"/proc/{child.pid}/stat", f"/proc/{child.pid}/statm"]


@pytest.mark.integration
def test_rss_is_read_fresh_every_tick():
    grower = subprocess.Popen([sys.executable, "-c", "import sys\nx = []\nfor line in sys.stdin:\n"
                               "    x.append(bytearray(64 << 20)); print('ok', flush=True)"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        host = LocalHost()
        grower.stdin.write("grow\n")
        grower.stdin.flush()
        assert grower.stdout.readline() == "ok\n"
        before = host.process(grower.pid).rss_bytes
        grower.stdin.write("grow\n")
        grower.stdin.flush()
        assert grower.stdout.readline() == "ok\n"
        assert host.process(grower.pid).rss_bytes - before >= 60 << 20
    finally:
        grower.kill()
        grower.wait()


class FakeProc:
    """A /proc-shaped tree that psutil and LocalHost read (psutil.PROCFS_PATH, as for /host/proc)."""

    def __init__(self, root):
        self.root = root
        (root / "stat").write_text("cpu  1 2 3 4\nbtime 1700000000\n")

    def put(self, pid, name, starttime, ppid=1, cgroup="0::/system.slice/a.service\n", rss_pages=256, utime=1,
            stime=1):
        d = self.root / str(pid)
        d.mkdir(exist_ok=True)
        rest = " ".join(["0"] * 40)
        # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
        # cutime cstime priority nice threads itrealvalue starttime ...
        (d / "stat").write_text(f"{pid} ({name}) S {ppid} 1 1 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 1 0 "
                                f"{starttime} {rest}\n")
        (d / "statm").write_text(f"1000 {rss_pages} 10 1 0 100 0\n")
        (d / "cgroup").write_text(cgroup)
        (d / "status").write_text(f"Name:\t{name}\nNSpid:\t{pid}\t7\n")
        (d / "cmdline").write_bytes(name.encode() + b"\0")


@pytest.fixture
def fake_proc(tmp_path, monkeypatch):
    import psutil
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(tmp_path))  # as runtime.open_host sets it
    clock = [0.0]
    proc = FakeProc(tmp_path)
    return proc, LocalHost(monotonic=lambda: clock[0]), clock


def test_cpu_seconds_sums_the_processes_and_is_none_once_one_is_gone(fake_proc):
    proc, host, _ = fake_proc
    ticks = os.sysconf("SC_CLK_TCK")
    proc.put(6000, "python", starttime=100, utime=3 * ticks, stime=ticks)
    proc.put(6001, "VLLM::Worker", starttime=100, ppid=6000, utime=10 * ticks, stime=2 * ticks)
    assert host.cpu_seconds([6000, 6001]) == pytest.approx(16.0)
    proc.put(6001, "VLLM::Worker", starttime=100, ppid=6000, utime=11 * ticks, stime=2 * ticks)
    assert host.cpu_seconds([6000, 6001]) == pytest.approx(17.0)  # read afresh each time
    shutil.rmtree(proc.root / "6001")
    assert host.cpu_seconds([6000, 6001]) is None


def test_a_known_process_s_parent_is_answered_without_a_read(child):
    host = LocalHost()
    assert host.process(child.pid).ppid == os.getpid()
    assert _opens_during(lambda: host.parent(child.pid)) == []
    assert host.parent(child.pid) == os.getpid()
    unknown = LocalHost()
    assert unknown.parent(child.pid) == os.getpid()  # read, then known


def test_a_reused_pid_is_read_afresh(fake_proc):
    proc, host, _ = fake_proc
    ticks = os.sysconf("SC_CLK_TCK")
    proc.put(4242, "vllm", starttime=100 * ticks, cgroup="0::/system.slice/docker-aaaa.scope\n")
    first = host.process(4242)
    assert (first.name, first.start_time, first.ns_pid) == ("vllm", 1_700_000_100, 7)
    proc.put(4242, "notebook", starttime=900 * ticks, cgroup="0::/user.slice/b.scope\n", rss_pages=512)
    second = host.process(4242)
    assert second.start_time == 1_700_000_900 and second.name == "notebook"
    assert second.cgroup == "0::/user.slice/b.scope\n" and second.rss_bytes == 512 * os.sysconf("SC_PAGE_SIZE")


def test_name_and_parent_are_refreshed_cgroup_is_kept(fake_proc):
    from exporter.sources.host import IDENTITY_REFRESH_SECONDS
    proc, host, clock = fake_proc
    proc.put(5000, "python3", starttime=500, ppid=10)
    assert (host.process(5000).name, host.process(5000).ppid) == ("python3", 10)
    proc.put(5000, "VLLM::Worker", starttime=500, ppid=1, cgroup="0::/elsewhere\n")  # same process
    clock[0] += IDENTITY_REFRESH_SECONDS - 1
    assert host.process(5000).name == "python3"  # not re-read on every tick
    clock[0] += 1
    info = host.process(5000)
    assert (info.name, info.ppid) == ("VLLM::Worker", 1)
    assert info.cgroup == "0::/system.slice/a.service\n"  # a process keeps its cgroup for life


def test_the_parents_name_is_read_with_the_process_and_refreshed_with_it(fake_proc):
    """A notebook's kernel is a "python3": what started it says what it is."""
    from exporter.sources.host import IDENTITY_REFRESH_SECONDS
    proc, host, clock = fake_proc
    proc.put(5201, "jupyter-noteboo", starttime=400)
    proc.put(5230, "python3", starttime=500, ppid=5201)
    assert host.process(5230).parent_name == "jupyter-noteboo"
    proc.put(5230, "python3", starttime=500, ppid=77)  # re-parented: its parent exited
    clock[0] += IDENTITY_REFRESH_SECONDS
    assert host.process(5230).parent_name == ""  # 77 is no process: unknown, never a guess
    proc.put(77, "systemd", starttime=1)
    clock[0] += IDENTITY_REFRESH_SECONDS
    assert host.process(5230).parent_name == "systemd"


def test_a_name_read_from_the_command_line_is_bounded(fake_proc):
    """Where comm is cut at 15 characters psutil takes the name from the command line, which a
    process sets to what it likes: a name is a label value and a finding's words, never 100 KB."""
    from exporter.sources.hostview import MAX_NAME_CHARS
    proc, host, _ = fake_proc
    proc.put(6000, "x" * 100_000, starttime=600, ppid=6001)
    proc.put(6001, "y" * 100_000, starttime=500)
    info = host.process(6000)
    assert info.name == "x" * MAX_NAME_CHARS and info.parent_name == "y" * MAX_NAME_CHARS


def test_processes_not_asked_about_are_forgotten(fake_proc):
    from exporter.sources.host import FORGET_AFTER_SECONDS
    proc, host, clock = fake_proc
    proc.put(6000, "a", starttime=600)
    host.process(6000)
    proc.put(6000, "a", starttime=600, cgroup="0::/moved\n")
    clock[0] += FORGET_AFTER_SECONDS + 1
    host.process(1)  # any look-up sweeps
    assert host.process(6000).cgroup == "0::/moved\n"  # forgotten, so read as new
    shutil.rmtree(proc.root / "6000")
    assert host.process(6000) is None


def test_the_largest_processes_are_found_by_a_walk_now_and_then(fake_proc):
    """Unified memory: any host process takes from the GPU, so the largest are read (#19 item 1).
    One walk of /proc at most every TOP_RESCAN_SECONDS; in between, only their RSS is read."""
    from exporter.sources.host import TOP_RESCAN_SECONDS
    proc, host, clock = fake_proc
    page = os.sysconf("SC_PAGE_SIZE")
    for pid, name, pages in ((100, "sshd", 300), (200, "chrome", 5000), (300, "vllm", 4000), (400, "cron", 10)):
        proc.put(pid, name, starttime=pid, rss_pages=pages)
    (proc.root / "500").mkdir()  # a kernel thread: an empty statm
    (proc.root / "500" / "statm").write_text("0 0 0 0 0 0 0\n")
    assert [(i.name, i.rss_bytes) for i in host.top_processes(2)] == [("chrome", 5000 * page), ("vllm", 4000 * page)]
    proc.put(100, "sshd", starttime=100, rss_pages=9000)  # grows past both
    proc.put(200, "chrome", starttime=200, rss_pages=6000)
    assert [(i.name, i.rss_bytes) for i in host.top_processes(2)] == [("chrome", 6000 * page), ("vllm", 4000 * page)]
    clock[0] += TOP_RESCAN_SECONDS
    assert [i.name for i in host.top_processes(2)] == ["sshd", "chrome"]


def test_the_host_source_reads_the_largest_processes_only_where_a_gpu_shares_host_memory():
    from exporter.model import Snapshot
    from exporter.sources.host import HostSource

    class Host:
        asked = 0

        def memory(self):
            return None

        def process(self, pid, with_cmdline=False):
            return None

        def top_processes(self, limit):
            Host.asked += 1
            from exporter.sources.hostview import ProcessInfo
            return (ProcessInfo(pid=7300, name="chrome", rss_bytes=5 << 30, start_time=1.0, ppid=1),)

    source = HostSource(Host())
    discrete = source.collect(Snapshot(0.0, gpus=(GpuSample(index="0", uuid="a"),))).snapshot
    assert discrete.host_processes == () and Host.asked == 0
    unified = source.collect(Snapshot(0.0, gpus=(GpuSample(index="0", uuid="b", unified=True),))).snapshot
    [chrome] = unified.host_processes
    assert (chrome.pid, chrome.name, chrome.host_rss_bytes, chrome.used_bytes) == (7300, "chrome", 5 << 30, None)


# -- which process listens on a port ----------------------------------------------------------
LISTENER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("ready", flush=True)
sys.stdin.read()
"""


def _listen(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", LISTENER, str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fd_dirs_listed(call) -> set[str]:
    return {p for p in _opens_during(call) if p.endswith("/fd")}


@pytest.mark.integration
def test_a_known_listener_is_confirmed_from_its_own_sockets_and_a_restart_is_found():
    from exporter.sources.host import LISTENER_RESCAN_SECONDS
    clock = [0.0]
    host = LocalHost(listener_cache_seconds=30, monotonic=lambda: clock[0])
    port = _free_port()
    first = _listen(port)
    second = None
    try:
        walked = _fd_dirs_listed(lambda: host.pid_listening_on(port))  # the first look walks every process
        assert f"/proc/{first.pid}/fd" in walked and f"/proc/{os.getpid()}/fd" in walked
        assert host.pid_listening_on(port) == first.pid
        clock[0] += 10
        assert _fd_dirs_listed(lambda: host.pid_listening_on(port)) == set()  # within the TTL
        clock[0] += 25
        listed = _fd_dirs_listed(lambda: host.pid_listening_on(port))
        assert listed == {f"/proc/{first.pid}/fd"}  # confirmed from its own sockets only
        clock[0] += 35
        assert _fd_dirs_listed(lambda: host.pid_listening_on(port)) == set()  # the same socket: one readlink
        assert host.pid_listening_on(port) == first.pid
        first.kill()
        first.wait()
        second = _listen(port)  # the server restarts on the same port
        clock[0] += LISTENER_RESCAN_SECONDS
        assert host.pid_listening_on(port) == second.pid
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait()


@pytest.mark.integration
def test_a_port_nobody_listens_on_is_not_rescanned_every_tick():
    clock = [0.0]
    host = LocalHost(listener_cache_seconds=30, monotonic=lambda: clock[0])
    port = _free_port()
    assert host.pid_listening_on(port) is None
    clock[0] += 5
    assert _fd_dirs_listed(lambda: host.pid_listening_on(port)) == set()
    late = _listen(port)
    try:
        clock[0] += 25
        assert host.pid_listening_on(port) == late.pid  # found at the next whole-table walk
    finally:
        late.kill()
        late.wait()
