"""`gpu-memory-exporter run` as a child process on a free loopback port, its log read line by
line, so a test waits on what the daemon says (healthy, reloaded) rather than for a fixed time;
and `analyze` through the same real entry point."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import requests

from .tools import HANG


def analyze(*args: object, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`gpu-memory-exporter analyze ARGS`; `check`: it must succeed."""
    proc = subprocess.run([sys.executable, "-m", "exporter", "analyze", *map(str, args)],
                          capture_output=True, text=True, timeout=HANG)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


class Daemon:
    def __init__(self, *args: str, env: Mapping[str, str] | None = None, command: tuple[str, ...] = ("-m", "exporter")):
        """`command`: what runs `run` (helpers.scaled_exporter for a daemon with faster detectors)."""
        self.proc = subprocess.Popen([sys.executable, *command, "run", "--listen", "127.0.0.1:0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        line = self.wait_for(lambda lines: next((x for x in lines if "serving on" in x), None))
        self.url = "http://127.0.0.1:" + line.split("127.0.0.1:")[1].split("/")[0].split()[0]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:  # end of the log: the process is exiting
            self._changed.notify_all()

    def output(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for(self, found: Callable[[list[str]], Any], timeout: float = HANG) -> Any:
        """Wait until `found(lines)` is truthy; fail if the daemon exits first or after `timeout`."""
        with self._changed:
            result = self._changed.wait_for(lambda: found(self.lines) or self.proc.poll() is not None, timeout)
            assert self.proc.poll() is None, "".join(self.lines)
            assert result, "".join(self.lines[-20:])
            return result

    def wait_healthy(self, timeout: float = HANG) -> None:
        """Until /healthz answers 200: the sampler runs and the SIGHUP handler is installed."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.output()
            try:
                if requests.get(self.url + "/healthz", timeout=timeout).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "daemon never became healthy"
            time.sleep(0.05)

    def get(self, path: str) -> requests.Response:
        return requests.get(self.url + path, timeout=HANG)

    def reload(self) -> str:
        """SIGHUP, then the log line that says how the reload went."""
        def outcomes(lines: list[str]) -> list[str]:
            return [x for x in lines if "configuration reloaded" in x or "reload failed" in x]
        before = len(outcomes(self.lines))
        self.proc.send_signal(signal.SIGHUP)
        return str(self.wait_for(lambda lines: len(outcomes(lines)) > before and outcomes(lines)[before]))

    def kill(self) -> None:
        """For a test's `finally`: the daemon gone, whatever the test did to it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=HANG)
        self._reader.join(HANG)
        return code, self.output()
