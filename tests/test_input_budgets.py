"""Every input that can grow per tick has a budget (#21 item 1, H2 H3 M6): a flood is counted
(`Snapshot.dropped`, exported as gpumem_exporter_budget_dropped_total) and never stored whole.
Each input is flooded through its real source: real files, real HTTP on loopback. The raw history
keeps what its readers use, not the ticks' fault records, and a bounded number of log events.
docs/memory.md states what these bounds add up to; tests/test_memory_bound.py floods a real daemon.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from exporter.analysis.engine import Analyzer
from exporter.analysis.history import History
from exporter.model import GpuSample, OomMessage, ProcessSample, Snapshot, SourceError
from exporter.sources import vllm_normalise
from exporter.sources.allocator import AllocatorSource
from exporter.sources.logs import MAX_EVENTS_PER_TICK, LogSource
from exporter.sources.source import Reading, collect, fold_errors
from exporter.sources.vllm import VllmEndpoint, VllmSource

GiB = 1 << 30
NOW = 1_700_000_000.0
NS = 4026532000
UUID = "a1000000-0000-0000-0000-000000000000"


# -- probe files (H2) ------------------------------------------------------------------------

def probe_doc(pid=7, pid_ns=NS):
    device = {"index": 0, "uuid": UUID, "allocated_bytes": 10 * GiB, "reserved_bytes": 12 * GiB}
    return {"schema": 1, "pid": pid, "pid_ns": pid_ns, "start_time": NOW - 3600, "written_at": NOW - 2,
            "interval": 5.0, "devices": [device]}


def probed_gpu():
    process = ProcessSample(pid=5000, used_bytes=14 * GiB, start_time=NOW - 3600.4, ns_pid=7, name="python3")
    return (GpuSample(index="0", uuid="GPU-" + UUID, total_bytes=80 * GiB, processes=(process,)),)


def flood_probe_dir(directory, files=8000):
    """The red team's attack: one-byte files named for the live process's pid, in namespaces
    that are not its own, beside its real file."""
    for ns in range(1, files + 1):
        (directory / f"gpumem-{ns}-7.json").write_bytes(b"x")
    (directory / f"gpumem-{NS}-7.json").write_text(json.dumps(probe_doc()))


def test_a_probe_file_flood_opens_only_the_processs_own_names_where_its_namespace_is_known(tmp_path):
    flood_probe_dir(tmp_path)
    snap = collect(AllocatorSource(str(tmp_path), pid_namespace=lambda pid: NS), Snapshot(NOW, gpus=probed_gpu()))
    assert snap.gpus[0].processes[0].allocator.reserved_bytes == 12 * GiB  # its numbers, undisturbed
    assert snap.errors == ()  # no planted file was opened: nothing to report


def test_a_probe_file_flood_is_one_fault_record_and_a_few_opens_where_the_namespace_is_unknown(tmp_path):
    flood_probe_dir(tmp_path)
    opened = []
    source = AllocatorSource(str(tmp_path), pid_namespace=lambda pid: None, process_owner=lambda pid: None)
    real_read = source._read
    source._read = lambda name, *a: opened.append(name) or real_read(name, *a)
    snap = collect(source, Snapshot(NOW, gpus=probed_gpu()))
    assert len(opened) == 4  # MAX_FILES_PER_PROCESS, however many are planted
    assert [(e.kind, e.count) for e in snap.errors] == [("bad_json", 4)]  # one record for four faults
    assert snap.dropped == (("probe_files", 8001 - 4),)  # counted, never read
    assert snap.gpus[0].processes[0].allocator is None  # the real file was crowded out: no guess


def test_files_another_user_planted_are_never_opened(tmp_path):
    flood_probe_dir(tmp_path, files=50)
    opened = []
    # The process runs as another user than the one owning every file here.
    source = AllocatorSource(str(tmp_path), pid_namespace=lambda pid: None,
                             process_owner=lambda pid: (tmp_path.stat().st_uid + 1) % 65536)
    real_read = source._read
    source._read = lambda name, *a: opened.append(name) or real_read(name, *a)
    snap = collect(source, Snapshot(NOW, gpus=probed_gpu()))
    assert opened == [] and snap.errors == () and snap.dropped == ()


def test_fault_records_are_folded_by_kind_with_their_count():
    errors = [SourceError("allocator", "bad_json", f"file {i}") for i in range(8000)]
    errors += [SourceError("allocator", f"kind{i}") for i in range(40)]
    folded, spilled = fold_errors(errors)
    assert folded[0] == SourceError("allocator", "bad_json", "file 0", count=8000)
    assert len(folded) == 17  # bad_json, 15 more kinds, then "other"
    assert folded[-1].kind == "other" and folded[-1].count == spilled == 25


# -- log events (H3) -------------------------------------------------------------------------

def oom_line(i: int) -> str:
    """A distinct, complete PyTorch OOM as vLLM's worker logs it (one line, ERROR)."""
    return (f"(VllmWorker rank=0 pid=123) ERROR 06-12 09:14:03 [multiproc_executor.py:527] torch.OutOfMemoryError: "
            f"CUDA out of memory. Tried to allocate {i + 1}.00 MiB. GPU 0 has a total capacity of 79.15 GiB of "
            "which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.00 GiB memory in use. Of "
            "the allocated memory 70.00 GiB is allocated by PyTorch, and 2.00 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
            "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)\n")


def test_a_flood_of_distinct_oom_lines_keeps_a_bounded_number_per_tick(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("")
    source = LogSource([str(log)])
    with open(log, "a") as fh:
        fh.writelines(oom_line(i) for i in range(2000))  # a second of the red team's flood
    snap = collect(source, Snapshot(NOW))
    assert len(snap.log_events) == MAX_EVENTS_PER_TICK
    assert [e.requested_bytes for e in snap.log_events[:2]] == [1 << 20, 2 << 20]  # the first ones, kept whole
    assert dict(snap.dropped) == {"log_events": 2000 - MAX_EVENTS_PER_TICK}


def test_the_raw_history_holds_a_bounded_number_of_log_events(tmp_path):
    analyzer = Analyzer()
    ticks = 60
    for t in range(ticks):
        events = tuple(OomMessage(kind="torch_cuda_oom", line=t * 64 + i, source="vllm.log", gpu="0",
                                  requested_bytes=(i + 1) << 20, message=oom_line(i)[:500])
                       for i in range(MAX_EVENTS_PER_TICK))
        analyzer.update(Snapshot(NOW + 5 * t, log_events=events))
    held = sum(len(s.log_events) for s in analyzer.history.recent(0))
    assert held == analyzer.history.max_log_events < ticks * MAX_EVENTS_PER_TICK
    assert analyzer.history.dropped_log_events == ticks * MAX_EVENTS_PER_TICK - held
    newest = analyzer.history.recent(NOW + 5 * (ticks - 1))[0]
    assert len(newest.log_events) == MAX_EVENTS_PER_TICK  # the newest are the ones kept


def test_the_raw_history_keeps_no_fault_records():
    history = History()
    errors = tuple(SourceError("allocator", "bad_json", f"gpumem-{i}-7.json: not JSON") for i in range(1000))
    history.update(Snapshot(NOW, errors=errors, gpus=probed_gpu()))
    (kept,) = history.recent(0)
    assert kept.errors == () and kept.gpus == probed_gpu()  # what the detectors and the recorder read


# -- vLLM pages (M6) -------------------------------------------------------------------------

def other_exporters_page(size: int = 7_600_000) -> str:
    """Valid exposition text without a vllm: series: the red team's 7.6 MB page."""
    lines, total, i = [], 0, 0
    while total < size:
        line = f'http_requests_total{{handler="/v1/x{i}",method="GET",status="200"}} {i}.0\n'
        lines.append(line)
        total += len(line)
        i += 1
    return "".join(lines)


@pytest.fixture
def parsed(monkeypatch):
    """What normalise() hands prometheus_client's parser, in characters (its cost)."""
    given = []
    real = vllm_normalise.text_string_to_metric_families

    def counting(text):
        given.append(len(text))
        return real(text)
    monkeypatch.setattr(vllm_normalise, "text_string_to_metric_families", counting)
    return given


def test_a_large_page_without_vllm_series_is_parsed_only_as_far_as_saying_so(parsed):
    with pytest.raises(vllm_normalise.ParseError, match="no vllm: metrics"):
        vllm_normalise.normalise(other_exporters_page())
    assert sum(parsed) <= vllm_normalise.MAX_SNIFF_CHARS  # not 7.6 MB every tick


def test_a_page_of_more_vllm_lines_than_its_budget_is_cut_and_says_so(monkeypatch):
    lines = []
    real = vllm_normalise._sample

    def counting(name, rest):
        lines.append(name)
        return real(name, rest)
    monkeypatch.setattr(vllm_normalise, "_sample", counting)
    page = "".join(f'vllm:num_requests_running{{model_name="m",engine="{i % 64}",replica="{i}"}} 1\n'
                   for i in range(50_000))
    result = vllm_normalise.normalise(page)
    assert result.truncated and len(result.engines) == 64
    assert len(lines) == vllm_normalise.MAX_SAMPLE_LINES  # not 50,000


class _Page(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_a_page_cut_at_its_budget_is_counted_in_the_tick(tmp_path):
    _Page.body = "".join(f'vllm:num_requests_running{{model_name="m",replica="{i}"}} 1\n'
                         for i in range(40_000)).encode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    source = VllmSource([VllmEndpoint(url=f"http://127.0.0.1:{server.server_port}/metrics", timeout_seconds=30)])
    try:
        reading: Reading = source.collect(Snapshot(NOW))
    finally:
        source.close()
        server.shutdown()
        server.server_close()
    (sample,) = reading.snapshot.vllm
    assert sample.up and sample.truncated and sample.engines[0].requests_running == 1.0
    assert reading.dropped == (("vllm_pages", 1),)
