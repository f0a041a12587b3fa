"""Real contention on the host memory pool (#18 item 2g): beside the real server on vLLM's CPU
backend (its model and KV cache in host memory), a second process grows to 1.5 GiB and holds it.
The contention finding must name that process as the culprit for as long as it holds the memory.

The host is "short" below `detectors.contention.host_available_low_ratio` of its memory (15 % by
default). A test cannot take 85 % of a shared machine's memory, so the daemon is configured with
the level the grower's 1.5 GiB crosses: 768 MiB under what is available when the test starts.
"""
from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from helpers.real_monitoring import watching

pytestmark = [pytest.mark.real_vllm, pytest.mark.integration, pytest.mark.slow]

SCALE = 0.1  # contention's 300-s baseline is 30 s (helpers.scaled_exporter)
GROW = """
import sys, time
held = []
for _ in range(24):                 # 64 MiB every half second: 1.5 GiB in 12 s
    held.append(bytearray(b"\\x01" * (64 << 20)))
    time.sleep(0.5)
print("held", flush=True)
sys.stdin.read()                    # holds it until the test closes stdin
"""


def test_a_process_growing_beside_the_real_server_is_named_while_it_holds_the_memory(main_server, tmp_path):
    memory = psutil.virtual_memory()
    short_below = (memory.available - (768 << 20)) / memory.total
    extra = f"detectors:\n  contention:\n    host_available_low_ratio: {short_below:.4f}\n"
    with watching(main_server, tmp_path, scale=SCALE, extra=extra) as watch:
        time.sleep(40)  # contention compares with a baseline one (scaled) window old
        grower = subprocess.Popen([sys.executable, "-c", GROW], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert grower.stdout is not None and grower.stdout.readline().strip() == "held"
            named_since = None
            end = time.monotonic() + 90
            while time.monotonic() < end:
                found = [f for f in watch.findings() if f["kind"] == "contention"
                         and grower.pid in {v for k, v in f["evidence"].items() if k.endswith("_pid")}]
                if found and named_since is None:
                    named_since = time.monotonic()
                if named_since is not None:
                    assert found, "the culprit stopped being named while it still held the memory"
                    if time.monotonic() - named_since > 30:
                        break
                time.sleep(1)
            assert named_since is not None, f"no contention finding names pid {grower.pid}: {watch.findings()}"
        finally:
            grower.stdin.close()
            grower.wait(timeout=60)
