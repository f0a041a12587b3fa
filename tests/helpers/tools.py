"""The repository root, external tools (promtool, amtool, alertmanager, prometheus) looked up on
PATH, free loopback ports, and the test run's shared settings."""
from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# How long a test waits on a real process, server or thread before calling it hung. It bounds a
# hang only: what is waited for happens far sooner on any machine, loaded or not (a CI machine
# running the suite beside other work has taken over 60 s to start a simulated run).
HANG = 180.0
# The environment variable naming the directory where pytest-xdist's workers share the built-in
# scenarios' replays (helpers.scenarios.played; conftest.py makes it).
REPLAYS_DIR = "GPUMEM_TEST_REPLAYS"


def tool(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(f"{' or '.join(names)} not found on PATH; install it "
                "(Debian/Ubuntu: apt-get install prometheus prometheus-alertmanager)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
