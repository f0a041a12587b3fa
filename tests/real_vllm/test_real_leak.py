"""A real leak (#18 item 2f): the tests' vLLM plugin (tests/real_vllm/leak_plugin) makes the real
server's engine core keep host memory for every request. The leak detector finds it from the real
/proc, names the process that grows (the engine core, not the API server) and its part of the
server, and GpuMemoryLeakSuspected fires in real Prometheus; the same run with the leak off first
raises nothing.

The daemon is a real `run` whose leak detector has every duration scaled by SCALE
(helpers.scaled_exporter): shipped, it settles 10 minutes on a new series and looks at 8 minutes
at least, which a test cannot wait for. The seconds from the leak's start to the finding are in
real_vllm.TIMINGS.
"""
from __future__ import annotations

import time

import pytest

from helpers import real_vllm
from helpers.real_monitoring import poll, watching
from helpers.scaled_exporter import scaled_leak
from helpers.tools import HANG

pytestmark = [pytest.mark.real_vllm, pytest.mark.integration, pytest.mark.slow]

SCALE = 0.1
LEAK = scaled_leak(SCALE)
# Long enough for the detector to judge the control run: its settling period, then its first
# window, then two of the history's (scaled) buckets.
CONTROL_SECONDS = LEAK.settle_seconds + LEAK.windows_minutes[0] * 60 + 2 * 60 * SCALE
CLIENTS = 2


def processes(server: real_vllm.Server) -> dict[str, tuple[int, str]]:
    """(pid, name as psutil reads it) of each of the server's processes, by its part (vLLM's
    process titles)."""
    out = {"api_server": (server.pid, "")}
    for p in server.processes():
        name = p.name()
        if name.startswith("VLLM::EngineCor"):
            out["engine_core"] = (p.pid, name)
        elif name.startswith("VLLM::Worker"):
            out["worker"] = (p.pid, name)
    return out


def leaks(watch) -> list[dict]:
    return [f for f in watch.findings() if f["kind"] == "leak"]


def served_in_prometheus(watch, wanted: set[int]) -> None:
    """Every one of the server's processes has its host memory in Prometheus, in every scrape that
    succeeded. Polled, and counted over the scrapes that succeeded: on this loaded machine some
    scrapes (2 of 38 in one run) outlast Prometheus' 1-s timeout, which marks every series stale
    until the next."""
    query = 'gpumem_process_host_rss_bytes{role="vllm"}'
    try:
        poll(lambda: {int(r["metric"]["pid"]) for r in watch.prometheus.result(query)} >= wanted, HANG,
             f"{query} for each of {sorted(wanted)}")
    except AssertionError as exc:
        exported = [x for x in watch.daemon.get("/metrics").text.splitlines() if x.startswith(query.split("{")[0])]
        scrapes = watch.prometheus.result("up[1m]")
        warnings = [x for x in watch.daemon.lines if "WARNING" in x or "ERROR" in x]
        raise AssertionError(f"{exc}\nthe exporter: {exported}\nits scrapes: {scrapes}\n"
                             f"its log: {warnings[-20:]}") from None
    # Never a gap: each process's series is in as many scrapes as succeeded (one query, so that both
    # counts end at the same instant).
    missed = watch.prometheus.result(
        f'count_over_time({query}[1h]) - scalar(sum_over_time(up{{instance="{watch.target}"}}[1h]))')
    assert {int(r["metric"]["pid"]): float(r["value"][1]) for r in missed if int(r["metric"]["pid"]) in wanted} \
        == dict.fromkeys(wanted, 0.0)


def test_a_real_leak_is_found_in_the_engine_core_and_alerted_and_nothing_without_it(
        main_server, leak_switch, tmp_path):
    assert not leak_switch.exists()
    pids = processes(main_server)
    assert set(pids) == {"api_server", "engine_core", "worker"}
    with real_vllm.Load(main_server, real_vllm.SHORT, seed=5) as load:
        load.add(CLIENTS)
        time.sleep(20)  # the server warms up under this load before anyone watches
        with watching(main_server, tmp_path, scale=SCALE) as watch:
            # The same run without the leak: the detector has judged every series, nothing is raised.
            end = time.monotonic() + CONTROL_SECONDS
            while time.monotonic() < end:
                assert leaks(watch) == [], "a leak raised with the plugin off"
                time.sleep(1)
            served_in_prometheus(watch, {pid for pid, _ in pids.values()})
            started = time.time()
            before = load.completed
            leak_switch.touch()
            try:
                (finding,) = poll(lambda: leaks(watch), HANG * 3, "the leak finding", every=1)
                alerts = poll(lambda: watch.firing("GpuMemoryLeakSuspected"), HANG, "GpuMemoryLeakSuspected")
            finally:
                leak_switch.unlink()
            requests = load.completed - before
    assert not load.failures, load.failures
    ev = finding["evidence"]
    assert (finding["pid"], finding["process"], finding["role"], finding["gpu"]) == (*pids["engine_core"], "vllm", None)
    assert ev["server_role"] == "engine_core" and ev["cpu_backend"] == 1
    assert "the server's engine core" in finding["summary"]
    assert ev["slope_bytes_per_second"] > 0
    assert [(a["labels"]["pid"], a["labels"].get("gpu")) for a in alerts] == [(str(pids["engine_core"][0]), None)]
    assert "host memory" in alerts[0]["annotations"]["summary"]
    delay = finding["first_detected_at"] - started
    real_vllm.TIMINGS[f"leak found (detector x{SCALE}, {requests} requests of "
                      f"{real_vllm.LEAK_BYTES_PER_REQUEST >> 10} KiB)"] = delay
