"""Checks that need a real NVIDIA GPU (never run in CI; see gpu_checks/README.md).

    python gpu_checks/real_gpu.py nvml            # real NVML through the exporter's source
    python gpu_checks/real_gpu.py start           # leave a leaking PyTorch process and the daemon running
    python gpu_checks/real_gpu.py check [--expect-leak]   # what the daemon reports about them

`start` detaches both processes (setsid) so they outlive the command; the leak detector needs
its settling period (10 min after the start-up allocation) plus its shortest window (8 min), so
run `check --expect-leak` about 20 minutes after `start`. Results go to $OUT (or /tmp) as JSON.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = Path(os.environ.get("OUT", "/tmp"))
PORT = 9842
STATE = Path("/tmp/gpumem-gpu-check.json")

# Allocates 2 GiB at start (the "model"), then leaks 16 MiB every 2 s (480 MiB/min) for 30 min.
LEAKER = """
import time, torch
hold = [torch.empty(2 << 30, dtype=torch.uint8, device="cuda")]
print("ready", flush=True)
for _ in range(900):
    hold.append(torch.empty(16 << 20, dtype=torch.uint8, device="cuda"))
    time.sleep(2)
"""


def nvml() -> dict:
    import pynvml

    from exporter.model import Snapshot
    from exporter.sources.host import LocalHost, enrich
    from exporter.sources.nvml import NvmlSource

    host = LocalHost()
    reading = NvmlSource(pynvml, host.memory).collect(Snapshot(timestamp=time.time()))
    assert reading.up, reading.errors
    gpus = enrich(reading.snapshot.gpus, host)
    for g in gpus:
        assert g.up and g.total_bytes and g.used_bytes is not None, g
        parts = g.used_bytes + g.free_bytes + (g.reserved_bytes or 0)
        assert abs(parts - g.total_bytes) <= 0.01 * g.total_bytes, (g.index, parts, g.total_bytes)
    return {"driver": reading.snapshot.driver_version, "errors": [e.kind for e in reading.errors],
            "gpus": [{"index": g.index, "name": g.name, "total": g.total_bytes, "used": g.used_bytes,
                      "free": g.free_bytes, "reserved": g.reserved_bytes, "unified": g.unified,
                      "processes": [(p.pid, p.name, p.used_bytes) for p in g.processes]} for g in gpus]}


def start() -> dict:
    leaker = subprocess.Popen([sys.executable, "-c", LEAKER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert leaker.stdout.readline().strip() == "ready", "the PyTorch leaker did not start"
    # The daemon outlives this command (it is checked by a later `check`), so its log stays open.
    with open("/tmp/gpumem-daemon.log", "w") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "exporter", "run", "--listen", f"127.0.0.1:{PORT}"],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    state = {"leaker_pid": leaker.pid, "daemon_pid": daemon.pid, "started": time.time()}
    STATE.write_text(json.dumps(state))
    return state


def check(expect_leak: bool) -> dict:
    state = json.loads(STATE.read_text())
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/api/findings", timeout=10) as r:
        findings = json.loads(r.read())["findings"]
    pid = str(state["leaker_pid"])
    mine = [line for line in metrics.splitlines() if f'pid="{pid}"' in line]
    assert any(line.startswith("gpumem_process_memory_used_bytes") for line in mine), "leaker not exported"
    leaks = [f for f in findings if f["kind"] == "leak" and str(f["pid"]) == pid]
    if expect_leak:
        assert leaks, f"no leak finding for pid {pid} after {time.time() - state['started']:.0f} s"
    return {"elapsed_seconds": time.time() - state["started"], "leaker_series": mine,
            "leak_findings": leaks, "all_findings": findings}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", choices=["nvml", "start", "check"], default="nvml")
    ap.add_argument("--expect-leak", action="store_true", help="check: fail without a leak finding")
    args = ap.parse_args()
    if args.what == "check" and not STATE.exists():
        ap.error(f"no {STATE}: run `start` first")
    what = args.what
    result = {"nvml": nvml, "start": start, "check": lambda: check(args.expect_leak)}[what]()
    (OUT / f"gpu-check-{what}.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str)[:4000])


if __name__ == "__main__":
    main()
