"""The command line, end to end: real subprocesses, real HTTP on loopback, real signals."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.sim.scenario import SCENARIO_DIR, load
from helpers.daemon import Daemon
from helpers.tools import HANG

EXE = [sys.executable, "-m", "exporter"]


def cli(*args, check=True):
    proc = subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=HANG)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def series(text):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metrics(d):
    return series(d.get("/metrics").text)


@pytest.mark.integration
def test_scenarios_lists_the_builtin_ones():
    out = cli("scenarios").stdout
    for name in ("steady", "leak", "contention", "unified-memory", "stale-memory", "pressure", "gpu-lost"):
        assert any(line.split()[0] == name and len(line.split()) > 3 for line in out.splitlines()), name
    assert re.search(r"^unified-memory +3h +GB10", out, re.MULTILINE)  # its length, to pick a --speed by


@pytest.mark.integration
def test_snapshot_of_the_leak_scenario_matches_it():
    out = cli("snapshot", "--simulate", "leak", "--at", "3600").stdout
    got = series(out)
    state = load("leak").state_at(3600)
    for gpu in state.gpus:
        key = ("gpumem_gpu_memory_used_bytes", (("gpu", str(gpu.index)), ("uuid", gpu.uuid)))
        assert got[key] == gpu.used_bytes
    procs = {dict(labels)["pid"]: v for (name, labels), v in got.items() if name == "gpumem_process_memory_used_bytes"}
    expected = {str(p.pid): b for p in state.processes for b in p.gpu_bytes.values()}
    assert procs == expected and procs


@pytest.mark.integration
def test_snapshot_json():
    out = json.loads(cli("snapshot", "--simulate", "steady", "--at", "600", "--format", "json").stdout)
    assert out["snapshot"]["gpus"] and out["snapshot"]["gpus"][0]["processes"]


@pytest.mark.integration
def test_check_config(tmp_path):
    good = tmp_path / "good.yml"
    good.write_text("interval_seconds: 2\n")
    assert "OK" in cli("check-config", str(good)).stdout
    bad = tmp_path / "bad.yml"
    bad.write_text("interval_secs: 2\n")
    proc = cli("check-config", str(bad), check=False)
    assert proc.returncode != 0 and "interval_secs: unknown key (did you mean 'interval_seconds'?)" in proc.stderr


@pytest.mark.integration
def test_unknown_scenario_is_a_clear_error():
    proc = cli("snapshot", "--simulate", "no-such-scenario", check=False)
    assert proc.returncode != 0 and "no-such-scenario" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.integration
def test_a_port_in_use_is_a_clear_error_that_says_how_to_choose_another():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = cli("run", "--simulate", "steady", "--listen", f"127.0.0.1:{port}", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "--listen HOST:PORT" in proc.stderr


@pytest.mark.integration
def test_run_with_no_gpu_serves_source_down_and_keeps_retrying():
    d = Daemon("--interval", "0.2")
    try:
        d.wait_healthy()
        m = metrics(d)
        assert m[("gpumem_exporter_source_up", (("source", "nvml"),))] == 0
        assert m[("gpumem_exporter_source_up", (("source", "host"),))] == 1
        assert any(n == "gpumem_exporter_errors_total" and dict(labels)["source"] == "nvml" for n, labels in m)
    finally:
        code, out = d.stop()
    assert code == 0
    assert "NVML unavailable" in out and "retrying" in out
    assert out.count("NVML unavailable") == 1  # said once, not at every retry


@pytest.mark.integration
def test_snapshot_without_a_gpu_suggests_the_simulator():
    proc = cli("snapshot", check=False)
    if "NVML unavailable" not in proc.stderr:
        pytest.skip("this host has a working NVML")
    assert proc.returncode == 1 and "gpumem_exporter_source_up" in proc.stdout
    assert "snapshot --simulate steady" in proc.stderr
    assert "retrying" not in proc.stderr  # one sample: there is no retry to announce


@pytest.mark.integration
def test_snapshot_exits_non_zero_when_no_gpu_could_be_read(tmp_path):
    """A script running `snapshot` must not take a sample without a GPU for one (#19 item 5):
    what was read is printed, and the exit status says it failed."""
    scenario = (SCENARIO_DIR / "steady.yaml").read_text() + (
        "faults:\n  - {kind: init_failure, error: driver_not_loaded, at: 0, until: 60}\n")
    (tmp_path / "no-driver.yaml").write_text(scenario)
    proc = cli("snapshot", "--simulate", str(tmp_path / "no-driver.yaml"), check=False)
    assert proc.returncode == 1, proc.stderr
    assert 'gpumem_exporter_source_up{source="nvml"} 0.0' in proc.stdout
    assert cli("snapshot", "--simulate", "steady").returncode == 0


@pytest.mark.integration
def test_run_simulated_serves_processes_then_sigterm_stops_cleanly():
    d = Daemon("--simulate", "steady", "--interval", "0.2")
    try:
        d.wait_healthy()
        m = metrics(d)
        assert m[("gpumem_exporter_source_up", (("source", "nvml"),))] == 1
        assert any(n == "gpumem_process_memory_used_bytes" for n, _ in m)
        assert d.get("/admission").status_code in (200, 503)
    finally:
        code, out = d.stop()
    assert code == 0 and "stopping" in out
    # The log says plainly that nothing real is read, and which scenario runs.
    assert "SIMULATED host, scenario 'steady'" in out and "simulated NVML initialised" in out


@pytest.mark.integration
def test_sighup_reloads_and_a_bad_file_keeps_the_running_config(tmp_path):
    cfg = tmp_path / "c.yml"
    cfg.write_text("interval_seconds: 0.2\n")
    d = Daemon("--config", str(cfg), "--simulate", "steady")
    try:
        d.wait_healthy()
        cfg.write_text("interval_seconds: [broken\n")
        d.reload()  # until the daemon has said how it went
        cfg.write_text("interval_seconds: 0.3\n")
        d.reload()
        d.wait_healthy()
        # The reloaded sources run over the same simulated host: NVML still answers.
        m = metrics(d)
        assert m[("gpumem_exporter_source_up", (("source", "nvml"),))] == 1
        assert any(n == "gpumem_process_memory_used_bytes" for n, _ in m)
    finally:
        code, out = d.stop()
    assert code == 0
    assert "reload failed, keeping the running configuration" in out
    assert "configuration reloaded" in out


@pytest.mark.integration
@pytest.mark.slow
def test_sighup_reloads_admission_thresholds(tmp_path):
    cfg = tmp_path / "c.yml"
    cfg.write_text("interval_seconds: 0.2\n")
    d = Daemon("--config", str(cfg), "--simulate", "stale-memory", "--speed", "120")  # 20 GiB beyond budgets
    try:
        d.wait_healthy()
        assert d.get("/admission").status_code == 200
        cfg.write_text("interval_seconds: 0.2\nadmission: {close_above: 0.5, open_below: 0.4}\n")
        d.proc.send_signal(signal.SIGHUP)  # at the default 0.90 this scenario never closes
        deadline = time.monotonic() + HANG
        while d.get("/admission").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert d.get("/admission").status_code == 503
    finally:
        d.stop()


@pytest.mark.integration
def test_env_vars_configure_run():
    d = Daemon("--simulate", "steady", env={"GPUMEM_RUN_INTERVAL": "0.2"})
    try:
        d.wait_healthy()
    finally:
        _, out = d.stop()
    assert "every 0.2 s" in out


@pytest.mark.integration
def test_simulated_vllm_processes_are_tied_to_their_server():
    got = series(cli("snapshot", "--simulate", "contention", "--at", "3000").stdout)
    roles = {dict(lb)["process"]: dict(lb)["role"] for n, lb in got if n == "gpumem_process_memory_used_bytes"}
    assert roles and "vllm" in roles.values() and "other" in roles.values()
    assert all(role == "vllm" for name, role in roles.items() if name.startswith("VLLM::"))
    assert any(n == "gpumem_vllm_memory_budget_bytes" for n, _ in got)


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.mark.integration
def test_analyze_a_trace_with_a_report_and_log_events(tmp_path):
    trace = os.path.join(FIXTURES, "traces", "vllm_leak.csv")
    log = os.path.join(FIXTURES, "logs", "torch_fragmentation.log")
    report = tmp_path / "incident.html"
    out = json.loads(cli("analyze", trace, "--format", "json", "--report", str(report), "--log", log).stdout)
    leaks = [f for f in out["findings"] if f["kind"] == "leak"]
    assert leaks and leaks[0]["pid"] is not None and leaks[0]["first_detected_at"] > 0
    html = report.read_text()
    assert leaks[0]["process"] in html and "reserved" in html.lower()  # the OOM event's numbers


@pytest.mark.integration
def test_analyze_input_errors_exit_2(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,gpu,pid,process,used_bytes\nnot-a-number,0,1,p,5\n")
    proc = cli("analyze", str(bad), check=False)
    assert proc.returncode == 2 and "bad.csv:2" in proc.stderr
    assert cli("analyze", check=False).returncode == 2  # neither traces nor --prometheus
    proc = cli("explain", str(tmp_path / "missing.log"), check=False)
    assert proc.returncode == 2 and "no such file" in proc.stderr


@pytest.mark.integration
def test_flight_recorder_writes_a_trace_when_a_serving_process_exits(tmp_path):
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"recorder: {{directory: {tmp_path / 'traces'}, debounce_seconds: 0}}\n")
    # stale-memory: the vLLM server exits at 600 s of scenario time (5 s here: the daemon's first
    # tick, which must see it serving, has that long on a loaded machine).
    d = Daemon("--config", str(cfg), "--simulate", "stale-memory", "--speed", "120", "--interval", "5")
    try:
        d.wait_healthy()
        deadline = time.monotonic() + HANG
        while time.monotonic() < deadline and not list((tmp_path / "traces").glob("*vllm_exit*.csv")):
            time.sleep(0.2)
        files = list((tmp_path / "traces").glob("*vllm_exit*.csv"))
        assert files, "no trace written"
        # The write is counted once the file is in place: a scrape may fall between the two.
        while time.monotonic() < deadline and metrics(d)[("gpumem_recorder_writes_total", ())] < 1:
            time.sleep(0.2)
        assert metrics(d)[("gpumem_recorder_writes_total", ())] >= 1
    finally:
        d.stop()
    header = files[0].read_text().splitlines()[0]
    assert header.startswith("timestamp,gpu,pid,process,used_bytes")
    out = json.loads(cli("analyze", str(files[0]), "--format", "json").stdout)
    assert "findings" in out


def test_an_endpoint_problem_from_the_command_line_says_which_flag_and_where_names_go():
    # The trial of 5d3e341: "vllm.endpoints[1]: ... give each a distinct `name`", and no flag names one.
    proc = cli("snapshot", "--simulate", "steady", "--vllm-endpoint", "http://127.0.0.1:1/metrics?a=1",
               "--vllm-endpoint", "http://127.0.0.1:1/metrics?a=2", check=False)
    assert proc.returncode == 1
    assert "vllm.endpoints[1]: its `endpoint` label" in proc.stderr
    assert "vllm.endpoints[0] is the first --vllm-endpoint given" in proc.stderr
    assert "under vllm.endpoints in a --config file" in proc.stderr


def test_a_unified_memory_host_exports_the_largest_host_processes_a_browser_among_them():
    # The trial of 2c6ec9c: chrome held 45 GiB of a GB10's memory and was named only on the status
    # page; GpuUnifiedMemoryHostPressure named no process and /metrics had no chrome series.
    out = series(cli("snapshot", "--simulate", "unified-memory", "--at", "9500", "--format", "prometheus").stdout)
    rss = {dict(labels)["process"]: (dict(labels)["role"], value) for (name, labels), value in out.items()
           if name == "gpumem_process_host_rss_bytes"}
    role, held = rss["chrome"]
    assert role == "other" and held > 40 * 2**30
    assert rss["VLLM::EngineCore"][0] == "vllm"
    # A host whose GPUs have memory of their own lists only the processes that use them.
    steady = series(cli("snapshot", "--simulate", "steady", "--format", "prometheus").stdout)
    assert {dict(labels)["role"] for (name, labels), _ in steady.items()
            if name == "gpumem_process_host_rss_bytes"} == {"vllm"}
