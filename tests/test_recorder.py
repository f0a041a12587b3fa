"""Flight recorder: each trigger writes a real trace file that `analyze` reads back, writing never
blocks the sampling thread, rotation keeps the directory bounded, disk faults are counted."""
from __future__ import annotations

import os
import re
import stat
import threading
import time

import pytest

from exporter.analysis.history import History
from exporter.analysis.transitions import transitions
from exporter.model import Analysis, Finding, GpuSample, HostMemory, OomEvent, ProcessSample, Snapshot, State
from exporter.postmortem.trace import read_trace, write_csv
from exporter.reactions.recorder import FlightRecorder, error_kind

GiB = 1 << 30
T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z
NAME = re.compile(r"^gpumem-\d{8}T\d{6}Z-(?P<trigger>[a-z_+]+)(?:-\d+)?\.csv$")


def snap(t, serving=True, gpu_up=True, events=(), other=True):
    procs = []
    if serving:
        procs.append(ProcessSample(pid=3150, used_bytes=70 * GiB + int(t - T0) * 1000,
                                   name="VLLM::EngineCor", role="vllm", host_rss_bytes=3 * GiB,
                                   start_time=T0 - 600, endpoint="127.0.0.1:8000"))
    if other:
        procs.append(ProcessSample(pid=4000, used_bytes=GiB, name="python", start_time=T0 - 60))
    used = sum(p.used_bytes for p in procs) + GiB // 2
    gpu = GpuSample(index="0", uuid="GPU-a", name="H100", up=gpu_up,
                    total_bytes=80 * GiB if gpu_up else None, used_bytes=used if gpu_up else None,
                    free_bytes=80 * GiB - used if gpu_up else None,
                    processes=tuple(procs) if gpu_up else ())
    return Snapshot(timestamp=t, gpus=(gpu,), host=HostMemory(512 * GiB, 400 * GiB),
                    log_events=tuple(events))


def oom_event():
    return OomEvent(kind="torch_cuda_oom", klass="fragmentation", line=12, source="vllm.log")


def critical(t, pid=3150, severity="critical"):
    return Finding(kind="leak", severity=severity, first_detected_at=t, gpu="0", pid=pid,
                   process="VLLM::EngineCor", role="vllm")


class Feed:
    """Publishes States the way Daemon.tick does: history first, the tick's transitions decided
    as the analysis decides them, then observe."""

    def __init__(self, recorder, raw_seconds=3600):
        self.recorder = recorder
        self.history = History(raw_seconds=raw_seconds)
        self.before = None
        self.active = ()

    def tick(self, snapshot, findings=()):
        self.history.update(snapshot)
        changed = transitions(self.before, snapshot, self.active, tuple(findings))
        self.before, self.active = snapshot, tuple(findings)
        state = State(snapshot=snapshot, analysis=Analysis(snapshot.timestamp, tuple(findings),
                                                           transitions=changed))
        started = time.perf_counter()
        self.recorder.observe(state, self.history.recent)
        return time.perf_counter() - started


@pytest.fixture
def make(tmp_path):
    made = []

    def build(**kw):
        kw.setdefault("directory", str(tmp_path / "rec"))
        r = FlightRecorder(**kw)
        made.append(r)
        return r

    yield build
    for r in made:
        r.close(timeout=5)


def recordings(directory):
    """Our recordings in the directory (it is created only when the first one is written)."""
    if not os.path.isdir(directory):
        return []
    return sorted(n for n in os.listdir(directory) if NAME.match(n))


def test_an_oom_event_records_the_last_window_as_a_readable_trace(make, tmp_path):
    rec = make(window_seconds=120)
    feed = Feed(rec)
    for i in range(30):  # 290 s of samples, 10 s apart; only the last 120 s are recorded
        feed.tick(snap(T0 + 10 * i))
    assert recordings(rec.directory) == []  # nothing happened yet
    feed.tick(snap(T0 + 300, events=(oom_event(),)))
    assert rec.flush(5)
    [name] = recordings(rec.directory)
    assert name == "gpumem-20231114T221820Z-oom.csv"  # T0 + 300 s, UTC
    replayed = read_trace(os.path.join(rec.directory, name))
    assert [s.timestamp for s in replayed] == [T0 + 10 * i for i in range(18, 31)]
    last = replayed[-1].gpus[0]
    assert last.total_bytes == 80 * GiB  # total, RSS and role columns are in the file
    serving = next(p for p in last.processes if p.pid == 3150)
    assert serving.role == "vllm" and serving.host_rss_bytes == 3 * GiB
    assert serving.used_bytes == 70 * GiB + 300_000
    stats = rec.stats()
    assert stats.writes_total == 1 and stats.triggers_total == {"oom": 1}
    assert stats.last_file.endswith(name) and stats.last_write_timestamp is not None
    assert stats.errors_total == {}


def test_a_newly_raised_critical_finding_records_once(make):
    rec = make(debounce_seconds=0)
    feed = Feed(rec)
    feed.tick(snap(T0), [critical(T0, severity="warning")])
    feed.tick(snap(T0 + 10), [critical(T0)])  # warning -> critical: newly critical
    feed.tick(snap(T0 + 20), [critical(T0)])  # still the same finding: nothing new
    feed.tick(snap(T0 + 30), [critical(T0)])
    assert rec.flush(5)
    assert [NAME.match(n)["trigger"] for n in recordings(rec.directory)] == ["critical"]
    feed.tick(snap(T0 + 40), [critical(T0), critical(T0, pid=4000)])  # another key
    assert rec.flush(5)
    assert rec.stats().triggers_total == {"critical": 2}


def test_a_serving_process_that_disappears_records(make):
    rec = make()
    feed = Feed(rec)
    feed.tick(snap(T0))
    feed.tick(snap(T0 + 10, other=False))  # a non-serving process leaving is no trigger
    feed.tick(snap(T0 + 20, serving=False, other=False))
    assert rec.flush(5)
    [name] = recordings(rec.directory)
    assert NAME.match(name)["trigger"] == "vllm_exit"
    assert [s.timestamp for s in read_trace(os.path.join(rec.directory, name))] == \
        [T0, T0 + 10, T0 + 20]


def test_a_lost_gpu_is_not_a_process_exit(make):
    rec = make()
    feed = Feed(rec)
    feed.tick(snap(T0))
    feed.tick(snap(T0 + 10, gpu_up=False))  # NVML lost the GPU: its processes are unseen
    feed.tick(snap(T0 + 20))
    assert rec.flush(5)
    assert recordings(rec.directory) == [] and rec.stats().triggers_total == {}


def test_the_same_state_twice_does_not_record_twice(make):
    rec = make(debounce_seconds=0)
    history = History()
    s = snap(T0, events=(oom_event(),))
    history.update(s)
    state = State(snapshot=s, analysis=Analysis(T0, transitions=("oom",)))
    rec.observe(state, history.recent)
    rec.observe(state, history.recent)  # a failed tick republishes the old State
    assert rec.flush(5)
    assert rec.stats().writes_total == 1


def test_debounce_allows_one_file_per_trigger_kind_per_period(make):
    rec = make(debounce_seconds=300)
    feed = Feed(rec)
    feed.tick(snap(T0, events=(oom_event(),)))
    assert rec.flush(5)
    feed.tick(snap(T0 + 100, events=(oom_event(),)))  # debounced
    feed.tick(snap(T0 + 110, serving=False), [critical(T0 + 110)])  # other kinds still record
    assert rec.flush(5)
    feed.tick(snap(T0 + 310, serving=False, events=(oom_event(),)))  # period over
    assert rec.flush(5)
    triggers = sorted(NAME.match(n)["trigger"] for n in recordings(rec.directory))
    assert triggers == ["critical+vllm_exit", "oom", "oom"]
    assert rec.stats().debounced_total == {"oom": 1}


def test_rotation_by_count_keeps_the_newest_and_leaves_other_files_alone(make):
    rec = make(max_files=3, debounce_seconds=0)
    os.makedirs(rec.directory)
    foreign = os.path.join(rec.directory, "notes.csv")
    with open(foreign, "w") as handle:
        handle.write("not ours\n")
    feed = Feed(rec)
    for i in range(6):
        feed.tick(snap(T0 + 10 * i, events=(oom_event(),)))
        assert rec.flush(5)
    names = recordings(rec.directory)
    assert names == ["gpumem-20231114T221350Z-oom.csv", "gpumem-20231114T221400Z-oom.csv",
                     "gpumem-20231114T221410Z-oom.csv"]  # T0 + 30, 40, 50 s
    assert os.path.exists(foreign)
    assert rec.stats().rotated_total == 3


def test_rotation_by_total_size_keeps_the_file_just_written(make):
    feed_sizes = []
    rec = make(max_total_bytes=1, debounce_seconds=0)  # every file is over the budget
    feed = Feed(rec)
    for i in range(3):
        feed.tick(snap(T0 + 10 * i, events=(oom_event(),)))
        assert rec.flush(5)
        feed_sizes.append(recordings(rec.directory))
    assert [len(n) for n in feed_sizes] == [1, 1, 1]
    assert feed_sizes[-1] == ["gpumem-20231114T221340Z-oom.csv"]

    rec2 = make(directory=rec.directory + "2", debounce_seconds=0, window_seconds=5)
    feed2 = Feed(rec2)
    feed2.tick(snap(T0, events=(oom_event(),)))
    assert rec2.flush(5)
    one = os.path.getsize(os.path.join(rec2.directory, recordings(rec2.directory)[0]))
    rec2.max_total_bytes = int(2.5 * one)  # room for two recordings of this size
    for i in range(1, 4):
        feed2.tick(snap(T0 + 10 * i, events=(oom_event(),)))
        assert rec2.flush(5)
    sizes = [os.path.getsize(os.path.join(rec2.directory, n)) for n in recordings(rec2.directory)]
    assert len(sizes) == 2 and sum(sizes) <= rec2.max_total_bytes


def test_a_full_disk_is_counted_not_raised(make):
    full = [True]

    def writer(snapshots, path):
        if full[0]:  # /dev/full answers every write with ENOSPC
            with open("/dev/full", "w") as handle:
                handle.write("x" * (1 << 16))
        write_csv(snapshots, path)

    rec = make(writer=writer)
    feed = Feed(rec)
    feed.tick(snap(T0, events=(oom_event(),)))
    assert rec.flush(5)
    stats = rec.stats()
    assert stats.errors_total == {"disk_full": 1} and stats.writes_total == 0
    assert recordings(rec.directory) == []
    # The recorder keeps working once there is room again.
    full[0] = False
    feed.tick(snap(T0 + 400, events=(oom_event(),)))
    assert rec.flush(5)
    assert rec.stats().writes_total == 1


def test_a_directory_under_a_file_is_counted_not_raised(make, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    rec = make(directory=str(blocker / "recordings"))
    feed = Feed(rec)
    feed.tick(snap(T0, events=(oom_event(),)))
    assert rec.flush(5)
    assert rec.stats().errors_total == {"not_a_directory": 1}


def test_observe_never_waits_for_a_slow_disk_and_coalesces(make):
    gate = threading.Event()
    started = threading.Event()

    def slow_writer(snapshots, path):
        started.set()
        gate.wait(120)  # the disk hangs until the test lets it go: a tick that waited for it fails
        write_csv(snapshots, path)

    rec = make(writer=slow_writer)
    feed = Feed(rec)
    durations = [feed.tick(snap(T0 + 10 * i)) for i in range(5)]
    durations.append(feed.tick(snap(T0 + 50, events=(oom_event(),))))
    assert started.wait(5)  # the first write is in progress, and hangs
    durations.append(feed.tick(snap(T0 + 60), [critical(T0 + 60)]))
    durations.append(feed.tick(snap(T0 + 70, serving=False)))
    assert max(durations) < 30, durations  # bounds a hang only: the writer holds for 120 s
    assert rec.stats().coalesced_total == 1  # vllm_exit merged into the pending critical write
    gate.set()
    assert rec.flush(10)
    names = recordings(rec.directory)
    assert [NAME.match(n)["trigger"] for n in names] == ["oom", "critical+vllm_exit"]
    assert names[1].startswith("gpumem-20231114T221430Z")  # the later tick's window
    assert rec.stats().writes_total == 2


def test_a_broken_state_is_counted_not_raised(make):
    rec = make()

    def broken_window(since):
        raise RuntimeError("bug")

    rec.observe(State(snapshot=snap(T0, events=(oom_event(),)),
                      analysis=Analysis(T0, transitions=("oom",))), broken_window)
    rec.observe(None, None)
    assert rec.stats().errors_total == {"observe": 1}


def test_close_finishes_the_pending_write(tmp_path):
    rec = FlightRecorder(str(tmp_path / "rec"))
    feed = Feed(rec)
    feed.tick(snap(T0, events=(oom_event(),)))
    rec.close(timeout=5)
    assert len(recordings(rec.directory)) == 1


def test_a_planted_link_is_never_written_through(make, tmp_path):
    """Links planted where the recorder writes (the recording's name, and the temporary names
    it used to write first) leave their targets untouched; the recording is written anyway."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    rec = make(debounce_seconds=0)
    os.makedirs(rec.directory)
    first, second = "gpumem-20231114T221320Z-oom.csv", "gpumem-20231114T221320Z-oom-1.csv"
    planted = [first, f"{first}.tmp.{os.getpid()}", f"{second}.tmp.{os.getpid()}"]
    for name in planted:
        os.symlink(victim, os.path.join(rec.directory, name))
    Feed(rec).tick(snap(T0, events=(oom_event(),)))
    assert rec.flush(5)
    assert victim.read_text() == "precious\n"
    assert all(os.path.islink(os.path.join(rec.directory, name)) for name in planted)
    written = rec.stats().last_file
    assert rec.stats().writes_total == 1 and os.path.basename(written) == second
    assert not os.path.islink(written) and [s.timestamp for s in read_trace(written)] == [T0]
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600


def test_the_directory_it_creates_is_private(make):
    rec = make()
    Feed(rec).tick(snap(T0, events=(oom_event(),)))
    assert rec.flush(5) and rec.stats().writes_total == 1
    assert stat.S_IMODE(os.stat(rec.directory).st_mode) == 0o700


@pytest.mark.parametrize("errno_name, kind", [
    ("ENOSPC", "disk_full"), ("EACCES", "permission"), ("EROFS", "read_only"), ("EIO", "io")])
def test_error_kinds(errno_name, kind):
    import errno
    assert error_kind(OSError(getattr(errno, errno_name), "x")) == kind
    assert error_kind(ValueError("x")) == "exception"


def test_bad_settings_are_rejected(tmp_path):
    for bad in ({"window_seconds": 0}, {"max_files": 0}, {"max_total_bytes": 0},
                {"debounce_seconds": -1}):
        with pytest.raises(ValueError):
            FlightRecorder(str(tmp_path), **bad)


def test_a_directory_named_like_a_leftover_never_stops_rotation(make):
    """#21 L7: rotation removes leftover temporary files; a directory planted under such a name
    is left alone, and the rotation goes on (it used to fail, every time)."""
    rec = make(max_files=1, debounce_seconds=0)
    os.makedirs(rec.directory)
    planted = os.path.join(rec.directory, "gpumem-20231114T221320Z-oom.csv.tmp.1.abcdef")
    os.mkdir(planted)
    feed = Feed(rec)
    for i in range(3):
        feed.tick(snap(T0 + 10 * i, events=(oom_event(),)))
        assert rec.flush(5)
    assert recordings(rec.directory) == ["gpumem-20231114T221340Z-oom.csv"]
    stats = rec.stats()
    assert stats.rotated_total == 2 and "rotate" not in stats.errors_total
    assert os.path.isdir(planted)
