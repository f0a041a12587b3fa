"""On-demand allocation history (issue 12, item 6): the probe's side against a stand-in
`torch.cuda`, the exporter's request when a leak is first raised, and the report's link."""
import importlib.util
import itertools
import json
import os
import pickle
import sys
import types
from functools import partial
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "probe"))  # the probe is its own distribution: test its source tree

from gpumem_probe import history as probe_history  # noqa: E402
from gpumem_probe.history import control_name, dump_name  # noqa: E402
from gpumem_probe.probe import Probe, initialised_cuda  # noqa: E402

STANDIN_CUDA = ROOT / "tests" / "fixtures" / "probe" / "standin_torch" / "torch" / "cuda.py"
_names = itertools.count()


class Clock:
    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def cuda():
    spec = importlib.util.spec_from_file_location(f"standin_cuda_hist_{next(_names)}", STANDIN_CUDA)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.reset(devices=1, initialised=True)
    return module


@pytest.fixture
def modules(cuda):
    return {"torch": types.SimpleNamespace(cuda=cuda, __version__="2.6.0+cu124")}


@pytest.fixture
def clock():
    return Clock()


def make_probe(directory, modules, clock, **kw):
    return Probe(str(directory), 5.0, cuda=partial(initialised_cuda, modules), modules=modules, clock=clock, **kw)


def probe_doc(directory, probe) -> dict:
    me = probe._me()
    return json.loads((Path(directory) / me.file_name).read_bytes())


def control_path(directory, probe) -> Path:
    me = probe._me()
    return Path(directory) / control_name(me.pid_ns, me.pid)


def ask(directory, probe, **request) -> Path:
    body = {"request_id": "req-1", "record_seconds": 120, "max_entries": 100_000, **request}
    path = control_path(directory, probe)
    path.write_text(json.dumps(body))
    return path


# ---------------------------------------------------------------------------- the probe

def test_a_request_records_with_its_bound_then_dumps_atomically_and_removes_the_control(tmp_path, cuda, modules,
                                                                                         clock):
    probe = make_probe(tmp_path, modules, clock)
    assert probe.poll()
    assert probe_doc(tmp_path, probe)["history"] is None  # never asked
    control = ask(tmp_path, probe, max_entries=250_000)

    assert probe.poll()
    assert cuda.memory.recorded == [{"enabled": "all", "context": "all", "stacks": "python",
                                     "max_entries": 250_000}]
    assert not control.exists()  # taken
    state = probe_doc(tmp_path, probe)["history"]
    assert state["state"] == "recording" and state["request_id"] == "req-1"

    clock.t += 119
    assert probe.poll()
    assert len(cuda.memory.recorded) == 1 and cuda.calls.get("_snapshot") is None  # still recording

    clock.t += 1
    assert probe.poll()
    assert cuda.memory.recorded[-1]["enabled"] is None and not cuda.memory.recording  # stopped
    me = probe._me()
    dump = tmp_path / dump_name(me.pid_ns, me.pid, "req-1")
    snapshot = pickle.loads(dump.read_bytes())  # what torch.cuda.memory._dump_snapshot writes
    assert snapshot["device_traces"][0][0]["frames"][0]["name"] == "forward"
    assert dump.stat().st_mode & 0o777 == 0o600  # it holds the serving process's stack traces
    state = probe_doc(tmp_path, probe)["history"]
    assert state == {"request_id": "req-1", "state": "done", "started_at": 1_700_000_000.0,
                     "finished_at": 1_700_000_120.0, "record_seconds": 120.0, "max_entries": 250_000,
                     "file": dump.name, "bytes": dump.stat().st_size}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([me.file_name, dump.name])  # no temp left
    assert sum(probe_doc(tmp_path, probe)["errors"].values()) == 0


def test_a_dump_replaces_a_link_planted_at_its_name_without_following_it(tmp_path, cuda, modules, clock):
    probe = make_probe(tmp_path, modules, clock)
    probe.poll()
    me = probe._me()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / dump_name(me.pid_ns, me.pid, "req-1")).symlink_to(victim)
    (tmp_path / f".{dump_name(me.pid_ns, me.pid, 'req-1')}.tmp").symlink_to(victim)
    ask(tmp_path, probe, record_seconds=1)
    probe.poll()
    clock.t += 1
    probe.poll()
    assert victim.read_text() == "keep"
    assert not (tmp_path / dump_name(me.pid_ns, me.pid, "req-1")).is_symlink()
    assert probe_doc(tmp_path, probe)["history"]["state"] == "done"


@pytest.mark.parametrize("hostile", [
    pytest.param(lambda p: p.write_bytes(b"{" * 10_000), id="huge"),
    pytest.param(lambda p: p.write_bytes(b'{"request_id": "x", "record_'), id="truncated"),
    pytest.param(lambda p: p.write_bytes(b"\xff\xfe not json"), id="not_utf8"),
    pytest.param(lambda p: p.write_text('["req-1", 120, 1000]'), id="not_an_object"),
    pytest.param(lambda p: p.write_text('{"request_id": "req-1", "record_seconds": "120", "max_entries": 10}'),
                 id="string_seconds"),
    pytest.param(lambda p: p.write_text('{"request_id": "req-1", "record_seconds": 60, "max_entries": true}'),
                 id="bool_entries"),
    pytest.param(lambda p: p.write_text('{"request_id": "req-1", "record_seconds": 60, "max_entries": 1.5}'),
                 id="float_entries"),
    pytest.param(lambda p: p.write_text('{"request_id": "../../etc/x", "record_seconds": 60, "max_entries": 10}'),
                 id="path_in_request_id"),
    pytest.param(lambda p: p.write_text('{"request_id": "req-1", "record_seconds": 601, "max_entries": 10}'),
                 id="seconds_over_cap"),
    pytest.param(lambda p: p.write_text('{"request_id": "req-1", "record_seconds": 60, "max_entries": 1000001}'),
                 id="entries_over_cap"),
    pytest.param(lambda p: p.write_text('{"request_id": "req-1", "record_seconds": 0, "max_entries": 10}'),
                 id="zero_seconds"),
    pytest.param(lambda p: p.write_text('{"request_id": "req-1", "record_seconds": NaN, "max_entries": 10}'),
                 id="nan_seconds"),
    pytest.param(lambda p: p.mkdir(), id="directory"),
    pytest.param(lambda p: os.mkfifo(p), id="fifo"),
])
def test_a_hostile_control_file_is_counted_and_nothing_is_recorded(tmp_path, cuda, modules, clock, hostile):
    probe = make_probe(tmp_path, modules, clock)
    probe.poll()
    hostile(control_path(tmp_path, probe))
    assert probe.poll()  # the probe file is still written
    assert probe.poll()  # and the same bad file is not counted twice
    doc = probe_doc(tmp_path, probe)
    assert doc["errors"]["control"] == 1
    assert doc["history"]["state"] == "failed" and doc["history"]["reason"] == "invalid_request"
    assert cuda.memory.recorded == [] and "_snapshot" not in cuda.calls


def test_a_control_file_that_is_a_link_is_never_followed(tmp_path, cuda, modules, clock):
    probe = make_probe(tmp_path, modules, clock)
    probe.poll()
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"request_id": "req-1", "record_seconds": 60, "max_entries": 10}))
    control_path(tmp_path, probe).symlink_to(target)
    probe.poll()
    assert probe_doc(tmp_path, probe)["errors"]["control"] == 1
    assert cuda.memory.recorded == []
    assert target.exists()  # the link's target is never touched


def test_a_torch_without_the_api_is_counted_not_raised(tmp_path, cuda, modules, clock):
    del cuda.memory
    probe = make_probe(tmp_path, modules, clock)
    probe.poll()
    ask(tmp_path, probe)
    assert probe.poll()
    doc = probe_doc(tmp_path, probe)
    assert doc["errors"]["history_unsupported"] == 1
    assert doc["history"]["state"] == "failed" and doc["history"]["reason"] == "unsupported"


def test_torch_2_0s_older_signature_is_counted_not_raised(tmp_path, cuda, modules, clock):
    def legacy(enabled, record_context=True, trace_alloc_max_entries=1, trace_alloc_record_context=False,
               device=None, _enable_expandable_segments=False):
        raise AssertionError("not reached: the keywords differ")
    cuda.memory._record_memory_history = legacy
    probe = make_probe(tmp_path, modules, clock)
    probe.poll()
    ask(tmp_path, probe)
    assert probe.poll()
    assert probe_doc(tmp_path, probe)["errors"]["history_unsupported"] == 1


def test_a_failing_snapshot_stops_recording_and_is_counted(tmp_path, cuda, modules, clock):
    def broken(device=None):
        raise RuntimeError("boom")
    cuda.memory._snapshot = broken
    probe = make_probe(tmp_path, modules, clock)
    probe.poll()
    ask(tmp_path, probe, record_seconds=5)
    probe.poll()
    clock.t += 5
    assert probe.poll()
    doc = probe_doc(tmp_path, probe)
    assert doc["errors"]["history"] == 1 and doc["history"]["reason"] == "snapshot_failed"
    assert not cuda.memory.recording


def test_a_dump_over_the_size_bound_is_abandoned(tmp_path, cuda, modules, clock):
    probe = make_probe(tmp_path, modules, clock)
    probe.history._max_dump_bytes = 64
    probe.poll()
    ask(tmp_path, probe, record_seconds=5)
    probe.poll()
    clock.t += 5
    probe.poll()
    doc = probe_doc(tmp_path, probe)
    assert doc["history"]["reason"] == "too_large" and doc["errors"]["history"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [probe._me().file_name]  # no dump, no temp


def test_at_most_one_recording_per_process_per_gap_whoever_asks(tmp_path, cuda, modules, clock):
    probe = make_probe(tmp_path, modules, clock)
    probe.poll()
    ask(tmp_path, probe, record_seconds=10)
    probe.poll()
    clock.t += 10
    probe.poll()
    ask(tmp_path, probe, request_id="req-2", record_seconds=10)
    clock.t += 60
    probe.poll()
    assert probe_doc(tmp_path, probe)["history"]["reason"] == "too_soon"
    assert len(cuda.memory.recorded) == 2  # one start, one stop
    ask(tmp_path, probe, request_id="req-3", record_seconds=10)
    clock.t = 1_700_000_000.0 + probe_history.MIN_GAP_SECONDS
    probe.poll()
    assert probe_doc(tmp_path, probe)["history"]["state"] == "recording"


def test_a_request_the_probe_cannot_remove_is_acted_on_once(tmp_path, cuda, modules, clock, monkeypatch):
    """In a sticky directory the exporter's control file cannot be removed by vLLM's user."""
    probe = make_probe(tmp_path, modules, clock)
    probe.poll()
    control = ask(tmp_path, probe, record_seconds=5)
    monkeypatch.setattr(type(probe._file), "unlink", lambda self, name: (_ for _ in ()).throw(PermissionError()))
    probe.poll()
    clock.t += 5
    probe.poll()
    probe.poll()
    clock.t += probe_history.MIN_GAP_SECONDS
    probe.poll()
    assert control.exists()
    assert [c["enabled"] for c in cuda.memory.recorded] == ["all", None]  # once


def test_requests_are_refused_when_the_process_opted_out(tmp_path, cuda, modules, clock):
    probe = make_probe(tmp_path, modules, clock, history=False)
    probe.poll()
    ask(tmp_path, probe)
    probe.poll()
    assert probe_doc(tmp_path, probe)["history"]["reason"] == "disabled"
    assert cuda.memory.recorded == []


def test_without_a_control_file_a_poll_costs_one_lstat(tmp_path, cuda, modules, clock, monkeypatch):
    probe = make_probe(tmp_path, modules, clock)
    probe.poll()
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda *a, **k: stats.append(a[0]) or real_stat(*a, **k))
    probe.poll()
    assert stats == [control_name(probe._me().pid_ns, probe._me().pid)]
    assert cuda.memory.recorded == []


# ---------------------------------------------------------------------------- the exporter

import dataclasses  # noqa: E402
import re  # noqa: E402

from exporter.config import ConfigError  # noqa: E402
from exporter.config import load as load_config  # noqa: E402
from exporter.model import AllocatorStats, Analysis  # noqa: E402
from exporter.postmortem.report import render_report  # noqa: E402
from exporter.postmortem.trace import read_trace, write_csv  # noqa: E402
from exporter.reactions.alloc_history import HistoryRequester  # noqa: E402
from exporter.sources.allocator import parse  # noqa: E402
from tests.helpers.state import make_state  # noqa: E402
from tests.helpers.timeline import just_raised  # noqa: E402

PROBED = AllocatorStats(reserved_bytes=1 << 30, probe_pid=57, probe_pid_ns=4026532451)
CONTROL = "gpumem-4026532451-57.control.json"


def state_at(t, probed=True, findings=None, allocator=PROBED):
    """make_state's GPU 0 with pid 101 probed (or not), and its leak finding (or `findings`)."""
    state = make_state(t=t)
    gpu = state.snapshot.gpus[0]
    procs = tuple(dataclasses.replace(p, allocator=allocator if probed else None, start_time=900.0)
                  if p.pid == 101 else p for p in gpu.processes)
    snap = dataclasses.replace(state.snapshot, gpus=(dataclasses.replace(gpu, processes=procs),))
    analysis = state.analysis if findings is None else Analysis(timestamp=t, findings=tuple(findings))
    return dataclasses.replace(state, snapshot=snap, analysis=analysis)


def requester(directory, **kw):
    kw.setdefault("record_seconds", 120.0)
    kw.setdefault("max_entries", 100_000)
    kw.setdefault("min_interval_seconds", 3600.0)
    return HistoryRequester(str(directory), **kw)


def test_a_leak_first_raised_for_a_probed_process_writes_its_control_file_once(tmp_path):
    req = requester(tmp_path)
    req.observe(state_at(1000.0))
    control = tmp_path / CONTROL
    body = json.loads(control.read_text())
    assert body == {"request_id": "1000-101", "record_seconds": 120.0, "max_entries": 100_000, "reason": "leak"}
    assert probe_history.parse_request(control.read_bytes()).max_entries == 100_000  # what the probe accepts
    assert control.stat().st_mode & 0o777 == 0o644  # vLLM's user reads it
    assert [p.name for p in tmp_path.iterdir()] == [CONTROL]  # no temporary file left
    for t in (1005.0, 1010.0):  # the same finding, still active: never asked again
        req.observe(state_at(t))
    assert req.stats().requests_total == {"written": 1}


def test_a_finding_raised_again_within_the_interval_is_rate_limited_then_asked_after_it(tmp_path):
    req = requester(tmp_path)
    req.observe(state_at(1000.0))
    (tmp_path / CONTROL).unlink()  # the probe took it
    req.observe(state_at(1005.0, findings=()))  # cleared
    req.observe(state_at(2000.0))  # raised again within the hour
    assert not (tmp_path / CONTROL).exists()
    req.observe(state_at(2005.0, findings=()))
    req.observe(state_at(4700.0))  # raised again after it
    assert json.loads((tmp_path / CONTROL).read_text())["request_id"] == "4700-101"
    assert req.stats().requests_total == {"written": 2, "rate_limited": 1}


def test_no_request_for_a_process_without_a_probe_or_for_other_findings(tmp_path):
    req = requester(tmp_path)
    req.observe(state_at(1000.0, probed=False))
    stale = dataclasses.replace(state_at(1005.0).analysis.findings[0], kind="stale_memory")
    req.observe(state_at(1005.0, findings=[stale]))
    assert list(tmp_path.iterdir()) == []
    # A leak raised before the probe's file was matched is asked for once it is.
    req.observe(state_at(1010.0))
    assert (tmp_path / CONTROL).exists()


def test_a_fragmentation_finding_asks_too(tmp_path):
    frag = dataclasses.replace(state_at(1000.0).analysis.findings[0], kind="fragmentation")
    req = requester(tmp_path)
    req.observe(state_at(1000.0, findings=[frag]))
    assert json.loads((tmp_path / CONTROL).read_text())["reason"] == "fragmentation"


def test_a_link_planted_at_the_control_name_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / CONTROL).symlink_to(victim)
    requester(tmp_path).observe(state_at(1000.0))
    assert victim.read_text() == "keep"
    assert not (tmp_path / CONTROL).is_symlink()


def test_an_unwritable_directory_is_counted_never_raised(tmp_path):
    req = requester(tmp_path / "missing")
    req.observe(state_at(1000.0))
    assert req.stats().requests_total == {"not_found": 1}


def test_the_answer_is_counted_and_the_control_file_removed(tmp_path):
    req = requester(tmp_path)
    req.observe(state_at(1000.0))
    answered = dataclasses.replace(PROBED, history_request="1000-101", history_state="done",
                                   history_file="gpumem-4026532451-57-1000-101.pickle", history_bytes=12345)
    req.observe(state_at(1130.0, allocator=answered))
    assert not (tmp_path / CONTROL).exists()
    assert req.stats().results_total == {"done": 1}


def test_an_unanswered_request_is_given_up_and_its_control_file_removed(tmp_path):
    req = requester(tmp_path)
    req.observe(state_at(1000.0))
    req.observe(state_at(1000.0 + 120 + 299))
    assert (tmp_path / CONTROL).exists()
    req.observe(state_at(1000.0 + 120 + 300))
    assert not (tmp_path / CONTROL).exists()
    assert req.stats().results_total == {"unanswered": 1}


def test_the_counters_are_exposed_and_documented():
    from prometheus_client import generate_latest

    from exporter.model import AllocHistoryStats
    from exporter.serve.exposition import build_registry

    state = dataclasses.replace(make_state(), alloc_history=AllocHistoryStats(
        requests_total={"written": 2, "rate_limited": 1}, results_total={"done": 1}))
    text = generate_latest(build_registry(lambda: state, lambda: 1_000_000.0)).decode()
    assert 'gpumem_allocator_history_requests_total{result="written"} 2.0' in text
    assert 'gpumem_allocator_history_results_total{state="done"} 1.0' in text
    docs = (ROOT / "docs" / "metrics.md").read_text()
    names = re.findall(r"^# TYPE (gpumem_allocator_history_\w+) ", text, re.M)
    assert len(names) == 2 and all(f"`{name}`" in docs for name in names)


def test_the_option_is_off_by_default_and_needs_the_probe_directory(tmp_path):
    from exporter.clock import SystemClock
    from exporter.service import make_alloc_history

    config = load_config(None, {"allocator.probe_dir": str(tmp_path)})
    assert config.allocator.history.enabled is False
    assert make_alloc_history(config, SystemClock(), simulated=False) is None
    on = load_config(None, {"allocator.probe_dir": str(tmp_path), "allocator.history.enabled": True})
    assert isinstance(make_alloc_history(on, SystemClock(), simulated=False), HistoryRequester)
    with pytest.raises(ConfigError, match=r"needs allocator\.probe_dir"):
        load_config(None, {"allocator.history.enabled": True})
    with pytest.raises(ConfigError, match="max_entries"):
        load_config(None, {"allocator.probe_dir": str(tmp_path), "allocator.history.max_entries": 2_000_000})


def test_the_daemon_without_the_option_writes_no_control_file(tmp_path):
    """With the option off the daemon has no requester: a probed leak leaves the directory alone."""
    from exporter.daemon import Daemon

    class Once:
        sources = ()

        def sample(self):
            return state_at(1000.0).snapshot

        def close(self):
            pass

    class Analyzer:
        def __init__(self):
            self.detector_errors = {}

        def update(self, snapshot):
            return state_at(1000.0).analysis

    from exporter.clock import SystemClock
    Daemon(Once(), SystemClock(), 5.0, analyzer=Analyzer()).tick()
    assert list(tmp_path.iterdir()) == []
    daemon = Daemon(Once(), SystemClock(), 5.0, analyzer=Analyzer(), alloc_history=requester(tmp_path))
    state = daemon.tick()
    assert [p.name for p in tmp_path.iterdir()] == [CONTROL]
    assert daemon.tick().alloc_history.requests_total == {"written": 1} and state.alloc_history is not None


# ---------------------------------------------------------------------------- file, trace, report

def probe_file_with(history) -> bytes:
    return json.dumps({"schema": 1, "pid": 57, "pid_ns": 4026532451, "start_time": 1.0, "written_at": 2.0,
                       "interval": 5.0, "errors": {}, "devices": [], "history": history}).encode()


def test_the_source_reads_the_probes_answer_and_drops_a_path_for_a_name():
    done = {"request_id": "1000-101", "state": "done", "file": "gpumem-4026532451-57-1000-101.pickle",
            "bytes": 12345}
    report = parse(probe_file_with(done))
    assert report.pid == 57 and report.pid_ns == 4026532451
    common = AllocatorStats(**{k: v for k, v in dataclasses.asdict(report_stats(done)).items()})
    assert (common.history_state, common.history_file, common.history_bytes) == ("done", done["file"], 12345)
    assert (common.probe_pid, common.probe_pid_ns) == (57, 4026532451)
    hostile = report_stats({**done, "file": "../../etc/shadow"})
    assert hostile.history_file == "" and hostile.history_state == "done"
    assert report_stats({**done, "state": "exploded"}).history_state == ""
    assert report_stats(None).history_state == ""


def report_stats(history) -> AllocatorStats:
    data = json.loads(probe_file_with(history))
    data["devices"] = [{"index": 0, "uuid": "a1000000-0000-0000-0000-000000000000", "reserved_bytes": 1}]
    return parse(json.dumps(data).encode()).devices[0][1]


def test_the_report_links_the_dump_a_trace_carries(tmp_path):
    answered = dataclasses.replace(PROBED, history_request="1000-101", history_state="done",
                                   history_file="gpumem-4026532451-57-1000-101.pickle", history_bytes=3 << 20)
    trace = tmp_path / "trace.csv"
    write_csv([state_at(1000.0).snapshot, state_at(1130.0, allocator=answered).snapshot], str(trace))
    snapshots = read_trace(str(trace))  # the flight recorder's trace keeps the probe's answer
    finding = state_at(1000.0).analysis.findings[0]
    episodes = [just_raised(finding)]
    html = render_report(snapshots, episodes, [])
    assert '<a href="gpumem-4026532451-57-1000-101.pickle">' in html
    assert "pytorch.org/memory_viz" in html and "3.00 MiB" in html
    html = render_report(snapshots, episodes, [], probe_dir="/run/gpumem-probe")
    assert '<a href="/run/gpumem-probe/gpumem-4026532451-57-1000-101.pickle">' in html
    plain = [state_at(1000.0).snapshot, state_at(1130.0).snapshot]
    assert "Allocation history" not in render_report(plain, episodes, [])


def test_a_probe_directory_that_is_a_symlink_gets_no_control_file(tmp_path):
    """#21 L8: the configured probe directory's own path swapped for a link: the control file
    must not land in the link's target."""
    target, probe_dir = tmp_path / "etc", tmp_path / "probe"
    target.mkdir()
    probe_dir.symlink_to(target)
    req = requester(probe_dir)
    req.observe(state_at(1000.0))
    assert list(target.iterdir()) == []
    assert req.stats().requests_total == {"symlink": 1}
