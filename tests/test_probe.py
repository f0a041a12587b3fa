"""The allocator probe (probe/), in this process, against a stand-in `torch.cuda`.

The probe's thread is exercised in tests/test_probe_process.py with real processes; here each
test drives `Probe.poll()` directly, so nothing waits on time.
"""
import importlib.util
import itertools
import json
import os
import sys
import threading
import types
from functools import partial
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "probe"))  # the probe is its own distribution: test its source tree

import gpumem_probe  # noqa: E402
from gpumem_probe.files import ProbeFile  # noqa: E402
from gpumem_probe.identity import file_name  # noqa: E402
from gpumem_probe.probe import MAX_SETTING_CHARS, Probe, initialised_cuda, interval_from  # noqa: E402

STANDIN_CUDA = ROOT / "tests" / "fixtures" / "probe" / "standin_torch" / "torch" / "cuda.py"
_names = itertools.count()
GiB = 1 << 30


@pytest.fixture
def cuda():
    """A fresh stand-in torch.cuda module per test (its state is module-level, like torch's)."""
    spec = importlib.util.spec_from_file_location(f"standin_cuda_{next(_names)}", STANDIN_CUDA)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def modules(cuda):
    """What the probe looks at instead of sys.modules: a process that imported torch."""
    return {"torch": types.SimpleNamespace(cuda=cuda, __version__="2.6.0+cu124")}


def make_probe(directory, modules, **kw):
    kw.setdefault("clock", lambda: 1_700_000_000.0)
    return Probe(str(directory), 5.0, cuda=partial(initialised_cuda, modules), modules=modules, **kw)


def the_file(directory) -> Path:
    files = [p for p in Path(directory).iterdir()]
    assert len(files) == 1, files
    return files[0]


def test_nothing_is_written_nor_cuda_touched_until_the_process_initialises_it(tmp_path, cuda, modules):
    probe = make_probe(tmp_path, modules)
    assert probe.poll() is False
    assert probe.poll() is False
    assert list(tmp_path.iterdir()) == []
    assert set(cuda.calls) == {"is_initialized"}  # no init, no stats, no properties

    cuda.init()  # the process does it (vLLM's worker), not the probe
    assert probe.poll() is True
    assert the_file(tmp_path).name == file_name(probe.document(cuda)["pid_ns"], os.getpid())


def test_a_process_without_torch_is_left_alone(tmp_path):
    probe = make_probe(tmp_path, {})
    assert probe.poll() is False
    assert list(tmp_path.iterdir()) == []


def test_the_file_names_the_process_and_carries_every_allocator_number(tmp_path, cuda, modules):
    cuda.reset(devices=3, initialised=True)
    cuda.set_device(0)
    cuda.set_stats(0, allocated=10 * GiB, reserved=12 * GiB, active=11 * GiB, inactive_split=GiB,
                   allocated_peak=14 * GiB, reserved_peak=15 * GiB, active_peak=14 * GiB, inactive_split_peak=2 * GiB,
                   alloc_retries=3, ooms=1, device_allocs=40, device_frees=7)
    cuda.set_stats(2, reserved=2 * GiB, allocated=GiB, device_allocs=2)  # device 1: visible, unused
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    probe = make_probe(tmp_path, modules, settings=settings)
    assert probe.poll()
    doc = json.loads(the_file(tmp_path).read_bytes())

    me = psutil.Process()
    assert doc["schema"] == 1 and doc["probe_version"] == gpumem_probe.__version__
    assert doc["pid"] == os.getpid()
    assert doc["pid_ns"] == int(os.readlink("/proc/self/ns/pid")[5:-1])
    assert abs(doc["start_time"] - me.create_time()) <= 1.0  # the host's own view of the start
    assert isinstance(doc["start_ticks"], int)
    assert doc["written_at"] == 1_700_000_000.0 and doc["interval"] == 5.0 and doc["seq"] == 1
    assert doc["torch_version"] == "2.6.0+cu124" and doc["backend"] == "native"
    assert doc["alloc_conf"] == settings
    assert doc["errors"] == dict.fromkeys(doc["errors"], 0)
    assert [d["index"] for d in doc["devices"]] == [0, 2]
    first = doc["devices"][0]
    assert first == {
        "index": 0, "uuid": "a1000000-0000-0000-0000-000000000000",
        "allocated_bytes": 10 * GiB, "allocated_peak_bytes": 14 * GiB,
        "reserved_bytes": 12 * GiB, "reserved_peak_bytes": 15 * GiB,
        "active_bytes": 11 * GiB, "active_peak_bytes": 14 * GiB,
        "inactive_split_bytes": GiB, "inactive_split_peak_bytes": 2 * GiB,
        "alloc_retries": 3, "ooms": 1, "device_allocs": 40, "device_frees": 7, "cumem_bytes": None}
    assert doc["devices"][1]["uuid"] == "a1000000-0000-0000-0000-000000000002"
    assert doc["devices"][1]["reserved_bytes"] == 2 * GiB

    assert probe.poll()
    assert json.loads(the_file(tmp_path).read_bytes())["seq"] == 2
    assert cuda.calls["get_device_properties"] == 2  # once per device, then remembered


def test_a_stat_an_older_torch_lacks_is_null_never_made_up(tmp_path, cuda, modules):
    cuda.reset(devices=1, initialised=True)
    cuda.set_stats(0, reserved=GiB)
    original = cuda.memory_stats
    cuda.memory_stats = lambda d: {k: v for k, v in original(d).items() if k != "num_device_alloc"}
    probe = make_probe(tmp_path, modules)
    assert probe.poll()
    device = json.loads(the_file(tmp_path).read_bytes())["devices"][0]
    assert device["device_allocs"] is None and device["reserved_bytes"] == GiB


def test_an_exception_inside_memory_stats_is_contained_and_counted(tmp_path, cuda, modules):
    cuda.reset(devices=2, initialised=True)
    cuda.set_stats(1, reserved=GiB, device_allocs=1)
    cuda.fail_memory_stats(1)
    probe = make_probe(tmp_path, modules)
    assert probe.poll()
    doc = json.loads(the_file(tmp_path).read_bytes())
    assert [d["index"] for d in doc["devices"]] == [0]  # the other device is still reported
    assert doc["errors"]["memory_stats"] == 1
    assert probe.poll()
    assert json.loads(the_file(tmp_path).read_bytes())["errors"]["memory_stats"] == 2


def test_device_properties_failing_leaves_the_uuid_unknown_and_counts(tmp_path, cuda, modules):
    cuda.reset(devices=1, initialised=True)
    cuda.fail_device_properties()
    probe = make_probe(tmp_path, modules)
    assert probe.poll()
    doc = json.loads(the_file(tmp_path).read_bytes())
    assert doc["devices"][0]["uuid"] is None and doc["errors"]["device_properties"] == 1


def test_vllm_sleep_mode_pool_is_reported_per_device(tmp_path, cuda, modules):
    cuda.reset(devices=2, initialised=True)
    cuda.set_stats(1, reserved=8 * GiB, device_allocs=3)
    data = types.SimpleNamespace
    allocator = data(pointer_to_data={
        0x1000: data(handle=(0, 2 * GiB, 0x1000, 1), tag="weights"),
        0x2000: data(handle=(0, 3 * GiB, 0x2000, 2), tag="kv_cache"),
        0x3000: data(handle=(1, GiB, 0x3000, 3), tag="weights")})
    modules["vllm.device_allocator.cumem"] = data(CuMemAllocator=data(instance=allocator))
    probe = make_probe(tmp_path, modules)
    assert probe.poll()
    devices = json.loads(the_file(tmp_path).read_bytes())["devices"]
    assert [d["cumem_bytes"] for d in devices] == [5 * GiB, GiB]

    modules["vllm.device_allocator.cumem"] = data(CuMemAllocator=data(instance=data(pointer_to_data=None)))
    assert probe.poll()  # vLLM changed its internals: counted, the rest still reported
    doc = json.loads(the_file(tmp_path).read_bytes())
    assert doc["errors"]["cumem"] == 1 and [d["cumem_bytes"] for d in doc["devices"]] == [None, None]


@pytest.mark.slow
def test_a_reader_never_sees_a_partial_file(tmp_path, cuda, modules):
    cuda.reset(devices=8, initialised=True)
    probe = make_probe(tmp_path, modules)
    assert probe.poll()
    path = the_file(tmp_path)
    done = threading.Event()
    seen, bad = [], []

    def read_all_the_time():
        while not done.is_set():
            raw = path.read_bytes()  # the final name always exists: rename replaces it
            try:
                seen.append(json.loads(raw)["seq"])
            except ValueError:
                bad.append(raw)

    reader = threading.Thread(target=read_all_the_time)
    reader.start()
    try:
        for i in range(400):
            for device in range(8):  # the size changes from write to write
                cuda.set_stats(device, reserved=(i * 7919 + device) % (1 << 40), device_allocs=i)
            cuda.set_device(i % 8)
            assert probe.poll()
    finally:
        done.set()
        reader.join()
    assert bad == [] and seen == sorted(seen) and seen
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


@pytest.mark.parametrize("planted", ["temporary", "final"])
def test_a_planted_symlink_is_never_followed(tmp_path, cuda, modules, planted):
    cuda.reset(devices=1, initialised=True)
    shared, outside = tmp_path / "shared", tmp_path / "outside"
    shared.mkdir()
    outside.mkdir()
    victim = outside / "victim"
    victim.write_text("precious")
    probe = make_probe(shared, modules)
    name = file_name(probe.document(cuda)["pid_ns"], os.getpid())
    link = shared / (f".{name}.tmp" if planted == "temporary" else name)
    link.symlink_to(victim)

    assert probe.poll()
    assert victim.read_text() == "precious"
    final = shared / name
    assert not final.is_symlink() and json.loads(final.read_bytes())["pid"] == os.getpid()
    assert sorted(p.name for p in shared.iterdir()) == [name]


def test_a_failing_write_is_counted_and_shows_in_the_next_file(tmp_path, cuda, modules):
    cuda.reset(devices=1, initialised=True)
    probe = make_probe(tmp_path, modules)
    name = file_name(probe.document(cuda)["pid_ns"], os.getpid())
    blocker = tmp_path / f".{name}.tmp"
    blocker.mkdir()  # the temporary name taken by something unlink cannot remove
    assert probe.poll() is False
    assert list(tmp_path.iterdir()) == [blocker]
    blocker.rmdir()
    assert probe.poll()
    assert json.loads((tmp_path / name).read_bytes())["errors"]["write"] == 1


def test_close_removes_the_file_and_stops_writing(tmp_path, cuda, modules):
    cuda.reset(devices=1, initialised=True)
    probe = make_probe(tmp_path, modules)
    assert probe.poll()
    probe.close()
    assert list(tmp_path.iterdir()) == []
    assert probe.poll() is False and list(tmp_path.iterdir()) == []


def test_a_forked_child_never_removes_its_parents_file(tmp_path, cuda, modules):
    cuda.reset(devices=1, initialised=True)
    probe = make_probe(tmp_path, modules)
    assert probe.poll()
    probe.pid = os.getpid() + 1  # what the inherited exit handler sees in a child
    probe.close()
    assert len(list(tmp_path.iterdir())) == 1


@pytest.mark.integration
def test_files_left_by_killed_processes_of_our_namespace_are_swept(tmp_path, cuda, modules):
    cuda.reset(devices=1, initialised=True)
    own_ns = int(os.readlink("/proc/self/ns/pid")[5:-1])
    dead = psutil.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = psutil.Process(os.getppid())
    keep = [file_name(own_ns, alive.pid), file_name(own_ns + 1, dead.pid), "other.json"]
    for name in keep + [file_name(own_ns, dead.pid), f".{file_name(own_ns, dead.pid)}.tmp"]:
        (tmp_path / name).write_text("{}")
    probe = make_probe(tmp_path, modules)
    assert probe.poll()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep + [file_name(own_ns, os.getpid())])


def test_sweep_is_skipped_when_the_namespace_is_unknown(tmp_path):
    (tmp_path / file_name(0, 999_999)).write_text("{}")
    probe_file = ProbeFile(str(tmp_path), file_name(0, os.getpid()))
    try:
        assert probe_file.sweep(0, os.getpid()) == 0
    finally:
        probe_file.close()
    assert (tmp_path / file_name(0, 999_999)).exists()


@pytest.mark.parametrize("text, expected", [
    (None, 5.0), ("2", 2.0), ("0.01", 0.5), ("1e9", 300.0), ("nan", 5.0), ("inf", 5.0), ("five", 5.0)])
def test_interval_is_bounded(text, expected):
    assert interval_from(text) == expected


def test_allocator_settings_are_bounded():
    from gpumem_probe.probe import allocator_settings
    settings = allocator_settings({"PYTORCH_ALLOC_CONF": "x" * 10_000, "HOME": "/root"})
    assert settings == {"PYTORCH_ALLOC_CONF": "x" * MAX_SETTING_CHARS}


def test_register_does_nothing_unless_opted_in(monkeypatch):
    monkeypatch.delenv("GPUMEM_PROBE_DIR", raising=False)
    gpumem_probe.register()
    assert not [t for t in threading.enumerate() if t.name == "gpumem-probe"]


def test_register_with_a_directory_that_does_not_exist_stays_off(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUMEM_PROBE_DIR", str(tmp_path / "missing"))
    gpumem_probe.register()  # never raises into vLLM
    assert not [t for t in threading.enumerate() if t.name == "gpumem-probe"]


def test_a_directory_we_may_not_list_still_gets_our_file(tmp_path, cuda, modules, monkeypatch):
    # Mode 1733 lets every user create files but not list them; root cannot feel that here.
    def refuse(self, pid_ns, own_pid):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(ProbeFile, "sweep", refuse)
    cuda.reset(devices=1, initialised=True)
    probe = make_probe(tmp_path, modules)
    assert probe.poll()
    assert probe.poll()  # counted while writing the first file: shows in the next
    assert json.loads(the_file(tmp_path).read_bytes())["errors"]["sweep"] == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")
def test_the_probe_thread_is_named_in_the_kernel_too(tmp_path, cuda, modules):
    """`top -H` and /proc/<pid>/task/<tid>/comm show `gpumem-probe`, so the thread's own CPU
    time can be read apart from the host process's (tests/real_vllm does, inside vLLM)."""
    probe = make_probe(tmp_path, modules)
    probe.interval = 3600.0  # one poll, then it waits
    before = set(os.listdir("/proc/self/task"))
    probe.start()
    try:
        def named() -> list[str]:
            return [t for t in set(os.listdir("/proc/self/task")) - before
                    if Path(f"/proc/self/task/{t}/comm").read_text().strip() == "gpumem-probe"]
        deadline = 600
        while not named() and deadline:
            threading.Event().wait(0.1)
            deadline -= 1
        assert len(named()) == 1
    finally:
        probe.close()
