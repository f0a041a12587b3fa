"""Traces and reports are safe to open, and `analyze` is bounded (#21 item 4, H4 H5 M4 M5 M8 L4
L5): links only where the allow-list says, the report written without following a link, no
spreadsheet formula or control character in a cell, a trace of any tick reads back, a hostile
Prometheus cannot hold more than one answer in memory, nesting and size limits are errors."""
from __future__ import annotations

import csv
import json
import os
import re
import stat
import threading
import tracemalloc
from html import unescape
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from exporter.model import (
    AllocatorStats,
    Analysis,
    Finding,
    GpuSample,
    OomMessage,
    ProcessSample,
    Snapshot,
    State,
)
from exporter.postmortem import promquery
from exporter.postmortem import trace as trace_module
from exporter.postmortem.report import ALLOWED_URLS, render_report, write_report
from exporter.postmortem.trace import TraceError, load_traces, read_trace, write_csv
from exporter.reactions.recorder import FlightRecorder
from helpers.daemon import analyze
from helpers.timeline import just_raised
from helpers.tools import HANG

GiB = 1 << 30
T0 = 1_732_280_400.0
HOSTILE = "=cmd|'/C calc'!A0"



def snaps_with(process: ProcessSample, n: int = 5, **snapshot) -> list[Snapshot]:
    return [Snapshot(timestamp=T0 + 10 * i, gpus=(GpuSample(
        "0", "GPU-a", total_bytes=80 * GiB, used_bytes=2 * GiB, free_bytes=78 * GiB,
        processes=(process,)),), **snapshot) for i in range(n)]


# ------------------------------------------------------------------ H4: links

LINK = re.compile(r'<a\s[^>]*href="([^"]*)"', re.I)
SOURCE = re.compile(r'\ssrc="([^"]*)"', re.I)
DUMP = re.compile(r"gpumem-\d{1,20}-\d{1,10}-[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\.pickle")


def assert_links_allowed(html: str) -> None:
    """Every link leads to an allowed site, or is a path on this machine to a dump."""
    for href in LINK.findall(html):
        href = unescape(href)
        parts = urlsplit(href)
        local = not parts.scheme and not parts.netloc and DUMP.fullmatch(href.rsplit("/", 1)[-1])
        assert href in ALLOWED_URLS or local, href
    for src in SOURCE.findall(html):
        assert src.startswith("data:image/png;base64,"), src[:80]


@pytest.mark.parametrize("history_file", ["javascript:alert(document.domain)",
                                          "JaVaScRiPt:alert(1)", "data:text/html,<script>x</script>",
                                          "https://evil.example/x.pickle", "../../etc/passwd"])
def test_a_hostile_history_file_in_a_trace_never_becomes_a_link(tmp_path, history_file):
    stats = AllocatorStats(reserved_bytes=GiB, history_state="done", history_file=history_file,
                           history_request="r1")
    proc = ProcessSample(pid=9, used_bytes=GiB, name="python", role="vllm", allocator=stats)
    trace, report = tmp_path / "t.csv", tmp_path / "r.html"
    write_csv(snaps_with(proc), str(trace))
    analyze(trace, "--report", report)
    html = report.read_text(encoding="utf-8")
    assert "javascript:" not in html.lower() and "evil.example" not in html
    assert_links_allowed(html)


@pytest.mark.parametrize("probe_dir", ["javascript:alert(1)//x", "//evil.example/share",
                                       "https://evil.example", "/run/gpumem-probe"])
def test_a_dump_link_is_a_path_on_this_machine_whatever_the_probe_directory(probe_dir):
    stats = AllocatorStats(history_state="done", history_file="gpumem-0-9-r1.pickle")
    proc = ProcessSample(pid=9, used_bytes=GiB, name="python", allocator=stats)
    finding = Finding(kind="leak", severity="warning", first_detected_at=T0, gpu="0", pid=9)
    html = render_report(snaps_with(proc), [just_raised(finding)], [], probe_dir=probe_dir)
    assert_links_allowed(html)
    assert "https://pytorch.org/memory_viz" in LINK.findall(html)  # the allowed link stays
    assert "gpumem-0-9-r1.pickle" in html  # the dump is named, a link or not


# ------------------------------------------------------------------ H5: no link followed

def test_the_report_is_never_written_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("root's secret\n")
    victim.chmod(0o600)
    reports = tmp_path / "reports"
    reports.mkdir()
    target = reports / "report.html"
    # The old writer's temporary name was predictable: <path>.tmp.<pid>.
    (reports / f"report.html.tmp.{os.getpid()}").symlink_to(victim)
    target.symlink_to(victim)
    write_report(snaps_with(ProcessSample(pid=1, used_bytes=GiB)), [], [], str(target))
    assert victim.read_text() == "root's secret\n"
    st = os.lstat(target)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert "<!DOCTYPE html>" in target.read_text()


# ------------------------------------------------------------------ M5: cells safe to open

def test_trace_cells_are_neither_formulas_nor_control_characters(tmp_path):
    proc = ProcessSample(pid=5, used_bytes=GiB, name=HOSTILE, container="+SUM(A1:A9)", pod="@x",
                         namespace="-2+3", endpoint="\x1b]0;owned\x07http://x\x1b[2J", role="vllm")
    path = tmp_path / "t.csv"
    write_csv(snaps_with(proc, 2), str(path))
    raw = path.read_bytes().decode("utf-8")
    assert not re.search(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]", raw.replace("\r\n", ""))
    with open(path, newline="", encoding="utf-8") as handle:
        for row in csv.reader(handle):
            for cell in row:
                assert not cell.lstrip().startswith(("=", "+", "-", "@")), cell
    # ... and the reader gives the names back as they were, less the control characters
    (p,) = read_trace(str(path))[0].gpus[0].processes
    assert (p.name, p.container, p.pod, p.namespace) == (HOSTILE, "+SUM(A1:A9)", "@x", "-2+3")
    assert p.endpoint == "]0;ownedhttp://x[2J"


def test_control_characters_never_reach_the_report(tmp_path):
    name = "x\x1b[31mred\x07\x9b"
    proc = ProcessSample(pid=5, used_bytes=GiB, name=name, role="vllm")
    finding = Finding(kind="leak", severity="warning", first_detected_at=T0 + 20, gpu="0", pid=5,
                      process=name, summary=f"{name} grows", advice=("kill \x1b[2J it",))
    oom = OomMessage(kind="torch_cuda_oom", line=1, source="v\x1b.log", message="CUDA out \x1b[5m of memory")
    from exporter.analysis.oom import classify
    html = render_report(snaps_with(proc), [just_raised(finding)], [classify(oom)])
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", html)
    assert "x[31mred" in html and "CUDA out [5m of memory" in html


# ------------------------------------------------------------------ M4: every trace reads back

def flood(count: int) -> tuple[OomMessage, ...]:
    return tuple(OomMessage(kind="torch_cuda_oom", line=i + 1, source="/var/log/vllm/worker.log",
                            message="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                                    f"{i} MiB. GPU 0 has a total capacity of 79.19 GiB of which "
                                    "1.02 GiB is free. " + "x" * 200,
                            gpu="0", requested_bytes=i << 20, total_bytes=85 * GiB,
                            free_bytes=GiB) for i in range(count))


def test_a_tick_with_hundreds_of_oom_lines_still_reads_back(tmp_path):
    """The daemon's recorder writes the trace of a tick that read 400 OOM lines; it reads back,
    with as many events as fit and the count of the rest, and analyze says so."""
    recorder = FlightRecorder(str(tmp_path / "rec"), window_seconds=600, debounce_seconds=0)
    try:
        proc = ProcessSample(pid=5, used_bytes=GiB, name="python")
        snaps = snaps_with(proc, 10)
        snaps[-1] = Snapshot(timestamp=snaps[-1].timestamp, gpus=snaps[-1].gpus,
                             log_events=flood(400))
        state = State(snapshot=snaps[-1], analysis=Analysis(snaps[-1].timestamp, (),
                                                            transitions=("oom",)))
        recorder.observe(state, lambda since: [s for s in snaps if s.timestamp >= since])
        assert recorder.flush(HANG)
    finally:
        recorder.close(timeout=HANG)
    (path,) = (tmp_path / "rec").glob("gpumem-*.csv")
    trace = load_traces([str(path)])
    kept = len(trace.snapshots[-1].log_events)
    assert 50 < kept < 400
    assert trace.dropped == [(snaps[-1].timestamp, "oom_events", 400 - kept)]
    out = analyze(path).stdout
    assert f"left out what did not fit in its cells: {400 - kept:,} oom_events" in out


# ------------------------------------------------------------------ L4: nesting

def test_deeply_nested_json_is_a_clear_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    proc = analyze(deep, check=False)
    assert proc.returncode == 2 and "nested too deeply" in proc.stderr, proc.stderr[-500:]
    assert "Traceback" not in proc.stderr
    cell = tmp_path / "cell.csv"
    cell.write_text("timestamp,gpu,pid,process,used_bytes,vllm\n"
                    f'1,0,,,5,"{"[" * 50_000}{"]" * 50_000}"\n')
    with pytest.raises(TraceError, match=r"cell.csv:2: vllm is nested too deeply"):
        read_trace(str(cell))


# ------------------------------------------------------------------ M8: a hostile Prometheus

def junk_answer(mib: float) -> bytes:
    """A valid range-query answer of about `mib` MiB of series analyze does not use."""
    series = json.dumps({"metric": {"__name__": "junk", "x": "y"},
                         "values": [[T0 + i, "1"] for i in range(2000)]})
    count = int(mib * (1 << 20) / len(series)) + 1
    return ('{"status":"success","data":{"resultType":"matrix","result":['
            + ",".join([series] * count) + "]}}").encode()


@pytest.fixture
def hostile_prometheus():
    """A real HTTP server on loopback that answers every query with the body it is given."""
    state = {"body": b"{}", "queries": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            state["queries"] += 1
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(state["body"])))
            self.end_headers()
            try:
                self.wfile.write(state["body"])
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading at its cap, as it should

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(HANG)


def test_a_prometheus_answer_over_the_cap_is_refused(hostile_prometheus):
    state, url = hostile_prometheus
    state["body"] = junk_answer(17)  # over the cap, well under the old 64 MiB one
    with pytest.raises(promquery.PromQueryError, match="over the 16777216 byte limit"):
        promquery.fetch(url, T0, T0 + 3600)
    assert state["queries"] == 1  # refused at the first answer


def test_memory_holds_one_answer_at_a_time_not_every_answer(hostile_prometheus):
    """Twelve series are asked for; each answer is turned into rows and let go before the next
    one is read, so the peak is about one answer's parse, not twelve."""
    state, url = hostile_prometheus
    state["body"] = junk_answer(1)
    tracemalloc.start()
    try:
        json.loads(state["body"])
        one = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        with pytest.raises(promquery.PromQueryError, match="no gpumem_process_memory_used_bytes samples"):
            promquery.fetch(url, T0, T0 + 3600)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert state["queries"] == 12
    assert peak < 3 * one, (peak, one)


# ------------------------------------------------------------------ L5: limits that match the cost

def test_more_sampling_times_than_the_limit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_module, "MAX_TICKS", 50)
    path = tmp_path / "long.csv"
    path.write_text("timestamp,gpu,pid,process,used_bytes\n"
                    + "".join(f"{T0 + i},0,7,python,{GiB}\n" for i in range(60)))
    with pytest.raises(TraceError, match=r"long.csv:52: the traces hold more than 50 sampling times"):
        load_traces([str(path)])
    monkeypatch.setattr(trace_module, "MAX_TICKS", 60)
    assert len(load_traces([str(path)]).snapshots) == 60


def test_what_the_recorder_writes_the_reader_takes(tmp_path, monkeypatch):
    """The writer keeps a trace within the reader's limits (the newest ticks, the rest counted),
    so no trace the daemon writes is refused when it is read back."""
    monkeypatch.setattr(trace_module, "MAX_TICKS", 40)
    from exporter.postmortem import tracecsv
    monkeypatch.setattr(tracecsv, "MAX_TICKS", 40)
    monkeypatch.setattr(tracecsv, "MAX_ROWS", 1000)
    proc = ProcessSample(pid=5, used_bytes=GiB, name="python")
    path = tmp_path / "t.csv"
    write_csv(snaps_with(proc, 100), str(path))
    trace = load_traces([str(path)])
    assert [s.timestamp for s in trace.snapshots] == [T0 + 10 * i for i in range(60, 100)]
    assert trace.dropped == [(T0 + 600, "ticks", 60)]
