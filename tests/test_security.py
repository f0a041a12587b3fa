"""Who gets in and what leaks out: basic auth on every path, TLS with client certificates from a
CA made with the openssl command line, request head limits, slow clients, and secrets (bearer
tokens, command lines, environment) kept out of metrics, /api output and logs."""
from __future__ import annotations

import base64
import contextlib
import json
import logging
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import bcrypt
import pytest
import requests

from exporter.analysis.engine import Analyzer
from exporter.config import build as build_config
from exporter.daemon import Daemon
from exporter.runtime import build as build_runtime
from exporter.serve.auth import BasicAuth
from exporter.serve.exposition import build_registry
from exporter.serve.server import HttpServer
from exporter.serve.web import make_app
from exporter.serve.webconfig import load_web_config
from helpers.state import make_state

PASSWORD = "correct horse battery staple"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


@pytest.fixture
def serve(clock):
    servers = []

    def start(state=None, web=None, auth=None, get_state=None, **limits):
        get_state = get_state or (lambda: state)
        registry = build_registry(get_state, clock.now)
        server = HttpServer(make_app(registry, get_state, clock.now, 15.0, auth=auth), "127.0.0.1", 0, web,
                            **limits).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


# Stalled clients are held this long (the server's head deadline, injected); a scrape must come
# back well within HANG_BOUND, a bound on a hang, not a claim about speed.
STALL = 600.0
HANG_BOUND = 60.0


def raw_request(port: int, data: bytes, timeout: float = HANG_BOUND) -> bytes:
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
        r = requests.get(url, auth=creds, timeout=HANG_BOUND)
        assert r.status_code == 401 and "gpumem" not in r.text and "leak" not in r.text
        assert r.headers["WWW-Authenticate"].startswith("Basic ")
    assert requests.get(url, auth=("prom", PASSWORD), timeout=HANG_BOUND).status_code in (200, 404)


def test_a_cached_good_password_does_not_open_the_door_to_another(serve):
    auth = BasicAuth({"prom": HASH, "ops": bcrypt.hashpw(b"other", bcrypt.gensalt(4)).decode()})
    port = serve(make_state(), auth=auth).port
    url = f"http://127.0.0.1:{port}/metrics"
    assert requests.get(url, auth=("prom", PASSWORD), timeout=HANG_BOUND).status_code == 200  # now cached
    assert requests.get(url, auth=("ops", PASSWORD), timeout=HANG_BOUND).status_code == 401
    assert requests.get(url, auth=("prom", "other"), timeout=HANG_BOUND).status_code == 401
    # a password with a colon in it is the part after the first colon
    header = "Basic " + base64.b64encode(f"prom:{PASSWORD}:extra".encode()).decode()
    assert requests.get(url, headers={"Authorization": header}, timeout=HANG_BOUND).status_code == 401


def cost_of(hashed) -> int:
    return int((hashed if isinstance(hashed, bytes) else hashed.encode()).split(b"$")[2])


@pytest.fixture
def bcrypt_calls(monkeypatch):
    """Every bcrypt check, as (password, hash), made by the real bcrypt."""
    calls = []
    real = bcrypt.checkpw

    def counting(password, hashed):
        calls.append((password, hashed))
        return real(password, hashed)
    monkeypatch.setattr(bcrypt, "checkpw", counting)
    return calls


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_unknown_users_cost_a_bcrypt_check_at_the_highest_configured_cost(bcrypt_calls):
    """issue 14: the placeholder hash had cost 4 while users had 10: 2 ms against 70 ms told which
    users exist. Timing is not measured here: the work done is."""
    auth = BasicAuth({"prom": HASH, "ops": bcrypt.hashpw(b"other", bcrypt.gensalt(6)).decode()})
    assert cost_of(auth.placeholder_hash) == 6
    assert auth.check(basic("nobody", PASSWORD)) is False
    assert bcrypt_calls == [(PASSWORD.encode(), auth.placeholder_hash)]
    assert auth.check(basic("ops", "wrong")) is False and len(bcrypt_calls) == 2


def test_every_check_costs_the_same_bcrypt_work_whatever_each_users_cost(bcrypt_calls):
    """#21 M2: with users' hashes at different costs, a wrong password's timing named the user
    (1.8 ms at cost 4, 53 ms at cost 10). Every check now does the work of the highest cost:
    2^cost rounds in all, counted here, not timed."""
    passwords = {"cheap": (4, "a"), "middle": (5, "b"), "dear": (6, "c")}
    auth = BasicAuth({user: bcrypt.hashpw(pw.encode(), bcrypt.gensalt(cost)).decode()
                      for user, (cost, pw) in passwords.items()})

    def rounds(header: str, expected: bool) -> int:
        bcrypt_calls.clear()
        assert auth.check(header) is expected
        return sum(2 ** cost_of(hashed) for _, hashed in bcrypt_calls)

    for user in (*passwords, "nobody"):
        assert rounds(basic(user, "wrong"), False) == 2 ** 6, user
    for user, (_, pw) in passwords.items():
        assert rounds(basic(user, pw), True) == 2 ** 6, user


def test_a_non_ascii_authorization_header_is_refused_not_a_server_error(serve, capfd, caplog):
    """#21 L1: base64 of a str with non-ASCII characters raised, and each request was a 500 and
    an ERROR with a traceback."""
    assert BasicAuth({"prom": HASH}).check("Basic \u00e9t\u00e9") is False
    port = serve(make_state(), auth=BasicAuth({"prom": HASH})).port
    reply = raw_request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic \xc3\xa9t\xc3\xa9\r\n\r\n")
    assert status_of(reply) == 401
    assert "Traceback" not in capfd.readouterr().err and "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_verified_credential_is_remembered_for_a_while_without_bcrypt(bcrypt_calls):
    t = [0.0]
    auth = BasicAuth({"prom": HASH}, cache_seconds=60, cache_size=2, now=lambda: t[0])
    for _ in range(5):
        assert auth.check(basic("prom", PASSWORD)) is True
        t[0] += 30  # in use every 30 s: stays cached
    assert len(bcrypt_calls) == 1
    for _ in range(3):  # wrong passwords are never cached
        assert auth.check(basic("prom", "wrong")) is False
    assert len(bcrypt_calls) == 4
    t[0] += 61  # unused for longer than cache_seconds: checked again
    assert auth.check(basic("prom", PASSWORD)) is True and len(bcrypt_calls) == 5


def test_the_credential_cache_is_bounded(bcrypt_calls):
    users = {f"u{i}": bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode() for i in range(5)}
    auth = BasicAuth(users, cache_size=3)
    for user in users:
        assert auth.check(basic(user, "pw")) is True
    assert len(bcrypt_calls) == 5
    assert auth.check(basic("u4", "pw")) and auth.check(basic("u2", "pw")) and len(bcrypt_calls) == 5
    assert auth.check(basic("u0", "pw")) and len(bcrypt_calls) == 6  # the oldest made way


def test_wrong_passwords_cannot_take_more_than_two_bcrypt_slots_nor_hold_up_a_known_scraper(serve, monkeypatch):
    port = serve(make_state(), auth=BasicAuth({"prom": HASH})).port
    url = f"http://127.0.0.1:{port}/metrics"
    assert requests.get(url, auth=("prom", PASSWORD), timeout=HANG_BOUND).status_code == 200  # now cached
    inside, most, release = [], [0], threading.Event()
    lock = threading.Lock()

    def slow_checkpw(password, hashed):  # bcrypt at any cost: held until released
        with lock:
            inside.append(password)
            most[0] = max(most[0], len(inside))
        release.wait(30)
        with lock:
            inside.remove(password)
        return False
    monkeypatch.setattr(bcrypt, "checkpw", slow_checkpw)
    statuses = []
    attackers = [threading.Thread(target=lambda i=i: statuses.append(
        requests.get(url, auth=("prom", f"wrong{i}"), timeout=30).status_code)) for i in range(6)]
    try:
        for a in attackers:
            a.start()
        deadline = time.monotonic() + HANG_BOUND
        while (len(inside) < 2 or len(statuses) < 4) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(inside) == 2 and sorted(statuses) == [503] * 4  # refused at once, not queued
        r = requests.get(url, auth=("prom", PASSWORD), timeout=HANG_BOUND)  # while two checks are stuck
        assert r.status_code == 200 and "gpumem_gpu_info" in r.text
    finally:
        release.set()
        for a in attackers:
            a.join(30)
    assert most[0] == 2 and sorted(statuses) == [401, 401, 503, 503, 503, 503]


@pytest.mark.parametrize("user", ["prom", "nobody"])
def test_a_password_over_72_bytes_is_refused_not_a_server_error(serve, capfd, caplog, user):
    port = serve(make_state(), auth=BasicAuth({"prom": HASH})).port
    r = requests.get(f"http://127.0.0.1:{port}/metrics", auth=(user, "x" * 73), timeout=HANG_BOUND)
    assert r.status_code == 401
    assert "Traceback" not in capfd.readouterr().err and "Traceback" not in caplog.text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
def test_probes_get_their_own_listener_without_auth(tmp_path):
    """`run --health-listen`: with basic auth on, /healthz and /admission also answer on a
    plain listener of their own (Kubernetes probes send no credentials), and nothing else does."""
    web_yml = tmp_path / "web.yml"
    web_yml.write_text(f"basic_auth_users:\n  prom: '{HASH}'\n")
    main_port, health_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "run", "--simulate", "steady", "--interval", "1",
                             "--listen", f"127.0.0.1:{main_port}", "--health-listen", f"127.0.0.1:{health_port}",
                             "--web-config", str(web_yml)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        health = f"http://127.0.0.1:{health_port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if requests.get(health + "/healthz", timeout=2).status_code == 200:
                    break
            except requests.RequestException:  # not listening yet, or too busy starting to answer
                pass
            time.sleep(0.1)
        assert requests.get(health + "/healthz", timeout=HANG_BOUND).json()["status"] == "ok"
        assert requests.get(health + "/admission", timeout=HANG_BOUND).status_code == 200
        for path in ("/metrics", "/", "/api/findings"):
            assert requests.get(health + path, timeout=HANG_BOUND).status_code == 404
        main = f"http://127.0.0.1:{main_port}"
        assert requests.get(main + "/healthz", timeout=HANG_BOUND).status_code == 401
        assert requests.get(main + "/metrics", auth=("prom", PASSWORD), timeout=HANG_BOUND).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in out


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


@pytest.mark.integration
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
            requests.get(url, cert=cert, verify=ca, auth=("prom", PASSWORD), timeout=HANG_BOUND)
    # Plain HTTP on the TLS port is told so (a scraper set to the wrong scheme), and gets nothing else.
    plain = requests.get(url.replace("https", "http"), auth=("prom", PASSWORD), timeout=HANG_BOUND)
    assert plain.status_code == 400 and plain.text == "Client sent an HTTP request to an HTTPS server.\n"
    # A good certificate still needs the password: the two checks add up.
    assert requests.get(url, cert=good, verify=ca, timeout=HANG_BOUND).status_code == 401
    r = requests.get(url, cert=good, verify=ca, auth=("prom", PASSWORD), timeout=HANG_BOUND)
    assert r.status_code == 200 and "gpumem_gpu_info" in r.text
    assert "Traceback" not in capfd.readouterr().err  # refused handshakes are routine, not crashes


@pytest.mark.integration
def test_tls_client_that_never_says_hello_does_not_block_others(serve, pki, tmp_path):
    web_yml = tmp_path / "web.yml"
    web_yml.write_text(f"tls_server_config:\n  cert_file: {pki / 'server.pem'}\n  key_file: {pki / 'server.key'}\n")
    # The silent clients are held for up to STALL seconds: far longer than the bound below, so a
    # server that made a scrape wait for them could only fail here, never pass slowly.
    server = serve(make_state(), web=load_web_config(str(web_yml)), head_timeout=STALL)
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(10)]
    try:
        started = time.monotonic()
        r = requests.get(f"https://127.0.0.1:{server.port}/metrics", verify=str(pki / "ca.pem"), timeout=HANG_BOUND)
        assert r.status_code == 200 and time.monotonic() - started < HANG_BOUND
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
    assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=HANG_BOUND).status_code == 200


def test_more_than_100_headers_are_refused(serve):
    port = serve(make_state()).port
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(101))
    reply = raw_request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert status_of(reply) == 431 and b"gpumem" not in reply
    assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=HANG_BOUND).status_code == 200


def test_request_head_size_is_bounded_as_a_whole(serve):
    """Within the per-line and per-count limits, a head of 90 x 60 KB (5.4 MB) must still be refused."""
    port = serve(make_state()).port
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 60_000) for i in range(90))
    reply = raw_request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert status_of(reply) == 431 and b"gpumem" not in reply
    assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=HANG_BOUND).status_code == 200


def test_a_large_body_is_not_read(serve):
    port = serve(make_state()).port
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_BOUND) as s:
        s.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n" + b"x" * 1000)
        assert status_of(s.recv(4096)) == 405  # answered without waiting for 10 GB


def test_slowloris_clients_do_not_block_scrapes(serve):
    port = serve(make_state(), head_timeout=STALL).port
    stalled = []
    try:
        for _ in range(30):  # each sends half a request and then nothing
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            stalled.append(s)
        for _ in range(5):
            started = time.monotonic()
            assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=HANG_BOUND).status_code == 200
            assert time.monotonic() - started < HANG_BOUND  # not the STALL s a stalled handler may wait
    finally:
        for s in stalled:
            s.close()


def closed_by_server(s: socket.socket, within: float = 30.0) -> bool:
    """Wait (generously) until the server closes `s`: EOF or reset."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        readable, _, _ = select.select([s], [], [], 0.05)
        if readable:
            try:
                return s.recv(65536) == b""
            except OSError:
                return True
    return False


def connect_from(peer: str, port: int) -> socket.socket:
    """A connection to the listener from another loopback address: another peer. One refused
    at once may be reset before connect() returns: it is returned all the same (closed)."""
    s = socket.socket()
    s.settimeout(HANG_BOUND)
    s.bind((peer, 0))
    with contextlib.suppress(ConnectionResetError):
        s.connect(("127.0.0.1", port))
    return s


def test_held_connections_cost_no_thread_and_a_crowding_peer_makes_way(serve):
    """issue 14: a thread per connection, with no cap, took 1,500 slow clients to 1,506 threads.
    Slow clients now cost a socket each, up to max_connections; a scraper from another address
    takes the place of the oldest of the peer that holds the most (#21 M1)."""
    state = make_state()
    server = HttpServer(make_app(build_registry(lambda: state, time.time), lambda: state, time.time, 15.0),
                        "127.0.0.1", 0, max_connections=8).start()
    held = []
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        assert requests.get(url, timeout=HANG_BOUND).status_code == 200
        threads = threading.active_count()
        for _ in range(60):
            s = connect_from("127.0.0.2", server.port)
            with contextlib.suppress(OSError):  # refused at once: the point
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            held.append(s)
        for _ in range(3):
            r = requests.get(url, timeout=HANG_BOUND)
            assert r.status_code == 200 and "gpumem_gpu_info" in r.text
        assert threading.active_count() <= threads + 3  # at most the rest of the worker pool
        assert closed_by_server(held[0])  # the peer's oldest made way
        assert all(closed_by_server(s) for s in held[8:])  # past its limit: refused at once
        assert server.open_connections <= 8
    finally:
        for s in held:
            s.close()
        server.stop()


def test_the_request_head_has_a_total_deadline():
    """A client sending a byte every 50 ms never trips a per-read timeout; the whole head's
    deadline (0.5 s here) ends it while it is still sending."""
    state = make_state()
    server = HttpServer(make_app(build_registry(lambda: state, time.time), lambda: state, time.time, 15.0),
                        "127.0.0.1", 0, head_timeout=0.5).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nX-Trickle: ")
            closed, deadline = False, time.monotonic() + 60
            while not closed and time.monotonic() < deadline:
                try:
                    s.sendall(b"a")
                except OSError:
                    closed = True
                closed = closed or closed_by_server(s, within=0.05)
            assert closed
    finally:
        server.stop()


def test_when_every_connection_is_being_answered_a_new_one_is_refused_at_once():
    entered, release = threading.Semaphore(0), threading.Event()

    def stuck(environ, start_response):
        entered.release()
        release.wait(30)
        start_response("200 OK", [("Content-Length", "3")])
        return [b"ok\n"]
    server = HttpServer(stuck, "127.0.0.1", 0, max_connections=2, workers=2).start()
    url = f"http://127.0.0.1:{server.port}/"
    busy = [threading.Thread(target=requests.get, args=(url,), kwargs={"timeout": 30}) for _ in range(2)]
    try:
        for t in busy:
            t.start()
        assert entered.acquire(timeout=30) and entered.acquire(timeout=30)
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            try:
                s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            except ConnectionResetError:
                return  # refused (reset) before the request was even written: not queued
            assert closed_by_server(s)  # not queued behind the two
    finally:
        release.set()
        for t in busy:
            t.join(30)
        server.stop()


def test_sampling_keeps_its_pace_while_slow_clients_crowd_the_listener():
    """The daemon ticks on its own thread: 200 held connections take no thread and no tick."""
    from exporter.cli import make_analyzer

    config = build_config()
    rt = build_runtime(config, simulate="steady", speed=100.0)  # a 5 s tick every 50 ms
    daemon = Daemon(rt.sampler, rt.clock, 5.0, analyzer=make_analyzer(config))
    registry = build_registry(lambda: daemon.state, rt.clock.now)
    server = HttpServer(make_app(registry, lambda: daemon.state, rt.clock.now, 15.0), "127.0.0.1", 0,
                        max_connections=16).start()
    held = []
    try:
        daemon.start()
        threads = threading.active_count()
        for _ in range(200):
            s = connect_from("127.0.0.2", server.port)
            with contextlib.suppress(OSError):  # refused at once past the limit
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            held.append(s)
        before = daemon.state.samples_total
        deadline = time.monotonic() + 60
        while daemon.state.samples_total < before + 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemon.state.samples_total >= before + 5
        r = requests.get(f"http://127.0.0.1:{server.port}/metrics", timeout=HANG_BOUND)
        assert r.status_code == 200 and "gpumem_exporter_samples_total" in r.text
        assert threading.active_count() <= threads + 4  # the worker pool, at most
    finally:
        for s in held:
            s.close()
        server.stop()
        daemon.stop()
        rt.close()


def test_a_request_line_without_a_version_gets_a_status_line(serve):
    """HTTP/0.9 has no status line: the stdlib would answer the page bare."""
    port = serve(make_state()).port
    reply = raw_request(port, b"GET /metrics\r\n")
    assert reply.startswith(b"HTTP/1.0 400 ") and b"gpumem" not in reply
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_BOUND) as s:  # answered without waiting for EOF
        s.sendall(b"GET /metrics\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.0 400 ")


@pytest.mark.parametrize("request_bytes, status", [
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),  # the HTTP/2 connection preface
    (b"GET /metrics HTTP/9.9\r\nHost: x\r\n\r\n", 505),
    (b"GET /metrics HTTP/1.x\r\nHost: x\r\n\r\n", 400),
    (b"GET /metrics HTTX/1.1\r\nHost: x\r\n\r\n", 400),
])
def test_a_bad_or_unsupported_version_gets_a_status_line(serve, request_bytes, status):
    """#21 L13: errors found before the version was accepted were answered as HTTP/0.9: an error
    page with no status line."""
    reply = raw_request(serve(make_state()).port, request_bytes)
    assert reply.startswith(b"HTTP/1.0 %d " % status) and b"gpumem" not in reply


def test_control_characters_from_request_lines_are_escaped_in_the_log(serve, caplog):
    caplog.set_level(logging.DEBUG, logger="exporter")
    port = serve(make_state()).port
    assert status_of(raw_request(port, b"GET /\x1b[2J\x1b]0;owned\x07 HTTP/1.1\r\nHost: x\r\n\r\n")) == 404
    assert status_of(raw_request(port, b"GET /\x1b[1A\rfake HTTP/1.1\r\nHost: x\r\n\r\n")) == 400
    deadline = time.monotonic() + 30
    while "fake" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "\\x1b[2J\\x1b]0;owned\\x07" in caplog.text and "\\x1b[1A\\x0dfake" in caplog.text
    assert not any(c in caplog.text for c in "\x1b\x07\r")


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
            outputs = {path: requests.get(base + path, timeout=HANG_BOUND).text
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


@pytest.mark.integration
def test_a_query_token_is_not_logged_even_at_debug_level(echo):
    """#21 L10: urllib3 logs every request line at debug level, the endpoint's query string (and
    the token some proxies take there) included. The real entry point, as an operator runs it."""
    result = subprocess.run([sys.executable, "-m", "exporter", "--log-level", "debug", "snapshot", "--simulate",
                             "steady", "--vllm-endpoint", f"http://127.0.0.1:{echo}/metrics?token={TOKEN}"],
                            capture_output=True, text=True, timeout=HANG_BOUND)
    assert result.returncode == 0, result.stderr
    assert TOKEN not in result.stderr and TOKEN[:12] not in result.stderr


def test_secrets_are_redacted_whole_and_in_pieces():
    from exporter.sources.httpclient import Secrets

    token = "s3cret-t0ken-for-tests"
    secrets = Secrets((token, "pw", None))
    assert secrets.scrub(f"Bearer {token}") == "Bearer <redacted>"
    assert secrets.scrub(token[:9]) == "<redacted>" and secrets.scrub("x-" + token[-8:]) == "x-<redacted>"
    assert secrets.scrub(token[:7]) == token[:7]  # under 8 characters a piece says nothing
    assert secrets.scrub("user pw here") == "user <redacted> here"  # a short secret only whole
    assert secrets.scrub("nothing secret") == "nothing secret"
