"""Who gets in and what leaks out: basic auth on every path, TLS with client certificates from a
CA made with the openssl command line, request head limits, slow clients, and secrets (bearer
tokens, command lines, environment) kept out of metrics, /api output and logs."""
from __future__ import annotations

import base64
import json
import logging
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import bcrypt
import pytest
import requests

from exporter.analysis.engine import Analyzer
from exporter.config import build as build_config
from exporter.daemon import Daemon
from exporter.exposition import build_registry
from exporter.runtime import build as build_runtime
from exporter.web import BasicAuth, HttpServer, load_web_config, make_app

from conftest import make_state

PASSWORD = "correct horse battery staple"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


@pytest.fixture
def serve(clock):
    servers = []

    def start(state=None, web=None, auth=None, get_state=None):
        get_state = get_state or (lambda: state)
        registry = build_registry(get_state, clock.now)
        server = HttpServer(make_app(registry, get_state, clock.now, 15.0, auth=auth), "127.0.0.1", 0, web).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


def raw_request(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send bytes as they are (requests would refuse to), return what comes back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and hung up before reading it all: that is the point
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


# ---------------------------------------------------------------------------------------------
# Basic auth (tests/test_web.py covers /metrics with right, wrong and unknown credentials)


@pytest.mark.parametrize("path", ["/", "/healthz", "/admission", "/api/findings", "/nope", "/metrics?x=1"])
def test_every_path_needs_auth(serve, path):
    url = f"http://127.0.0.1:{serve(make_state(), auth=BasicAuth({'prom': HASH})).port}{path}"
    for creds in (None, ("prom", "wrong"), ("prom", ""), ("", PASSWORD), ("prom", PASSWORD + "x")):
        r = requests.get(url, auth=creds, timeout=5)
        assert r.status_code == 401 and "gpumem" not in r.text and "leak" not in r.text
        assert r.headers["WWW-Authenticate"].startswith("Basic ")
    assert requests.get(url, auth=("prom", PASSWORD), timeout=5).status_code in (200, 404)


def test_a_cached_good_password_does_not_open_the_door_to_another(serve):
    auth = BasicAuth({"prom": HASH, "ops": bcrypt.hashpw(b"other", bcrypt.gensalt(4)).decode()})
    port = serve(make_state(), auth=auth).port
    url = f"http://127.0.0.1:{port}/metrics"
    assert requests.get(url, auth=("prom", PASSWORD), timeout=5).status_code == 200  # now cached
    assert requests.get(url, auth=("ops", PASSWORD), timeout=5).status_code == 401
    assert requests.get(url, auth=("prom", "other"), timeout=5).status_code == 401
    # a password with a colon in it is the part after the first colon
    header = "Basic " + base64.b64encode(f"prom:{PASSWORD}:extra".encode()).decode()
    assert requests.get(url, headers={"Authorization": header}, timeout=5).status_code == 401


# ---------------------------------------------------------------------------------------------
# TLS with client certificates


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate signed by it, and a
    client certificate signed by nobody we trust."""
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", *EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test CA", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, cn, ext in (("server", "127.0.0.1", ["-extfile", "san.ext"]), ("client", "prometheus", [])):
        openssl("req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", *ext, cwd=d)
    openssl("req", "-x509", *EC, "-keyout", "rogue.key", "-out", "rogue.pem", "-days", "2",
            "-subj", "/CN=prometheus", cwd=d)
    return d


def test_require_and_verify_client_cert(serve, pki, tmp_path, capfd):
    web_yml = tmp_path / "web.yml"
    web_yml.write_text(f"tls_server_config:\n  cert_file: {pki / 'server.pem'}\n  key_file: {pki / 'server.key'}\n"
                       f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki / 'ca.pem'}\n"
                       f"basic_auth_users:\n  prom: '{HASH}'\n")
    web = load_web_config(str(web_yml))
    server = serve(make_state(), web=web, auth=BasicAuth(web.basic_auth_users))
    url = f"https://127.0.0.1:{server.port}/metrics"
    ca = str(pki / "ca.pem")
    good = (str(pki / "client.pem"), str(pki / "client.key"))
    rogue = (str(pki / "rogue.pem"), str(pki / "rogue.key"))
    for cert in (None, rogue):  # no certificate, or one our CA did not sign
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(url, cert=cert, verify=ca, auth=("prom", PASSWORD), timeout=5)
    with pytest.raises(requests.exceptions.ConnectionError):  # plain HTTP on the TLS port
        requests.get(url.replace("https", "http"), timeout=5)
    # A good certificate still needs the password: the two checks add up.
    assert requests.get(url, cert=good, verify=ca, timeout=5).status_code == 401
    r = requests.get(url, cert=good, verify=ca, auth=("prom", PASSWORD), timeout=5)
    assert r.status_code == 200 and "gpumem_gpu_info" in r.text
    assert "Traceback" not in capfd.readouterr().err  # refused handshakes are routine, not crashes


def test_tls_client_that_never_says_hello_does_not_block_others(serve, pki, tmp_path):
    web_yml = tmp_path / "web.yml"
    web_yml.write_text(f"tls_server_config:\n  cert_file: {pki / 'server.pem'}\n  key_file: {pki / 'server.key'}\n")
    server = serve(make_state(), web=load_web_config(str(web_yml)))
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(10)]
    try:
        started = time.monotonic()
        r = requests.get(f"https://127.0.0.1:{server.port}/metrics", verify=str(pki / "ca.pem"), timeout=5)
        assert r.status_code == 200 and time.monotonic() - started < 2
    finally:
        for s in silent:
            s.close()


# ---------------------------------------------------------------------------------------------
# Request limits and slow clients


def test_enormous_header_line_is_refused_and_the_server_lives_on(serve):
    port = serve(make_state()).port
    reply = raw_request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
    assert status_of(reply) == 431 and b"gpumem" not in reply
    reply = raw_request(port, b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n")
    assert status_of(reply) == 414
    assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200


def test_more_than_100_headers_are_refused(serve):
    port = serve(make_state()).port
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(101))
    reply = raw_request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert status_of(reply) == 431 and b"gpumem" not in reply
    assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200


def test_request_head_size_is_bounded_as_a_whole(serve):
    """Within the per-line and per-count limits, a head of 90 x 60 KB (5.4 MB) must still be refused."""
    port = serve(make_state()).port
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 60_000) for i in range(90))
    reply = raw_request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert status_of(reply) == 431 and b"gpumem" not in reply
    assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200


def test_a_large_body_is_not_read(serve):
    port = serve(make_state()).port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n" + b"x" * 1000)
        assert status_of(s.recv(4096)) == 405  # answered without waiting for 10 GB


def test_slowloris_clients_do_not_block_scrapes(serve):
    port = serve(make_state()).port
    stalled = []
    try:
        for _ in range(30):  # each sends half a request and then nothing
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            stalled.append(s)
        for _ in range(5):
            started = time.monotonic()
            assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200
            assert time.monotonic() - started < 2  # not the 10 s a stalled handler may wait
    finally:
        for s in stalled:
            s.close()


# ---------------------------------------------------------------------------------------------
# Secrets never leave: bearer tokens, command lines, environment

TOKEN = "tok-3f9a1c77e2b84d05a6-bearer"
CMD_TOKEN = "hf_cmdlineSECRETtoken1234567890"
ENV_TOKEN = "env-SECRET-4b1d9e0f7a"


class EchoAuth(BaseHTTPRequestHandler):
    """A vLLM stand-in that repeats whatever credentials it was sent, in every way it can."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        got = self.headers.get("Authorization", "")
        if self.path.endswith("/garbage"):  # unparseable, with the credentials in the bad line
            body = f"vllm:num_requests_running{{model_name=\"{got}}} 1\n".encode()
        else:  # a valid page with the credentials in its labels, and in a broken unrelated line
            body = (f"# {got}\nvllm:num_requests_running{{model_name=\"{got}\"}} 1\n"
                    f"vllm:cache_config_info{{cache_dtype=\"{got}\",engine=\"0\"}} 1\n{got} garbage\n").encode()
        self.send_response(500 if self.path.endswith("/fail") else 200)
        self.send_header("X-Echo", got)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def echo():
    server = ThreadingHTTPServer(("127.0.0.1", 0), EchoAuth)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield server.server_port
    server.shutdown()
    server.server_close()


SCENARIO = f"""
name: secrets
duration: 1h
gpus: [{{name: NVIDIA H100 80GB HBM3, memory: 80GiB}}]
host: {{memory: 512GiB}}
processes:
  - {{pid: 100, name: vllm, gpu: 0, memory: 30GiB, rss: 2GiB,
     cmdline: "python -m vllm.entrypoints.openai.api_server --api-key {CMD_TOKEN}"}}
  - {{pid: 200, name: python3, gpu: 0, rss: 1GiB,
     memory: [{{constant: 2GiB}}, {{linear: {{from: 0, rate: 64MiB/min}}}}],
     cmdline: "python3 train.py --hf-token={CMD_TOKEN}"}}
"""


@pytest.mark.parametrize("read_cmdline", [False, True])
def test_no_secret_in_metrics_api_or_logs(tmp_path, echo, caplog, monkeypatch, read_cmdline):
    monkeypatch.setenv("HF_TOKEN", ENV_TOKEN)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    scenario = tmp_path / "secrets.yaml"
    scenario.write_text(SCENARIO)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(json.dumps({"host": {"read_cmdline": read_cmdline}, "vllm": {"endpoints": [
        {"url": f"http://127.0.0.1:{echo}/metrics", "name": "ok", "bearer_token_file": str(token_file)},
        {"url": f"http://127.0.0.1:{echo}/fail", "name": "fail", "bearer_token_file": str(token_file)},
        {"url": f"http://127.0.0.1:{echo}/garbage", "name": "garbage", "bearer_token_file": str(token_file)},
        {"url": f"http://user:{TOKEN}@127.0.0.1:{echo}/metrics", "name": "", "timeout_seconds": 1}]}}))
    from exporter.config import load
    config = load(str(config_file))
    rt = build_runtime(config, simulate=str(scenario), at=0.0)
    caplog.set_level(logging.DEBUG)
    try:
        daemon = Daemon(rt.sampler, rt.clock, 5.0, analyzer=Analyzer())
        for _ in range(260):  # long enough for the leak detector to speak about pid 200
            rt.clock.advance(5)
            state = daemon.tick()
        registry = build_registry(lambda: daemon.state, rt.clock.now)
        server = HttpServer(make_app(registry, lambda: daemon.state, rt.clock.now, 15.0), "127.0.0.1", 0).start()
        try:
            base = f"http://127.0.0.1:{server.port}"
            outputs = {path: requests.get(base + path, timeout=5).text
                       for path in ("/metrics", "/api/findings", "/healthz", "/admission", "/")}
        finally:
            server.stop()
    finally:
        rt.close()
    outputs["logs"] = caplog.text
    outputs["state"] = repr([(v.endpoint, v.error) for v in state.snapshot.vllm])
    # The pages that parse are used; the token they echo into labels is not.
    assert [(v.up, v.error_kind) for v in state.snapshot.vllm] == [(True, ""), (False, "http_status"),
                                                                   (False, "parse"), (True, "")]
    assert state.snapshot.vllm[0].engines[0].model == "Bearer <redacted>"
    assert 'model="Bearer <redacted>"' in outputs["/metrics"]
    assert any(f.kind == "leak" for f in state.analysis.findings), "a finding must be in the output"
    for where, text in outputs.items():
        for secret in (TOKEN, ENV_TOKEN, CMD_TOKEN):
            assert secret not in text, f"{secret} leaked into {where}"
    # Opting in makes the command line available to the sampler (and nothing more).
    cmdlines = {p.pid: p.cmdline for g in state.snapshot.gpus for p in g.processes}
    if read_cmdline:
        assert CMD_TOKEN in cmdlines[100]
    else:
        assert set(cmdlines.values()) == {""}
