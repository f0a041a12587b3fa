"""The `allocator` source: probe files in a shared directory, attached to NVML's processes.

Hostile files are real files (huge, truncated, mistyped, symlinks, FIFOs, stale); PID
namespaces are real ones where the machine allows unprivileged `unshare`.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from exporter.model import GpuSample, ProcessSample, Snapshot
from exporter.sources.allocator import MAX_FILE_BYTES, AllocatorSource, normalise_uuid
from exporter.sources.host import LocalHost

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
NOW = 1_700_000_000.0
NS = 4026532000  # the PID namespace of the containers in these tests
UUID0 = "a1000000-0000-0000-0000-000000000000"
UUID1 = "a1000000-0000-0000-0000-000000000001"


def probe_doc(pid=7, pid_ns=NS, start_time=NOW - 3600, written_at=NOW - 2, devices=None, **extra):
    doc = {"schema": 1, "probe_version": "0.1.0", "pid": pid, "pid_ns": pid_ns, "start_ticks": 123,
           "start_time": start_time, "written_at": written_at, "interval": 5.0, "seq": 9,
           "torch_version": "2.6.0", "backend": "native",
           "alloc_conf": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
           "errors": {"memory_stats": 1, "write": 2},
           "devices": devices if devices is not None else [device(UUID0)]}
    doc.update(extra)
    return doc


def device(uuid, reserved=12 * GiB, **extra):
    entry = {"index": 0, "uuid": uuid, "allocated_bytes": 10 * GiB, "reserved_bytes": reserved,
             "active_bytes": 10 * GiB, "inactive_split_bytes": GiB, "allocated_peak_bytes": 11 * GiB,
             "reserved_peak_bytes": 13 * GiB, "active_peak_bytes": 11 * GiB, "inactive_split_peak_bytes": 2 * GiB,
             "alloc_retries": 4, "ooms": 0, "device_allocs": 30, "device_frees": 3, "cumem_bytes": None}
    entry.update(extra)
    return entry


def write(directory: Path, doc, pid=7, pid_ns=NS) -> Path:
    path = directory / f"gpumem-{pid_ns}-{pid}.json"
    path.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    return path


def proc(pid=5000, ns_pid=7, start_time=NOW - 3600.4, used=14 * GiB):
    return ProcessSample(pid=pid, used_bytes=used, start_time=start_time, ns_pid=ns_pid, name="python3")


def gpus(*processes, uuid="GPU-" + UUID0):
    return (GpuSample(index="0", uuid=uuid, total_bytes=80 * GiB, processes=tuple(processes)),)


def sample(directory, gpu_samples, namespaces=None, **kw):
    namespaces = namespaces if namespaces is not None else {}
    source = AllocatorSource(str(directory), pid_namespace=lambda pid: namespaces.get(pid, NS), **kw)
    return source.collect(Snapshot(NOW, gpus=gpu_samples))


def stats_of(reading, gpu=0, index=0):
    return reading.snapshot.gpus[gpu].processes[index].allocator


def kinds(reading):
    return [e.kind for e in reading.errors]


def test_a_probed_process_gets_its_allocator_numbers(tmp_path):
    write(tmp_path, probe_doc())
    reading = sample(tmp_path, gpus(proc()))
    stats = stats_of(reading)
    assert (stats.allocated_bytes, stats.reserved_bytes, stats.inactive_split_bytes) == (10 * GiB, 12 * GiB, GiB)
    assert (stats.alloc_retries, stats.ooms, stats.device_allocs, stats.device_frees) == (4, 0, 30, 3)
    assert (stats.reserved_peak_bytes, stats.cumem_bytes) == (13 * GiB, None)
    assert stats.alloc_conf == (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),)
    assert stats.backend == "native" and stats.probe_errors == 3 and stats.written_at == NOW - 2
    assert reading.up and reading.errors == ()
    assert reading.snapshot.gpus[0].processes[0].used_bytes == 14 * GiB  # NVML's figure untouched


def test_each_gpu_gets_the_numbers_of_its_own_device(tmp_path):
    write(tmp_path, probe_doc(devices=[device(UUID0, reserved=GiB), device(UUID1.upper(), reserved=2 * GiB)]))
    two = (gpus(proc(), uuid="GPU-" + UUID1)[0], gpus(proc(), uuid="GPU-" + UUID0)[0],
           GpuSample(index="2", uuid="GPU-ffffffff-0000-0000-0000-000000000000", processes=(proc(),)))
    reading = sample(tmp_path, two)
    assert [stats_of(reading, g) and stats_of(reading, g).reserved_bytes for g in range(3)] == [2 * GiB, GiB, None]


def test_a_mig_instance_is_matched_by_its_own_uuid():
    assert normalise_uuid("MIG-" + UUID0.upper()) == normalise_uuid(UUID0) == normalise_uuid("GPU-" + UUID0)


def test_without_uuids_only_an_unambiguous_process_is_matched(tmp_path):
    write(tmp_path, probe_doc(devices=[device(None)]))
    assert stats_of(sample(tmp_path, gpus(proc()))).reserved_bytes == 12 * GiB
    spans_two = (gpus(proc())[0], GpuSample(index="1", uuid="GPU-" + UUID1, processes=(proc(),)))
    reading = sample(tmp_path, spans_two)
    assert stats_of(reading, 0) is None and stats_of(reading, 1) is None


def test_a_process_without_a_probe_is_left_as_it_was(tmp_path):
    reading = sample(tmp_path, gpus(proc()))
    assert reading.snapshot.gpus[0].processes[0] == proc() and reading.errors == () and reading.up


def test_outside_containers_the_host_pid_names_the_file(tmp_path):
    write(tmp_path, probe_doc(pid=5000), pid=5000)
    host_process = proc(pid=5000, ns_pid=None)
    assert stats_of(sample(tmp_path, gpus(host_process))).reserved_bytes == 12 * GiB


def test_a_reused_pid_never_gets_the_dead_processs_numbers(tmp_path):
    write(tmp_path, probe_doc(start_time=NOW - 3600))  # left by a killed process that had pid 7
    reading = sample(tmp_path, gpus(proc(start_time=NOW - 60)))  # a new process with pid 7
    assert stats_of(reading) is None and reading.errors == ()
    assert stats_of(sample(tmp_path, gpus(proc(start_time=None)))) is None  # start unknown: no guess


def test_two_containers_with_the_same_pid_and_start_are_told_apart_by_namespace(tmp_path):
    # Two replicas started in the same second: both workers are pid 7 in their own namespace.
    write(tmp_path, probe_doc(pid_ns=NS, devices=[device(UUID0, reserved=GiB)]), pid_ns=NS)
    write(tmp_path, probe_doc(pid_ns=NS + 1, devices=[device(UUID0, reserved=2 * GiB)]), pid_ns=NS + 1)
    a, b = proc(pid=5000), proc(pid=6000)
    reading = sample(tmp_path, gpus(a, b), namespaces={5000: NS, 6000: NS + 1})
    assert [p.allocator.reserved_bytes for p in reading.snapshot.gpus[0].processes] == [GiB, 2 * GiB]

    unreadable = sample(tmp_path, gpus(a, b), namespaces={5000: None, 6000: None})
    assert [p.allocator for p in unreadable.snapshot.gpus[0].processes] == [None, None]
    assert kinds(unreadable) == ["ambiguous", "ambiguous"]


def test_a_file_from_another_namespace_is_not_taken(tmp_path):
    write(tmp_path, probe_doc(pid_ns=NS + 1), pid_ns=NS + 1)
    assert stats_of(sample(tmp_path, gpus(proc()), namespaces={5000: NS})) is None


def test_the_namespace_is_read_once_per_process(tmp_path):
    write(tmp_path, probe_doc())
    looked = []
    source = AllocatorSource(str(tmp_path), pid_namespace=lambda pid: looked.append(pid) or NS)
    for _ in range(3):
        assert stats_of(source.collect(Snapshot(NOW, gpus=gpus(proc())))) is not None
    assert looked == [5000]


@pytest.mark.parametrize("written_at, kind", [(NOW - 16, "stale"), (NOW + 3600, "clock_skew")])
def test_a_file_not_rewritten_for_three_intervals_is_ignored(tmp_path, written_at, kind):
    write(tmp_path, probe_doc(written_at=written_at))
    reading = sample(tmp_path, gpus(proc()))
    assert stats_of(reading) is None and kinds(reading) == [kind]
    write(tmp_path, probe_doc(written_at=NOW - 14))
    assert stats_of(sample(tmp_path, gpus(proc()))) is not None


def test_a_huge_file_is_refused_unread(tmp_path):
    doc = json.dumps(probe_doc(padding="x" * MAX_FILE_BYTES)).encode()
    write(tmp_path, doc)
    reading = sample(tmp_path, gpus(proc()))
    assert stats_of(reading) is None and kinds(reading) == ["too_large"]


@pytest.mark.parametrize("data, kind", [
    (json.dumps(probe_doc()).encode()[:200], "bad_json"),  # caught mid-write by a careless writer
    (b"", "bad_json"),
    (b"\xff\xfe\x00garbage", "bad_json"),
    (b"[" * 60_000, "bad_json"),  # nesting deep enough to exhaust the parser's recursion
    (b"[1, 2]", "bad_schema"),
    (json.dumps(probe_doc(schema=2)).encode(), "unsupported_schema"),
    (json.dumps(probe_doc(pid="7")).encode(), "bad_schema"),
    (json.dumps(probe_doc(written_at="now")).encode(), "bad_schema"),
    (json.dumps(probe_doc(start_time=float("nan"))).encode(), "bad_schema"),  # Python's json reads NaN
    (json.dumps(probe_doc(devices={"0": {}})).encode(), "bad_schema"),
    (json.dumps(probe_doc(devices=[device(UUID0, reserved=True)])).encode(), "bad_schema"),
    (json.dumps(probe_doc(devices=[device(UUID0, reserved=-1)])).encode(), "bad_schema"),
    (json.dumps(probe_doc(devices=[device(UUID0, reserved=1 << 80)])).encode(), "bad_schema"),
    (json.dumps(probe_doc(devices=[device(7)])).encode(), "bad_schema"),
    (json.dumps(probe_doc(devices=[device(UUID0)] * 65)).encode(), "bad_schema"),
    (json.dumps(probe_doc(errors={"x": "many"})).encode(), "bad_schema"),
    (json.dumps(probe_doc(alloc_conf=["expandable_segments:True"])).encode(), "bad_schema"),
    (json.dumps({k: v for k, v in probe_doc().items() if k != "written_at"}).encode(), "bad_schema"),
    (json.dumps(probe_doc(pid=8)).encode(), "bad_schema"),  # the body names another process
])
def test_hostile_or_truncated_content_is_counted_never_raised(tmp_path, data, kind):
    write(tmp_path, data)
    reading = sample(tmp_path, gpus(proc()))
    assert stats_of(reading) is None and kinds(reading) == [kind]
    assert reading.up


def test_a_symlink_at_a_probe_files_name_is_never_followed(tmp_path):
    shared, outside = tmp_path / "shared", tmp_path / "outside"
    shared.mkdir()
    outside.mkdir()
    target = write(outside, probe_doc())  # would match, were the link followed
    (shared / target.name).symlink_to(target)
    reading = sample(shared, gpus(proc()))
    assert stats_of(reading) is None and kinds(reading) == ["symlink"]


@pytest.mark.parametrize("make", [os.mkfifo, os.mkdir])
def test_a_fifo_or_directory_at_a_probe_files_name_is_refused_without_blocking(tmp_path, make):
    make(tmp_path / f"gpumem-{NS}-7.json")
    reading = sample(tmp_path, gpus(proc()))
    assert stats_of(reading) is None and kinds(reading) == ["not_regular"]


def test_files_of_processes_not_on_a_gpu_are_never_opened(tmp_path):
    os.mkfifo(tmp_path / f"gpumem-{NS}-8.json")  # opening it would be reported as not_regular
    (tmp_path / f"gpumem-{NS}-9.json").write_bytes(b"{")
    (tmp_path / "notes.txt").write_text("not a probe file")
    write(tmp_path, probe_doc())
    reading = sample(tmp_path, gpus(proc()))
    assert stats_of(reading) is not None and reading.errors == ()


def test_a_flooded_directory_is_read_only_up_to_its_bound(tmp_path):
    for i in range(50):
        (tmp_path / f"junk-{i}").write_text("")
    reading = sample(tmp_path, gpus(proc()), max_entries=20)
    assert kinds(reading) == ["too_many_files"] and reading.up


def test_a_missing_directory_turns_the_source_down_and_keeps_the_processes(tmp_path):
    reading = sample(tmp_path / "missing", gpus(proc()))
    assert not reading.up and kinds(reading) == ["dir_missing"]
    assert reading.snapshot.gpus == gpus(proc())


# -- real PID namespaces: the probe in a container-like namespace, the source on the host --

STANDIN_TORCH = ROOT / "tests" / "fixtures" / "probe" / "standin_torch"
IN_NAMESPACE = """
import os, sys, time
import torch
import gpumem_probe
torch.cuda.init()
torch.cuda.set_stats(0, reserved=int(sys.argv[1]), device_allocs=1)
gpumem_probe.register()
deadline = time.monotonic() + 120
# Its own file, by its PID namespace too: the other container's probe is PID 1 as well.
own = f"gpumem-{os.stat('/proc/self/ns/pid').st_ino}-{os.getpid()}.json"
while own not in os.listdir(os.environ["GPUMEM_PROBE_DIR"]):
    if time.monotonic() > deadline:
        raise SystemExit("no probe file")
    time.sleep(0.02)
print(os.getpid(), flush=True)
sys.stdin.read()  # stay alive until the test is done
"""


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-Urpf", "--mount-proc", "true"], capture_output=True, check=False)
    return done.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="no unprivileged PID namespaces on this machine")
@pytest.mark.integration
def test_probes_in_two_pid_namespaces_with_the_same_pid_are_each_matched_to_their_host_process(tmp_path):
    # (The file is written at start; an interval of seconds keeps it fresh however slow the start.)
    env = dict(os.environ, GPUMEM_PROBE_DIR=str(tmp_path), GPUMEM_PROBE_INTERVAL="5",
               PYTHONPATH=os.pathsep.join([str(STANDIN_TORCH), str(ROOT / "probe")]))
    containers = [subprocess.Popen(["unshare", "-Urpf", "--mount-proc", sys.executable, "-c", IN_NAMESPACE,
                                    str(n * GiB)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True) for n in (1, 2)]
    try:
        inner_pids = [int(c.stdout.readline()) for c in containers]
        host_pids = [psutil.Process(c.pid).children()[0].pid for c in containers]
        assert inner_pids == [1, 1] and host_pids[0] != host_pids[1]
        host = LocalHost()
        processes = []
        for pid in host_pids:
            info = host.process(pid)
            assert info.ns_pid == 1  # NSpid's innermost field
            processes.append(ProcessSample(pid=pid, used_bytes=3 * GiB, start_time=info.start_time,
                                           ns_pid=info.ns_pid))
        source = AllocatorSource(str(tmp_path))  # the real /proc: namespaces read by readlink
        reading = source.collect(Snapshot(time.time(), gpus=gpus(*processes)))
        assert reading.errors == ()
        assert [p.allocator.reserved_bytes for p in reading.snapshot.gpus[0].processes] == [GiB, 2 * GiB]
    finally:
        for c in containers:
            c.stdin.close()
            c.wait(timeout=120)
    assert list(tmp_path.iterdir()) == []  # each probe removed its file on exit


def test_a_copy_planted_under_namespace_0_does_not_hide_the_real_file(tmp_path):
    """#21 L9: anyone who can write the directory can copy a process's file under pid namespace
    0 ("the probe could not read it"); where the process's own namespace is known, its file in
    that namespace wins and the copy is ignored."""
    write(tmp_path, probe_doc(devices=[device(UUID0, reserved=12 * GiB)]))
    write(tmp_path, probe_doc(pid_ns=0, devices=[device(UUID0, reserved=GiB)]), pid_ns=0)  # the planted copy
    reading = sample(tmp_path, gpus(proc()))
    assert stats_of(reading).reserved_bytes == 12 * GiB and reading.errors == ()
    # A probe that really could not read its namespace (only the 0 file) is still matched.
    (tmp_path / f"gpumem-{NS}-7.json").unlink()
    assert stats_of(sample(tmp_path, gpus(proc()))).reserved_bytes == GiB
