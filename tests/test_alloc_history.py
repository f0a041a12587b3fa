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
