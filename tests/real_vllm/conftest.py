"""Session fixtures of the real_vllm group: vLLM's environment, the tiny model, and each server
configuration started once per test session (tests/helpers/real_vllm.py).

Nothing here skips. Without a vLLM environment every test of the group fails with the reason
(`make vllm-env` not run, or pip's output when the install failed); `-m 'not real_vllm'`
deselects the group on purpose.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import real_vllm
from helpers.tools import free_port


@pytest.fixture(scope="session")
def vllm_python() -> str:
    try:
        return real_vllm.python()
    except real_vllm.Unavailable as exc:
        reason = str(exc)
    pytest.fail(reason, pytrace=False)


@pytest.fixture(scope="session")
def tiny_model(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """scripts/tiny_llama.py's model (built in seconds), and its digest."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    started = time.monotonic()
    digest = real_vllm.build_model(directory, vllm_python)
    real_vllm.TIMINGS["tiny model built"] = time.monotonic() - started
    return directory, digest


@pytest.fixture(scope="session")
def probe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPUMEM_PROBE_DIR of the main server: the allocator probe is installed in vLLM's
    environment and opted in, so every test runs beside it."""
    return tmp_path_factory.mktemp("probe")


@pytest.fixture(scope="session")
def leak_switch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """While this file exists, the main server's engine core keeps host memory for every request
    (tests/real_vllm/leak_plugin, the tests' leaking vLLM plugin); it does not exist otherwise."""
    return tmp_path_factory.mktemp("leak") / "leak-on"


@pytest.fixture(scope="session")
def main_server(vllm_python: str, tiny_model: tuple[Path, str], probe_dir: Path, leak_switch: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[real_vllm.Server]:
    """The one long-lived server of the session (real_vllm.MAIN), with the probe looking every
    half second, and the tests' leaking plugin armed but off (leak_switch). A failed start fails
    every test that uses it, with vLLM's log."""
    server = real_vllm.Server(real_vllm.MAIN, tiny_model[0], tmp_path_factory.mktemp("vllm") / "main.log",
                              port=free_port(), interpreter=vllm_python,
                              env={"GPUMEM_PROBE_DIR": str(probe_dir), "GPUMEM_PROBE_INTERVAL": "0.5",
                                   "GPUMEM_TEST_LEAK_FILE": str(leak_switch),
                                   "GPUMEM_TEST_LEAK_BYTES": str(real_vllm.LEAK_BYTES_PER_REQUEST)})
    server.start()
    try:
        server.wait_ready()
    except real_vllm.StartFailed as exc:
        failed = str(exc)
    else:
        failed = ""
    if failed:
        pytest.fail(failed, pytrace=False)
    assert server.ready_after is not None
    real_vllm.TIMINGS["server 'main' started"] = server.ready_after
    try:
        yield server
    finally:
        server.stop()


# Run last: the tests whose side effects outlast them. The contention test's second process takes
# 1.5 GiB of a shared host's memory; the page cache it evicts (torch's libraries) slows the main
# server for a while after (a real batch decoded at a quarter of its speed), which the timing of
# the next tests of the same server does not survive.
RUN_LAST = ("test_real_contention.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: any(name in item.nodeid for name in RUN_LAST))  # stable: the rest keep their order
