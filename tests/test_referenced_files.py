"""Files the configuration names for TLS (the listener's certificate, key and client CA; the
kubelet's CA) are read through the bounded reader: a FIFO or a huge file is an error at once,
never a wait (#21 L3: a FIFO as TLS certificate or kubelet CA hung `check-config` and blocked a
reload, which holds the daemon's main thread)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from exporter.config import ConfigError
from exporter.serve.webconfig import load_web_config
from exporter.sources.kubelet import KubeletPods
from exporter.tlsfiles import MAX_PEM_BYTES
from helpers.daemon import Daemon
from helpers.tools import HANG, REPO


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo.pem"
    os.mkfifo(path)
    yield path
    try:  # a reader still blocked opening it (the code under test, before) sees EOF and goes on
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # ENXIO: nobody has it open for reading
        pass


def bounded(call):
    """call() on a thread of its own: a hang fails the test after HANG instead of hanging it."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as exc:
            outcome["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG)
    assert not thread.is_alive(), "hung"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def check_config(path) -> subprocess.CompletedProcess:
    """`check-config` as a user runs it; a hang fails the test (TimeoutExpired) after HANG."""
    return subprocess.run([sys.executable, "-m", "exporter", "check-config", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=HANG)


@pytest.mark.parametrize("key", ["cert_file", "key_file", "client_ca_file"])
def test_a_fifo_in_the_web_config_is_refused_at_once(tmp_path, tls_cert, fifo, key):
    cert, key_file = tls_cert
    files = {"cert_file": cert, "key_file": key_file, "client_ca_file": cert, key: str(fifo)}
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n" + "".join(f"  {k}: {v}\n" for k, v in files.items())
                   + "  client_auth_type: RequireAndVerifyClientCert\n")
    with pytest.raises(ConfigError, match="not a regular file"):
        bounded(lambda: load_web_config(str(web)))
    config = tmp_path / "c.yml"
    config.write_text(f"web_config_file: {web}\n")
    result = check_config(config)
    assert result.returncode != 0 and "not a regular file" in result.stderr, result.stderr


@pytest.mark.integration
def test_a_fifo_as_the_kubelet_ca_is_refused_by_check_config_and_by_the_source(tmp_path, fifo):
    token = tmp_path / "token"
    token.write_text("t0ken")
    config = tmp_path / "c.yml"
    config.write_text(f"kubelet:\n  enabled: true\n  url: https://127.0.0.1:10250/pods\n"
                      f"  token_file: {token}\n  ca_file: {fifo}\n")
    result = check_config(config)
    assert result.returncode != 0 and "kubelet.ca_file" in result.stderr and "not a regular file" in result.stderr
    pods = KubeletPods("https://127.0.0.1:1/pods", token_file=str(token), ca_file=str(fifo))
    try:
        assert bounded(lambda: pods.lookup("0b4f6f37-cb4e-4d8c-8e86-2b1f3f0b0a51")) is None
        (error,) = pods.take_errors()
        assert error.kind == "tls" and "not a regular file" in error.message
    finally:
        pods.close()


def test_a_certificate_file_past_the_size_bound_is_refused(tmp_path, tls_cert):
    huge = tmp_path / "huge.pem"
    huge.write_bytes(Path(tls_cert[0]).read_bytes() + b"#" * MAX_PEM_BYTES)
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {huge}\n  key_file: {tls_cert[1]}\n")
    with pytest.raises(ConfigError, match="larger than"):
        load_web_config(str(web))


@pytest.mark.integration
def test_a_reload_naming_a_fifo_certificate_fails_and_the_daemon_carries_on(tmp_path, tls_cert, fifo):
    config = tmp_path / "c.yml"
    config.write_text("interval_seconds: 0.2\n")
    daemon = Daemon("--config", str(config), "--simulate", "steady")
    try:
        daemon.wait_healthy()
        web = tmp_path / "web.yml"
        web.write_text(f"tls_server_config:\n  cert_file: {fifo}\n  key_file: {tls_cert[1]}\n")
        config.write_text(f"interval_seconds: 0.2\nweb_config_file: {web}\n")
        outcome = daemon.reload()  # fails the test if no outcome is logged within HANG
        assert "reload failed" in outcome and "not a regular file" in outcome, outcome
        assert daemon.get("/healthz").status_code == 200
        code, out = daemon.stop()
        assert code == 0, out
    finally:
        daemon.kill()
