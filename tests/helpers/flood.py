"""A real daemon whose inputs are flooded one at a time, as the red team of #21 flooded them, and
its resident memory read from /proc. Shared by tests/test_memory_bound.py (the bound holds) and
bench/flood.py (RSS per input, side by side against another checkout).

The daemon runs `run --simulate leak` (a probed vLLM EngineCore, pid 3150) with a log file and a
vLLM endpoint of our own: a loopback HTTP server that answers a small vLLM page until told to
answer 7.6 MB of other text. Its TMPDIR is private, so the simulated probes' directory (where
their files are, and where anyone on the host may write) is the one `gpumem-sim-probe-*` in it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests

HANG = 180.0  # as tests/helpers/tools.HANG: how long a wait may take before it is a hang
PROBED_PID = 3150  # the leak scenario's EngineCore, which has the allocator probe
SMALL_PAGE = (b'vllm:num_requests_running{model_name="m",engine="0"} 3\n'
              b'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.25\n')


def other_exporters_page(size: int = 7_600_000) -> bytes:
    """Valid exposition text of about `size` bytes without a vllm: series (the red team's M6)."""
    lines, total, i = [], 0, 0
    while total < size:
        line = f'http_requests_total{{handler="/v1/x{i}",method="GET",status="200"}} {i}.0\n'.encode()
        lines.append(line)
        total += len(line)
        i += 1
    return b"".join(lines)


def oom_line(i: int) -> str:
    """A distinct, complete PyTorch OOM as vLLM's worker logs it."""
    return (f"(VllmWorker rank=0 pid=3150) ERROR 06-12 09:14:03 [multiproc_executor.py:527] "
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {i % 100_000 + 1}.00 MiB. GPU 0 has a "
            "total capacity of 79.15 GiB of which 1.06 GiB is free. Process 4242 has 60.00 GiB memory in use. "
            "Including non-PyTorch memory, this process has 18.00 GiB memory in use. Of the allocated memory "
            "16.50 GiB is allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but unallocated. See "
            "documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#"
            "environment-variables)\n")


class PageServer:
    """The vLLM endpoint: `body` is what /metrics answers, with HTTP `status`, both switchable while
    it runs; `reads` counts the requests answered."""

    def __init__(self, body: bytes = SMALL_PAGE) -> None:
        self.body, self.status, self.reads = body, 200, 0
        lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with lock:
                    owner.reads += 1
                    body, status = owner.body, owner.status
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, from /proc."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class FloodedDaemon:
    def __init__(self, workdir: Path, code: Path | None = None, interval: float = 0.5, speed: float = 10.0):
        """`code`: run that checkout's `exporter` (its directory first on the path)."""
        self.workdir = workdir
        self.page = PageServer()
        self.log = workdir / "vllm.log"
        self.log.write_text("")
        tmp = workdir / "tmp"
        tmp.mkdir()
        config = workdir / "config.yaml"
        config.write_text(f"logs:\n  files: [{self.log}]\nvllm:\n  endpoints:\n    - url: {self.page.url}\n"
                          "      name: flooded\n")
        env = {**os.environ, "TMPDIR": str(tmp)}
        if code is not None:
            env["PYTHONPATH"] = str(code)
        self.tmp = tmp
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exporter", "run", "--listen", "127.0.0.1:0", "--simulate", "leak",
             "--speed", str(speed), "--interval", str(interval), "--config", str(config)],
            cwd=code or None, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        self._port: str | None = None
        self._seen = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._seen.wait(HANG) or self._port is None:
            raise RuntimeError("the daemon did not start:\n" + "".join(self.output[-30:]))
        self.url = f"http://127.0.0.1:{self._port}"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if len(self.output) < 10_000:
                self.output.append(line)
            found = re.search(r"127\.0\.0\.1:(\d+)", line) if "serving on" in line else None
            if found and self._port is None:
                self._port = found.group(1)
                self._seen.set()
        self._seen.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def metric(self, name: str, selector: str = "") -> float | None:
        text = requests.get(self.url + "/metrics", timeout=HANG).text
        match = re.search(rf"^{re.escape(name + selector)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return float(match.group(1)) if match else None

    def wait_ticks(self, ticks: int, while_waiting: Callable[[], None] = lambda: None,
                   peak: list[int] | None = None) -> None:
        """Until `ticks` more samples are done, calling `while_waiting` and noting the peak RSS
        in `peak` between looks."""
        target = (self.metric("gpumem_exporter_samples_total") or 0) + ticks
        deadline = time.monotonic() + HANG * 5
        while (self.metric("gpumem_exporter_samples_total") or 0) < target:
            if self.proc.poll() is not None:
                raise RuntimeError("the daemon exited:\n" + "".join(self.output[-30:]))
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon stopped sampling")
            while_waiting()
            if peak is not None:
                peak.append(self.rss())
            time.sleep(0.1)

    def probe_dir(self) -> Path:
        deadline = time.monotonic() + HANG
        while True:
            found = list(self.tmp.glob("gpumem-sim-probe-*"))
            if found and any(found[0].glob(f"gpumem-*-{PROBED_PID}.json")):
                return found[0]
            if time.monotonic() > deadline:
                raise RuntimeError("no simulated probe file")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(HANG)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(HANG)
        self.page.close()


class Flood:
    """The red team's floods, each on and off."""

    def __init__(self, daemon: FloodedDaemon, probe_files: int = 8000, lines_per_second: int = 2000):
        self.daemon = daemon
        self.probe_files = probe_files
        self.lines_per_second = lines_per_second
        self._written = 0
        self._started = 0.0

    # H2: one-byte files named for the live probed process's pid, in other namespaces.
    def probe_dir_on(self) -> None:
        directory = self.daemon.probe_dir()
        for ns in range(1, self.probe_files + 1):
            (directory / f"gpumem-{ns}-{PROBED_PID}.json").write_bytes(b"x")

    def probe_dir_off(self) -> None:
        directory = self.daemon.probe_dir()
        for ns in range(1, self.probe_files + 1):
            (directory / f"gpumem-{ns}-{PROBED_PID}.json").unlink(missing_ok=True)

    # H3: distinct OOM lines, `lines_per_second`, written as time passes.
    def log_on(self) -> None:
        self._started = time.monotonic()

    def log_more(self) -> None:
        due = int((time.monotonic() - self._started) * self.lines_per_second)
        if due > self._written:
            with open(self.daemon.log, "a") as fh:
                fh.writelines(oom_line(i) for i in range(self._written, due))
            self._written = due

    # M6: 7.6 MB of valid text without a vLLM series.
    def page_on(self) -> None:
        self.daemon.page.body = other_exporters_page()

    def page_off(self) -> None:
        self.daemon.page.body = SMALL_PAGE


def flood_each_in_turn(daemon: FloodedDaemon, ticks: int = 40, settle: int = 10) -> dict[str, int]:
    """Peak RSS (bytes) at rest and under each flood in turn, `ticks` samples each."""
    flood = Flood(daemon)
    peaks: dict[str, int] = {}
    daemon.probe_dir()  # the probe has written its first file: the process is probed
    peak: list[int] = []
    daemon.wait_ticks(settle, peak=peak)
    peaks["at rest"] = max(peak)
    peak = []
    flood.probe_dir_on()
    daemon.wait_ticks(ticks, peak=peak)
    flood.probe_dir_off()
    peaks["probe files (H2)"] = max(peak)
    peak = []
    flood.log_on()
    daemon.wait_ticks(ticks, while_waiting=flood.log_more, peak=peak)
    peaks["log lines (H3)"] = max(peak)
    peak = []
    flood.page_on()
    daemon.wait_ticks(ticks, peak=peak)
    flood.page_off()
    peaks["vLLM page (M6)"] = max(peak)
    return peaks


def flood_all_at_once(daemon: FloodedDaemon, ticks: int = 40, peak: list[int] | None = None) -> int:
    """Peak RSS (bytes) with every input flooded together: every budget full at once. `peak`
    collects the readings (what was reached, should the daemon stop sampling)."""
    flood = Flood(daemon)
    daemon.probe_dir()
    flood.probe_dir_on()
    flood.page_on()
    flood.log_on()
    peak = [] if peak is None else peak
    try:
        daemon.wait_ticks(ticks, while_waiting=flood.log_more, peak=peak)
    finally:
        flood.probe_dir_off()
        flood.page_off()
    return max(peak)
