"""`analyze` and its report tell one story (#19 item 4): traces of different runs are not merged
unless asked, the log's part is said (none given, events outside the trace), every chart marks
the trigger, the report has the vLLM servers' settings and the host's identity, and each heading
stands over what it names."""
from __future__ import annotations

import json
import re
import time
from html.parser import HTMLParser

import pytest

from exporter.model import (
    CacheConfig,
    Finding,
    GpuSample,
    HostMemory,
    ProcessSample,
    Snapshot,
    VllmEngineStats,
    VllmSample,
)
from exporter.postmortem import reportplots
from exporter.postmortem.runs import RunIdentity
from exporter.postmortem.trace import TraceError, load_traces, write_csv
from helpers.daemon import Daemon, analyze
from helpers.timeline import just_raised
from helpers.tools import HANG

GiB = 1 << 30
T0 = 1_732_280_400.0  # 2024-11-22 13:00:00 UTC
ENDPOINT = "http://127.0.0.1:8000"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
HOST_A = RunIdentity("gpu-host-a", "3f1c0b7e-1111-4d5e-9a61-0c2a6f0e1a01", "a1b2c3d4e5f60718")


def serving(t, pid, used, restarted_at=None):
    return ProcessSample(pid=pid, used_bytes=used, name="VLLM::EngineCor", role="vllm",
                         endpoint=ENDPOINT, start_time=restarted_at or T0 - 600)


def vllm(utilization, blocks, pid, kv=0.5):
    return VllmSample(endpoint=ENDPOINT, up=True, pids=(pid,),
                      engines=(VllmEngineStats(model=MODEL, engine="0", kv_cache_usage_ratio=kv,
                                               requests_running=4, requests_waiting=0),),
                      cache_config=CacheConfig(gpu_memory_utilization=utilization,
                                               num_gpu_blocks=blocks, block_size=16))


def restart_story(ticks=240, exit_tick=180, restart_tick=200):
    """A vLLM server at gpu_memory_utilization 0.9 exits (a trigger) and leaves its 70 GiB
    behind; it comes back at 0.6, while a notebook beside it grows 64 MiB a minute."""
    snaps = []
    for i in range(ticks):
        t = T0 + 10 * i
        procs = [ProcessSample(pid=300, used_bytes=10 * GiB + i * (64 << 20) // 6, name="jupyter",
                               start_time=T0 - 60)]
        if i < exit_tick:
            procs.insert(0, serving(t, 100, 70 * GiB))
            server, stale = vllm(0.9, 7000, 100, kv=0.4 + i / 400), 0
        elif i < restart_tick:
            server, stale = VllmSample(endpoint=ENDPOINT, up=False, error_kind="refused"), 70 * GiB
        else:
            procs.insert(0, serving(t, 200, 45 * GiB, T0 + 10 * restart_tick))
            server, stale = vllm(0.6, 3000, 200, kv=0.3), 0
        used = sum(p.used_bytes for p in procs) + stale
        snaps.append(Snapshot(timestamp=t, host=HostMemory(512 * GiB, 400 * GiB), vllm=(server,),
                              gpus=(GpuSample("0", "GPU-a", total_bytes=96 * GiB, used_bytes=used,
                                              free_bytes=96 * GiB - used, processes=tuple(procs)),)))
    return snaps


def simple(t0, n=30, step=10.0):
    return [Snapshot(timestamp=t0 + step * i, gpus=(GpuSample(
        "0", "GPU-a", total_bytes=80 * GiB, used_bytes=11 * GiB, free_bytes=69 * GiB,
        processes=(ProcessSample(pid=7, used_bytes=10 * GiB, name="python"),)),)) for i in range(n)]


# ------------------------------------------------------------------ traces of different runs

def test_traces_months_apart_are_not_merged_unless_asked(tmp_path):
    # Five-column traces name no run: the gap alone tells (75 days apart, as in the issue).
    a, b = tmp_path / "november.csv", tmp_path / "february.csv"
    for path, start in ((a, T0), (b, T0 + 75 * 86400)):
        path.write_text("timestamp,gpu,pid,process,used_bytes\n"
                        + "".join(f"{start + 10 * i},0,7,python,{GiB}\n" for i in range(20)))
    proc = analyze(a, b, check=False)
    assert proc.returncode == 2
    assert "february.csv starts 1,799.9 h after" in proc.stderr and "--merge-runs" in proc.stderr
    merged = analyze(a, b, "--merge-runs", "--format", "json")
    assert json.loads(merged.stdout)["trace"]["samples"] == 40


def test_traces_of_another_host_or_boot_are_not_merged(tmp_path):
    paths = {}
    for name, run, start in (("a", HOST_A, T0), ("b", RunIdentity("gpu-host-b", HOST_A.boot_id, "ff"), T0 + 300),
                             ("c", RunIdentity("gpu-host-a", "another-boot", "ee"), T0 + 300)):
        paths[name] = tmp_path / f"{name}.csv"
        write_csv(simple(start), str(paths[name]), identity=run)
    with pytest.raises(TraceError, match=r"on different hosts \('gpu-host-a' and 'gpu-host-b'\)"):
        load_traces([paths["a"], paths["b"]])
    with pytest.raises(TraceError, match="in different boots of 'gpu-host-a'"):
        load_traces([paths["a"], paths["c"]])
    trace = load_traces([paths["a"], paths["b"]], merge_runs=True)
    assert len(trace.runs) == 2 and len(trace.snapshots) == 60


def test_traces_of_one_run_merge_as_before(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    write_csv(simple(T0), str(a), identity=HOST_A)
    write_csv(simple(T0 + 600), str(b), identity=HOST_A)  # 5 min after a ends: one stretch
    trace = load_traces([a, b])
    assert trace.runs == [HOST_A] and len(trace.snapshots) == 60


@pytest.mark.integration
@pytest.mark.slow
def test_the_readme_recipe_run_twice_is_refused_not_mixed(tmp_path):
    """The README's post-mortem recipe, twice into one directory: two exporter runs whose
    simulated clocks overlap. Merged they gave "exited 3 min ago and 20.0 GiB of the 1.6 GiB it
    held is still in use"; now analyze refuses and says why."""
    traces = tmp_path / "traces"
    config = tmp_path / "recorder.yml"
    config.write_text(f"recorder: {{directory: {traces}, tail_seconds: 300}}\n")
    for run in (1, 2):
        # As the README: the server exits 5 s in, time for the first tick to see it serving.
        d = Daemon("--config", str(config), "--simulate", "stale-memory", "--speed", "120",
                   "--interval", "5")
        try:
            d.wait_healthy()
            deadline = time.monotonic() + HANG
            while time.monotonic() < deadline and len(list(traces.glob("gpumem-*.csv"))) < run:
                time.sleep(0.2)
        finally:
            d.stop()
        assert len(list(traces.glob("gpumem-*.csv"))) == run, f"run {run} wrote no trace"
    files = sorted(traces.glob("gpumem-*.csv"))
    proc = analyze(*files, check=False)
    assert proc.returncode == 2, proc.stdout
    assert "by different runs of the exporter" in proc.stderr and "--merge-runs" in proc.stderr
    alone = analyze(files[0])
    assert "Recorded on host " in alone.stdout and "exporter run " in alone.stdout


# ------------------------------------------------------------------ the logs' part

def test_no_log_given_is_said_and_not_taken_for_no_oom(tmp_path):
    trace, report = tmp_path / "t.csv", tmp_path / "r.html"
    write_csv(simple(T0), str(trace), identity=HOST_A)
    done = analyze(trace, "--report", report)
    assert "no log given" in done.stdout and f"report written to {report}" in done.stderr
    html = report.read_text()
    assert "No log was given" in html and "No out-of-memory events were found in the logs" not in html


# ------------------------------------------------------------------ the report

class Sections(HTMLParser):
    """The report's text and tags grouped under each <h2>."""

    def __init__(self):
        super().__init__()
        self.sections: dict[str, list[str]] = {"": []}
        self.current = ""
        self.in_h2 = False
        self.imgs: list[dict[str, str]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "h2":
            self.in_h2, self.current = True, ""
        elif tag == "img":
            self.imgs.append(dict(attrs))
        self.sections.setdefault(self.current, []).append(f"<{tag} {dict(attrs).get('class', '')}>")

    def handle_endtag(self, tag):
        if tag == "h2":
            self.in_h2 = False
            self.sections.setdefault(self.current, [])

    def handle_data(self, data):
        if self.in_h2:
            self.current += data
        else:
            self.sections.setdefault(self.current, []).append(data)

    def text(self, heading):
        return " ".join(self.sections[heading])


@pytest.fixture(scope="module")
def restart_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restart")
    trace, report = tmp / "gpumem-20241122T130640Z-vllm_exit.csv", tmp / "incident.html"
    snaps = restart_story()
    write_csv(snaps, str(trace), triggers={snaps[180].timestamp: ["vllm_exit"]}, identity=HOST_A)
    out = analyze(trace, "--report", report)
    page = Sections()
    page.feed(report.read_text(encoding="utf-8"))
    return out.stdout, page, snaps


def test_the_report_names_the_host_and_the_run(restart_report):
    _, page, _ = restart_report
    host = page.text("Host")
    assert HOST_A.hostname in host and HOST_A.boot_id in host and HOST_A.exporter_run in host
    assert "GPU-a" in host  # the GPUs, by UUID


def test_the_vllm_section_says_the_restart_at_a_lower_utilization(restart_report):
    text, page, _ = restart_report
    section = page.text("vLLM servers")
    assert ENDPOINT in section and MODEL in section
    assert "gpu_memory_utilization 0.9" in section  # the first settings
    restart = re.search(r"2024-11-22 13:33:20 UTC\s*:\s*restarted with gpu_memory_utilization 0.6 "
                        r"\(was 0.9\), GPU blocks 3,000 \(was 7,000\)", section)
    assert restart, section
    assert "86.40 GiB, then 57.60 GiB" in section  # the budget: 0.9, then 0.6, of 96 GiB
    assert "KV cache usage peaked at 85%" in section
    # analyze's text says the restart too
    assert "restarted with gpu_memory_utilization 0.6 (was 0.9)" in text


def test_each_heading_stands_over_what_it_names(restart_report):
    _, page, _ = restart_report
    details = page.sections["Finding details"]
    assert any("finding" in tag for tag in details)  # the finding blocks are here ...
    processes = page.sections["Processes"]
    assert not any("finding" in tag for tag in processes)  # ... not under "Processes"
    assert "jupyter" in page.text("Processes") and "VLLM::EngineCor" in page.text("Processes")
    assert [h for h in page.sections if h] == ["Host", "Findings", "Finding details", "GPU memory",
                                               "vLLM servers", "Processes", "Out-of-memory events",
                                               "Advice"]


def test_every_chart_marks_the_trigger(restart_report):
    _, page, _ = restart_report
    charts = page.imgs
    assert len(charts) >= 3  # the timeline, the GPU, a process
    for img in charts:
        assert "trigger vllm_exit at 2024-11-22 13:30:00 UTC marked" in img["alt"], img["alt"]


def test_the_trigger_line_is_drawn_where_the_trigger_was():
    mpl = reportplots.load()
    if mpl is None:
        pytest.skip("the report extra (matplotlib) is not installed")
    snaps = restart_story()
    at = snaps[180].timestamp
    finding = Finding(kind="leak", severity="warning", first_detected_at=at - 600, gpu="0",
                      pid=300, process="jupyter", summary="grows",
                      evidence=(("slope_bytes_per_second", 1118481.1), ("window_seconds", 480.0)))
    t = [s.timestamp for s in snaps]
    parts = ([70 * GiB] * len(t), [20 * GiB] * len(t), [0] * len(t), [6 * GiB] * len(t))
    figures = [reportplots.timeline(mpl, [just_raised(finding)], t[0], t[-1], [(at, "vllm_exit")]),
               reportplots.gpu(mpl, "0", t, parts, [], [just_raised(finding)], [(at, "vllm_exit")]),
               reportplots.process(mpl, finding, t, parts[0], t[-1], [(at, "vllm_exit")])]
    want = mpl[2].date2num(reportplots._dt([at])[0])
    for fig in figures:
        (ax,) = fig.axes
        marks = [line for line in ax.get_lines() if line.get_gid() == reportplots.TRIGGER_GID]
        assert [float(line.get_xdata()[0] if not hasattr(line.get_xdata()[0], "tzinfo")
                      else mpl[2].date2num(line.get_xdata()[0])) for line in marks] == [
            pytest.approx(want)]
        assert "trigger: vllm_exit" in [t.get_text() for t in ax.get_legend().get_texts()]
        lo, hi = ax.get_xlim()
        assert lo <= want <= hi
