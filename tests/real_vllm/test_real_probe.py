"""The allocator probe under vLLM's real plugin loader (#18 item 2d).

`make vllm-env` installs gpu-memory-probe (probe/, editable) into vLLM's environment, so vLLM's
`load_general_plugins` finds its `vllm.general_plugins` entry point in every process it starts;
the main server runs with GPUMEM_PROBE_DIR set and a half-second interval. On a CPU no process
initialises CUDA, so the probe must look, and do nothing else: write nothing, raise nothing,
cost nothing. Its effect on real throughput is measured by bench/probe_vllm_throughput.py.
"""
from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

from helpers import real_vllm

pytestmark = [pytest.mark.real_vllm, pytest.mark.integration, pytest.mark.slow]

THREAD = "gpumem-probe"  # the name the probe gives its thread in the kernel
TICKS = os.sysconf("SC_CLK_TCK")
IDLE_SHARE = 0.01  # of one core, at most, while vLLM serves


def probe_threads(pid: int) -> list[int]:
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() == THREAD:
                found.append(int(tid))
        except OSError:
            pass
    return found


def cpu_seconds(pid: int, tid: int) -> float:
    """utime + stime of one thread (/proc/<pid>/task/<tid>/stat fields 14 and 15)."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def roles(server: real_vllm.Server) -> dict[str, int]:
    """vLLM's processes by role: the API server, the engine core and its worker."""
    out = {}
    for proc in server.processes():
        name = proc.name()
        role = "api_server" if proc.pid == server.pid else re.sub(r"^VLLM::", "", name)
        out[role] = proc.pid
    return out


def test_register_runs_in_every_vllm_process_and_its_thread_stays_idle(main_server, probe_dir):
    processes = roles(main_server)
    assert set(processes) == {"api_server", "EngineCore", "Worker"}, processes
    threads = {role: probe_threads(pid) for role, pid in processes.items()}
    assert all(len(t) == 1 for t in threads.values()), f"one probe thread per vLLM process: {threads}"

    # Serve while watching: the probe's own CPU time, thread by thread, against the wall clock.
    before = {role: cpu_seconds(processes[role], t[0]) for role, t in threads.items()}
    started = time.monotonic()
    done = threading.Event()

    def serve() -> None:
        for i in range(8):
            status, answer = real_vllm.post_json(main_server.url + "/v1/completions", {
                "model": main_server.served_model_name, "prompt": f"probe {i}", "max_tokens": 128,
                "ignore_eos": True})
            assert status == 200, answer
        done.set()

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    worker.join(real_vllm.START_TIMEOUT)
    assert done.is_set()
    time.sleep(2.0)  # a few more of its half-second looks, idle
    elapsed = time.monotonic() - started
    used = {role: cpu_seconds(processes[role], t[0]) - before[role] for role, t in threads.items()}
    assert all(u <= IDLE_SHARE * elapsed for u in used.values()), (
        f"the probe's threads used {used} s of CPU in {elapsed:.1f} s")

    assert list(probe_dir.iterdir()) == [], "the probe wrote in a process without CUDA"
    log = main_server.log()
    assert "gpumem_probe" not in log and "Failed to load plugin" not in log, "the probe or its loading raised"
