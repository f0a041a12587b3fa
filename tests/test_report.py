"""The HTML post-mortem report: the leak scenario's report names the leaking process and its rate,
plots are embedded PNGs (none without matplotlib, the tables stay), all outside text is escaped."""
from __future__ import annotations

import base64
import re
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest

from exporter.config import build as build_config
from exporter.model import Episode, Finding, GpuSample, OomEvent, ProcessSample, Snapshot
from exporter.postmortem.analyze import replay_episodes
from exporter.postmortem.explain import events_in_lines as parse_lines
from exporter.postmortem.report import write_report
from exporter.postmortem.trace import read_trace
from exporter.runtime import build as build_runtime
from helpers.timeline import just_raised

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
GiB = 1 << 30
IMG = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def played(scenario: str, until: float, step: float = 10.0) -> list[Snapshot]:
    """The scenario's snapshots, sampled every `step` s through the simulated host, up to `until`."""
    runtime = build_runtime(build_config(), simulate=scenario, at=0.0)
    snapshots = []
    try:
        while runtime.clock.elapsed() < until:
            snapshots.append(runtime.sampler.sample())
            runtime.clock.advance(step)
    finally:
        runtime.close()
    return snapshots


@pytest.fixture(scope="module")
def leak_run():
    """The leak scenario's first 70 minutes, sampled every 10 s through the simulated host,
    replayed through the detectors; plus a fragmentation OOM parsed from a real log line."""
    snapshots = played("leak", 4200)
    episodes = replay_episodes(snapshots)[1].records()
    with open(FIXTURES / "torch_fragmentation.log", encoding="utf-8") as handle:
        events = parse_lines(handle, source="vllm.log")
    events = [replace(e, timestamp=snapshots[-20].timestamp, gpu="0") for e in events]
    return snapshots, episodes, events


@pytest.fixture
def mpl():
    """matplotlib as the report loads it (the `report` extra), or the test is skipped."""
    from exporter.postmortem import reportplots as plots

    loaded = plots.load()
    if loaded is None:
        pytest.skip("matplotlib (the report extra) is not installed")
    return loaded


def gpu_leak(episodes: list[Episode]) -> Finding:
    return next(e.finding for e in episodes if e.finding.kind == "leak" and e.finding.gpu is not None)



def section_of(html_text: str, finding: Finding) -> str:
    """The finding's detail block (its <div class="finding ...">)."""
    marker = f"GPU {finding.gpu}, pid {finding.pid}"
    start = html_text.index(marker, html_text.index('<div class="finding'))
    return html_text[start:html_text.index("</div>", start)]


def test_leak_report_names_the_process_and_its_rate(leak_run, tmp_path):
    snapshots, episodes, events = leak_run
    path = tmp_path / "leak.html"
    write_report(snapshots, episodes, events, str(path))
    text = path.read_text(encoding="utf-8")
    leak = gpu_leak(episodes)
    assert leak.process == "VLLM::EngineCore" and leak.pid == 3150
    detail = section_of(text, leak)
    assert "VLLM::EngineCore" in detail
    rate = float(re.search(r"([\d.]+) MiB/min", detail).group(1))
    assert 3.0 < rate < 5.0  # the scenario leaks 4 MiB/min
    expected = dict(leak.evidence)["slope_bytes_per_second"] * 60 / 2**20
    assert rate == pytest.approx(expected, abs=0.05)
    # Timeline, one GPU, and one curve per leak finding (GPU memory and host RSS).
    images = IMG.findall(text)
    leaks = [e for e in episodes if e.finding.pid is not None]
    assert len(images) == 1 + 1 + len(leaks) and len(leaks) >= 1
    for data in images:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    # The OOM event with its class and numbers, and its advice.
    [event] = events
    assert event.klass == "fragmentation" and event.requested_bytes
    oom = text[text.index("<h2>Out-of-memory events</h2>"):text.index("<h2>Advice</h2>")]
    assert event.kind in oom
    assert "fragmentation" in oom and "vllm.log:" in oom
    advice = text[text.index("<h2>Advice</h2>"):]
    for a in leak.advice[:2] + event.advice[:1]:
        assert re.sub(r"\s+", " ", __import__("html").escape(a)) in advice


def test_self_contained(leak_run, tmp_path):
    snapshots, episodes, events = leak_run
    path = tmp_path / "leak.html"
    write_report(snapshots, episodes, events, str(path))
    text = path.read_text(encoding="utf-8")
    assert "<script" not in text and "<link" not in text
    assert not re.search(r'(src|href)="(?!data:)', text)  # nothing fetched from elsewhere
    assert [p.name for p in tmp_path.iterdir()] == ["leak.html"]  # no temporary file left


def test_without_matplotlib_the_tables_remain(leak_run, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    snapshots, episodes, events = leak_run
    path = tmp_path / "plain.html"
    write_report(snapshots, episodes, events, str(path))
    text = path.read_text(encoding="utf-8")
    assert "<img" not in text and "matplotlib is not installed" in text
    leak = gpu_leak(episodes)
    detail = section_of(text, leak)
    assert "VLLM::EngineCore" in detail and 3.0 < float(re.search(r"([\d.]+) MiB/min", detail)[1]) < 5.0
    assert "fragmentation" in text and "<h2>Advice</h2>" in text


def test_outside_text_is_escaped(tmp_path):
    evil = "<script>alert(1)</script>"
    proc = ProcessSample(pid=7, used_bytes=GiB, name=evil, role="vllm")
    snaps = [Snapshot(timestamp=1_700_000_000.0 + 10 * i, gpus=(GpuSample(
        index="0", uuid="GPU-x", total_bytes=80 * GiB, used_bytes=GiB + i * 1000,
        free_bytes=79 * GiB, processes=(replace(proc, used_bytes=GiB + i * 1000),)),))
        for i in range(30)]
    finding = Finding(kind="leak", severity="critical", first_detected_at=snaps[20].timestamp,
                      gpu="0", pid=7, process=evil, summary=f"{evil} grows",
                      evidence=(("slope_bytes_per_second", 100.0), ("note", '"><img src=x>')),
                      advice=("restart <now> & check",))
    event = OomEvent(kind="torch_cuda_oom", klass="shortage", line=3, source="<b>log</b>",
                     message="CUDA out of memory <img src=x onerror=alert(1)>", advice=("a < b",))
    path = tmp_path / "evil.html"
    write_report(snaps, [just_raised(finding)], [event], str(path))
    text = path.read_text(encoding="utf-8")
    assert "<script>" not in text and "<img src=x" not in text and "<b>log</b>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "restart &lt;now&gt; &amp; check" in text and "a &lt; b" in text


def test_a_later_version_is_dated_beside_the_one_that_raised_it(tmp_path):
    """As `analyze`'s text does: a finding that changed while it lasted shows its last words
    dated, its evidence when raised and as last reported side by side, each under its time,
    and a cleared finding's advice as what was advised while it lasted."""
    t0 = 1_700_000_000.0
    snaps = [Snapshot(timestamp=t0 + 10 * i, gpus=(GpuSample(
        index="0", uuid="GPU-x", total_bytes=80 * GiB, used_bytes=2 * GiB, free_bytes=78 * GiB,
        processes=(ProcessSample(pid=7, used_bytes=GiB, name="python3"),)),)) for i in range(40)]
    first = Finding(kind="leak", severity="warning", first_detected_at=t0 + 200, gpu="0", pid=7, process="python3",
                    summary="grows at 2.0 MiB/min", evidence=(("slope_bytes_per_second", 35000.0), ("z", 6.1)),
                    advice=("restart it",))
    later = replace(first, severity="critical", summary="grows at 4.0 MiB/min",
                    evidence=(("slope_bytes_per_second", 70000.0), ("z", 9.3), ("time_to_full_seconds", 3600.0)))
    path = tmp_path / "r.html"
    write_report(snaps, [Episode(later, first, t0 + 260, cleared_at=t0 + 290)], [], str(path))
    text = path.read_text(encoding="utf-8")

    def when(t: float) -> str:
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")

    detail = section_of(text, later)
    assert f"<p>as last reported {when(t0 + 260)}: grows at 4.0 MiB/min</p>" in detail
    assert f"<th>when raised, {when(t0 + 200)}</th><th>as last reported, {when(t0 + 260)}</th>" in detail
    rows = {cells[0]: cells[1:] for cells in (re.findall(r"<td[^>]*>(.*?)</td>", row)
                                              for row in re.findall(r"<tr>(.*?)</tr>", detail)) if cells}
    assert rows["z"] == ["6.1", "9.3"]
    assert rows["time_to_full_seconds"] == ["", "1h00m00s (3600 s)"]  # not in the first version
    assert "What was advised while it lasted:</p>\n<ul><li>restart it</li>" in detail
    findings_table = text[text.index("<h2>Findings</h2>"):text.index("<h2>Finding details</h2>")]
    assert f"as last reported {when(t0 + 260)}: grows at 4.0 MiB/min" in findings_table
    assert "<li>restart it <span class=\"note\">&mdash; for leak (GPU 0, pid 7 (python3), cleared)</span></li>" \
        in text[text.index("<h2>Advice</h2>"):]

    # One version, still active: its words undated, one column of evidence, advice as advice.
    write_report(snaps, [just_raised(first)], [], str(path))
    detail = section_of(path.read_text(encoding="utf-8"), first)
    assert "<p>grows at 2.0 MiB/min</p>" in detail and "as last reported" not in detail
    assert "<th>evidence</th><th>value</th>" in detail and "while it lasted" not in detail


def test_an_empty_trace_still_makes_a_page(tmp_path):
    path = tmp_path / "empty.html"
    write_report([], [], [], str(path))
    text = path.read_text(encoding="utf-8")
    assert "The trace holds no samples" in text and "No findings." in text
    assert "No log was given" in text and "no out-of-memory event" in text
    assert text.rstrip().endswith("</html>")


def test_an_unwritable_path_raises_a_clear_os_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(NotADirectoryError):
        write_report([], [], [], str(blocker / "report.html"))


# ------------------------------------------------------------------ the trial's report (#19)

def test_an_event_outside_the_trace_is_shown_apart_not_counted_nor_advised(leak_run, tmp_path):
    """A log event from a year before the trace is another incident: it has a section of its own,
    the header counts only the trace's events, and its advice is not the incident's."""
    snapshots, episodes, events = leak_run
    [event] = events
    old = replace(event, timestamp=snapshots[0].timestamp - 368 * 86400, line=99,
                  advice=("An old incident's own advice.",))
    path = tmp_path / "r.html"
    write_report(snapshots, episodes, [old], str(path))
    text = path.read_text(encoding="utf-8")
    header = text[:text.index("<h2>Host</h2>")]
    assert "findings, 0 out-of-memory events" in header
    assert "(1 more in the logs outside the trace's time, listed apart)" in header
    oom = text[text.index("<h2>Out-of-memory events</h2>"):text.index("<h2>Advice</h2>")]
    mine, apart = oom.split("Outside the trace's time</h3>")
    assert "no out-of-memory event within the trace's time" in mine and "vllm.log:99" not in mine
    assert "vllm.log:99" in apart and "368 days 0h00m before the trace starts" in apart
    assert "An old incident" not in text[text.index("<h2>Advice</h2>"):]


def test_span_text_reads_in_days_for_long_spans():
    from exporter.postmortem.report import outside_text, span_text

    assert span_text(125) == "2m05s" and span_text(5 * 3600 + 243) == "5h04m03s"
    assert span_text(8849 * 3600 + 243) == "368 days 17h04m"
    assert span_text(86400 + 3600) == "1 day 1h00m"
    assert outside_text(0.0, 8849 * 3600 + 243, 9000 * 3600) == "368 days 17h04m before the trace starts"


def test_the_oom_table_wraps_its_long_columns_and_the_host_table_fills_its_memory(leak_run, tmp_path):
    snapshots, episodes, events = leak_run
    [event] = events
    crowded = replace(event, other_processes=tuple((20000 + i, (i + 1) * GiB) for i in range(12)))
    path = tmp_path / "r.html"
    write_report(snapshots, episodes, [crowded], str(path))
    text = path.read_text(encoding="utf-8")
    assert "td.wrap{max-width:16em;overflow-wrap:anywhere}" in text
    cell = re.search(r'<td class="wrap">(pid 20000[^<]*(?:<br>[^<]*)*)</td>', text)
    assert cell and cell.group(1).count("<br>") == 11  # one process a line, in a narrow column
    host = text[text.index("<h2>Host</h2>"):text.index("<h2>Findings</h2>")]
    rows = re.findall(r"<tr><td>0</td><td>[^<]*</td><td[^>]*>[^<]*</td><td>([^<]*)</td></tr>", host)
    assert rows == ["its own (discrete)"]


def test_the_gpu_chart_keeps_its_legend_off_the_plot(leak_run, mpl):
    """The legend sat over the bottom left, where the start-up ramp is: it goes under the axis."""
    from exporter.postmortem import reportplots as plots

    snapshots, _, _ = leak_run
    t = [s.timestamp for s in snapshots]
    parts = [[int(i * GiB / 10) for i in range(len(t))]] * 4
    fig = plots.gpu(mpl, "0", t, parts, (), ())
    mpl[1](fig)
    fig.canvas.draw()
    (ax,) = fig.axes
    legend = ax.get_legend().get_window_extent()
    plot = ax.get_window_extent()
    assert legend.y1 <= plot.y0  # wholly under the plotting area


def test_the_charts_draw_no_line_across_a_gap_in_the_trace(leak_run, mpl):
    """The daemon was down for an hour: neither chart may draw memory over that hour."""
    import math

    from exporter.postmortem import reportplots as plots

    snapshots, _, _ = leak_run
    t = [s.timestamp for s in snapshots]
    t = t[:len(t) // 2] + [x + 3600 for x in t[len(t) // 2:]]
    vs = [int(GiB + i * (1 << 20)) for i in range(len(t))]
    stacked = plots.gpu(mpl, "0", t, [vs] * 4, (), ())
    (ax,) = stacked.axes
    # stackplot fills between NaN-free runs only: two runs of polygons per layer, not one.
    assert len(ax.collections) == 4
    assert all(len(c.get_paths()) == 2 for c in ax.collections)
    f = Finding(kind="leak", severity="warning", first_detected_at=t[-1], gpu="0", pid=7,
                process="python3", summary="grows")
    line = plots.process(mpl, f, t, vs, t[-1]).axes[0].lines[0]
    ys = list(line.get_ydata())
    gaps = [i for i, y in enumerate(ys) if math.isnan(y)]
    assert len(gaps) == 1 and not math.isnan(ys[gaps[0] - 1]) and not math.isnan(ys[gaps[0] + 1])
    # Without the gap, one unbroken run.
    assert not any(math.isnan(y) for y in plots.process(mpl, f, t[:len(t) // 2], vs[:len(t) // 2],
                                                         t[-1]).axes[0].lines[0].get_ydata())


def test_the_leak_chart_zooms_on_the_growth_not_the_start_up(mpl):
    """vllm_leak.csv: the model loads (0 -> 50 GiB) a minute after the trace starts, and the
    detector's window reaches back before it. The chart drew the line from the load and its y
    axis from 0 GiB, a 0.5 GiB growth then a flat line: both start after the load now."""
    from exporter.postmortem import reportplots as plots

    snapshots = read_trace(str(Path(__file__).parent / "fixtures" / "traces" / "vllm_leak.csv"))
    episodes = replay_episodes(snapshots)[1].records()
    f = gpu_leak(episodes)
    ts = [s.timestamp for s in snapshots]
    vs = [next(p.used_bytes for p in s.gpus[0].processes if p.pid == f.pid) if any(
        p.pid == f.pid for p in s.gpus[0].processes) else 0 for s in snapshots]
    line = plots.fitted_line(ts, vs, f, ts[-1])
    loaded = next(t for t, v in zip(ts, vs, strict=True) if v > 40 * GiB)
    assert line is not None and line[1][0] >= loaded
    (ax,) = plots.process(mpl, f, ts, vs, ts[-1]).axes
    assert ax.get_ylim()[0] > 40  # GiB: zoomed on the growth


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """stale-memory's first 20 min (the engine exits at 10 min, the server restarts at 0.6 under a
    new pid) and its report's text."""
    snapshots = played("stale-memory", 1200)
    path = tmp_path_factory.mktemp("report") / "stale.html"
    write_report(snapshots, replay_episodes(snapshots)[1].records(), [], str(path))
    return snapshots, path.read_text(encoding="utf-8")


def test_the_processes_table_says_when_a_restarted_servers_old_engine_was_last_seen(restarted):
    snapshots, text = restarted
    table = text.split("<h2>Processes</h2>", 1)[1].split("</table>", 1)[0]
    assert "<th>last seen</th>" in table
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in table.split("<tr>")[2:]]
    last_seen = {int(row[1]): row[5] for row in rows}
    assert len(last_seen) == 2, rows

    def seen(pid):
        return [s.timestamp for s in snapshots if any(p.pid == pid for g in s.gpus for p in g.processes)]

    old, new = sorted(last_seen, key=lambda pid: seen(pid)[0])
    assert max(seen(old)) < snapshots[-1].timestamp - 300  # it exited
    assert last_seen[old] == datetime.fromtimestamp(max(seen(old)), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert last_seen[new] == "at the end"


def test_each_start_of_a_restarted_server_has_its_own_start_up_figures(restarted):
    # A newcomer's trial: the restarted (0.6) start's KV cache, 27 GiB, was shown beside the first
    # (0.9) start's settings, whose own log said 51.5 GiB.
    section = restarted[1].split("<h2>vLLM servers</h2>", 1)[1].split("<h2>Processes", 1)[0]
    first = re.search(r"<p>Settings from [^<]*gpu_memory_utilization 0\.9[^<]*</p>", section)
    restart = re.search(r"restarted with gpu_memory_utilization 0\.6[^<]*</li>", section)
    assert first and restart, section
    assert "start-up log: weights 14.99 GiB, KV cache 51.50 GiB" in first.group(0)
    assert "start-up log: weights 14.99 GiB, KV cache 27.00 GiB" in restart.group(0)
    assert re.search(r"capacity 221,184 tokens since \d{4}-", section)


def test_a_trace_of_process_bytes_only_counts_its_gpu(tmp_path):
    # A CSV trace holds each process's bytes but not the GPU's: nothing to chart as the GPU's
    # stack, and the header still counts the GPU the samples are of (a newcomer's trial read
    # "1381 samples of 0 GPUs").
    proc = ProcessSample(pid=7, used_bytes=GiB, name="python3", role="vllm")
    snaps = [Snapshot(timestamp=1_700_000_000.0 + 5 * i, gpus=(GpuSample(
        index="0", uuid="GPU-x", total_bytes=80 * GiB, used_bytes=None, processes=(proc,)),))
        for i in range(12)]
    path = tmp_path / "processes.html"
    write_report(snaps, [], [], str(path))
    assert "12 samples of 1 GPU from" in path.read_text(encoding="utf-8")
