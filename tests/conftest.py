import subprocess

import pytest

from exporter.clock import FixedClock
from helpers.state import make_state  # noqa: F401 (re-exported for older imports)


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
