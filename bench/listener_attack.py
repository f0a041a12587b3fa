"""A valid scraper's latency while an attacker on loopback crowds the listener, and what the attack
costs the daemon (CPU, threads, resident memory, sampling), old and new code side by side.

    python bench/listener_attack.py [--case slow|tls|full ...] [--runs 3] [--baseline REV] [--code DIR ...]
                                    [--slow 4000] [--wrong 8] [--tls-connections 1000] [--tls-peers 16]
                                    [--hello large|small] [--seconds 20]

Each run starts `python -m exporter run --simulate steady --interval 1` with basic auth (one user,
a bcrypt hash of cost 10, as `htpasswd -nBC 10` makes) on a free loopback port. A valid scraper
(a Prometheus stand-in at 127.0.0.1: its credential is verified once, then cached) scrapes
/metrics every 0.2 s, first for 5 s alone, then for `--seconds` while an attacker process, from
other loopback addresses (other peers), runs one case:

- `slow` (#21 M1): one peer (127.0.0.2) holds `--slow` connections that each send a request
  line and then one header line every 2 s, never finishing the head, reconnecting whenever the
  server closes one; and `--wrong` clients send wrong passwords for the known user back to back.
- `tls` (#21 H1): the daemon serves TLS; `--tls-connections` connections from `--tls-peers`
  addresses (127.0.0.2 ...) each send the start of a ClientHello and wait, in rounds of
  `--seconds / 4`: all closed and opened again four times. `--hello small` sends the first
  11 bytes (what the red team sent); `large` one whole 16 KiB record of a hello that announces
  128 KiB, for which OpenSSL makes room at once (the costliest handshake to hold).
- `full`: every listener budget full at once, each connection as costly as it can be made: TLS;
  64 large half hellos from 4 peers, then 960 connections from 16 more peers that finish the
  handshake, send a request head one byte short of the 16 KiB limit without its end, and then
  all but the last byte of a 16 KiB record (which OpenSSL holds, waiting for the rest); the
  attack lasts `--seconds` from the moment all are in place.

Reported per case and code, as the median of `--runs` runs (they alternate between the codes):
the scraper's latency median / p99 / max and failed scrapes, alone and under attack; the
daemon's CPU (% of one core) during the attack; its resident memory alone, at its peak and 5 s
after the attack ended (memory given back or not); its peak threads; samples taken against those
expected; the attacker's refused or dropped connections. The machine's load average is printed
before and after: on a shared machine, read the figures against it.

`--baseline REV` runs the daemon from `git archive REV` of this repository as well (first), and
each `--code DIR` from that checkout's `exporter` package (default: this one).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import select
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import bcrypt
import requests
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
USER, PASSWORD = "prometheus", "correct horse battery staple"
SCRAPE_EVERY = 0.2
QUIET_SECONDS = 5.0
SETTLE_SECONDS = 5.0  # after the attack, before resident memory is read again
ATTACKER = "127.0.0.2"
TLS_ROUNDS = 4
HEAD_LIMIT = 16 << 10  # the listener's request head limit (serve/server.py)
# A TLS 1.2 ClientHello record's header and the start of its handshake header (512 bytes announced).
SMALL_HELLO = bytes.fromhex("160301020001000200") + b"\x03\x03"
_HELLO_START = b"\x01" + (128 << 10).to_bytes(3, "big") + b"\x03\x03" + bytes((16 << 10) - 6)
LARGE_HELLO = b"\x16\x03\x01" + len(_HELLO_START).to_bytes(2, "big") + _HELLO_START


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_status(pid: int) -> tuple[int, int]:
    """(threads, resident bytes) of a process, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) * 1024


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _samples_total(text: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpumem_exporter_samples_total":
                return sample.value
    return None


def _connect(port: int, source: str, first_bytes: bytes) -> socket.socket | None:
    s = socket.socket()
    try:
        s.settimeout(1)
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(first_bytes)
        s.setblocking(False)
        return s
    except OSError:  # refused at once, or the backlog is full
        s.close()
        return None


def _hold_slow_connections(port: int, count: int, stop, dropped) -> None:
    """`count` connections that never finish their request head; closed ones are reopened."""
    socks: dict[int, tuple[socket.socket, float]] = {}  # fd -> (socket, last send)
    poller = select.poll()

    def connect():
        s = _connect(port, ATTACKER, b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        if s is None:
            dropped.value += 1
            return
        socks[s.fileno()] = (s, time.monotonic())
        poller.register(s, select.POLLIN)

    def drop(fd):
        s, _ = socks.pop(fd)
        poller.unregister(fd)
        s.close()
        dropped.value += 1

    while len(socks) < count and not stop.is_set():
        connect()
    while not stop.is_set():
        for fd, _ in poller.poll(200):  # readable: answered or closed by the server
            drop(fd)
        for fd, (s, last) in list(socks.items()):
            if time.monotonic() - last >= 2.0:
                try:
                    s.send(b"X-Slow: a\r\n")
                    socks[fd] = (s, time.monotonic())
                except OSError:
                    drop(fd)
        while len(socks) < count and not stop.is_set():
            connect()
    for fd in list(socks):
        socks.pop(fd)[0].close()


def _half_hellos(port: int, count: int, peers: int, hello: bytes, round_seconds: float, stop, dropped) -> None:
    """Rounds of `count` connections from `peers` addresses, each sending the start of a hello
    and waiting; closed by us at the end of the round, never reopened within it."""
    while not stop.is_set():
        held = [_connect(port, f"127.0.0.{2 + i % peers}", hello) for i in range(count)]
        dropped.value += sum(s is None for s in held)
        stop.wait(round_seconds)
        for s in held:
            if s is not None:
                s.close()


def _established(port: int, source: str) -> socket.socket | None:
    """A TLS connection whose head is one byte short of the limit, unended, followed by all but
    the last byte of a full record: the most a finished handshake can make the server hold."""
    s = _connect(port, source, b"")
    if s is None:
        return None
    s.setblocking(True)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    tls = context.wrap_bio(incoming, outgoing)
    try:
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                s.sendall(outgoing.read())
                data = s.recv(65536)
                if not data:
                    raise OSError("closed in the handshake") from None
                incoming.write(data)
        s.sendall(outgoing.read())
        head = b"GET /metrics HTTP/1.1\r\nX-Fill: "
        tls.write(head + b"a" * (HEAD_LIMIT - 1 - len(head)))
        s.sendall(outgoing.read())
        tls.write(b"a" * (16 << 10))
        record = outgoing.read()
        s.sendall(record[:-1])
        s.setblocking(False)
        return s
    except OSError:  # ssl.SSLError included: refused or dropped
        s.close()
        return None


def _every_budget_full(port: int, stop, dropped, ready) -> None:
    held = [_connect(port, f"127.0.0.{2 + i % 4}", LARGE_HELLO) for i in range(64)]
    held += [_established(port, f"127.0.0.{6 + i % 16}") for i in range(960)]
    dropped.value += sum(s is None for s in held)
    ready.set()
    stop.wait()
    for s in held:
        if s is not None:
            s.close()


def _wrong_passwords(url: str, stop, answers) -> None:
    with requests.Session() as session:
        while not stop.is_set():
            try:
                status = session.get(url, auth=(USER, "wrong password"), timeout=10, verify=False).status_code
                answers[status] = answers.get(status, 0) + 1
            except requests.RequestException:
                answers["error"] = answers.get("error", 0) + 1


def _attack(case: str, port: int, args, stop, dropped, answers, ready) -> None:
    if case == "full":
        _every_budget_full(port, stop, dropped, ready)
        return
    ready.set()
    if case == "tls":
        _half_hellos(port, args.tls_connections, args.tls_peers, LARGE_HELLO if args.hello == "large" else SMALL_HELLO,
                     args.seconds / TLS_ROUNDS, stop, dropped)
        return
    workers = [threading.Thread(target=_wrong_passwords, args=(f"http://127.0.0.1:{port}/metrics", stop, answers),
                                daemon=True) for _ in range(args.wrong)]
    for w in workers:
        w.start()
    _hold_slow_connections(port, args.slow, stop, dropped)
    for w in workers:
        w.join(15)


class Daemon:
    def __init__(self, code: Path, web_config: Path, interval: float, scheme: str):
        self.port = _free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}/metrics"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exporter", "run", "--simulate", "steady", "--interval", str(interval),
             "--listen", f"127.0.0.1:{self.port}", "--web-config", str(web_config)],
            cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(code)})

    def wait_ready(self, verify, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if requests.get(self.url, auth=(USER, PASSWORD), timeout=2, verify=verify).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError("daemon never answered")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


def _scrape_for(daemon: Daemon, seconds: float, peaks: list[int], verify, ready=None) -> dict:
    """The valid scraper, every SCRAPE_EVERY s, until `seconds` after `ready` is set (an attack in
    place); the daemon's threads and RSS watched meanwhile."""
    latencies, failures, samples = [], 0, []
    began_all = time.monotonic()
    deadline = began_all + seconds
    with requests.Session() as session:
        while time.monotonic() < deadline or (ready is not None and not ready.is_set()):
            if ready is not None and not ready.is_set():
                deadline = time.monotonic() + seconds
            began = time.perf_counter()
            try:
                r = session.get(daemon.url, auth=(USER, PASSWORD), timeout=10, verify=verify)
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - began)
                    samples.append(_samples_total(r.text))
                else:
                    failures += 1
            except requests.RequestException:
                failures += 1
            threads, rss = _proc_status(daemon.proc.pid)
            peaks[0], peaks[1] = max(peaks[0], threads), max(peaks[1], rss)
            time.sleep(max(0.0, SCRAPE_EVERY - (time.perf_counter() - began)))
    samples = [s for s in samples if s is not None]
    return {"latencies": latencies, "failures": failures, "seconds": time.monotonic() - began_all,
            "samples": samples[-1] - samples[0] if len(samples) > 1 else 0.0}


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(case: str, code: Path, files: dict[str, Path], args) -> dict[str, float]:
    tls = case in ("tls", "full")
    verify = str(files["cert"]) if tls else True
    daemon = Daemon(code, files["web_tls" if tls else "web"], args.interval, "https" if tls else "http")
    try:
        daemon.wait_ready(verify)
        peaks = [0, 0]
        quiet = _scrape_for(daemon, QUIET_SECONDS, peaks, verify)
        quiet_peaks = list(peaks)
        stop, ready = multiprocessing.Event(), multiprocessing.Event()
        manager = multiprocessing.Manager()
        answers, dropped = manager.dict(), manager.Value("i", 0)
        attacker = multiprocessing.Process(target=_attack, args=(case, daemon.port, args, stop, dropped, answers,
                                                                  ready), daemon=True)
        cpu_before, wall_before = _cpu_seconds(daemon.proc.pid), time.monotonic()
        attacker.start()
        peaks = [0, 0]
        attacked = _scrape_for(daemon, args.seconds, peaks, verify, ready)
        cpu = (_cpu_seconds(daemon.proc.pid) - cpu_before) / (time.monotonic() - wall_before)
        stop.set()
        attacker.join(60)
        time.sleep(SETTLE_SECONDS)
        settled = _proc_status(daemon.proc.pid)[1]
        dropped_total = dropped.value
        wrong = sum(v for v in answers.values())
        manager.shutdown()
        lat = attacked["latencies"]
        return {
            "alone_p50": _quantile(quiet["latencies"], .5) * 1e3, "alone_p99": _quantile(quiet["latencies"], .99) * 1e3,
            "p50": _quantile(lat, .5) * 1e3, "p99": _quantile(lat, .99) * 1e3, "max": _quantile(lat, 1) * 1e3,
            "failed": attacked["failures"], "scrapes": attacked["failures"] + len(lat),
            "cpu": cpu * 100, "rss_alone": quiet_peaks[1] / 2**20, "rss_peak": peaks[1] / 2**20,
            "rss_after": settled / 2**20, "threads": peaks[0],
            "samples": attacked["samples"], "expected": attacked["seconds"] / args.interval,
            "dropped": dropped_total, "wrong": wrong,
        }
    finally:
        daemon.stop()


def _files(tmp: Path) -> dict[str, Path]:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    users = f"basic_auth_users:\n  {USER}: '{hashed}'\n"
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    (tmp / "web.yml").write_text(users)
    (tmp / "web-tls.yml").write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n{users}")
    return {"web": tmp / "web.yml", "web_tls": tmp / "web-tls.yml", "cert": cert}


def _baseline(rev: str, tmp: Path) -> Path:
    where = tmp / f"code-{rev}"
    where.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=["slow", "tls", "full"],
                    help="repeatable (default: slow and tls)")
    ap.add_argument("--runs", type=int, default=3, help="runs per case and code; medians reported (default 3)")
    ap.add_argument("--slow", type=int, default=4000, help="slow connections one peer holds (default 4000)")
    ap.add_argument("--wrong", type=int, default=8, help="clients sending wrong passwords (default 8)")
    ap.add_argument("--tls-connections", type=int, default=1000, help="half-finished handshakes (default 1000)")
    ap.add_argument("--tls-peers", type=int, default=16, help="addresses they come from (default 16)")
    ap.add_argument("--hello", choices=["large", "small"], default="large", help="how much of a hello each sends")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the attack (default 20)")
    ap.add_argument("--interval", type=float, default=1.0, help="the daemon's sampling interval")
    ap.add_argument("--baseline", metavar="REV", help="also run `git archive REV` of this repository, first")
    ap.add_argument("--code", type=Path, action="append",
                    help="a checkout whose exporter package runs the daemon; repeatable (default: this one)")
    args = ap.parse_args()
    cases = args.case or ["slow", "tls"]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        files = _files(tmp)
        codes = [(f"{args.baseline}", _baseline(args.baseline, tmp))] if args.baseline else []
        codes += [(str(c), c.resolve()) for c in args.code or [ROOT]]
        if not args.code:
            codes[-1] = ("this checkout", ROOT)
        print(f"slow: one peer ({ATTACKER}) holds {args.slow} slow connections (a header line every 2 s, reopened "
              f"when closed) + {args.wrong} wrong-password clients; tls: {args.tls_connections} connections from "
              f"{args.tls_peers} peers each send the start of a ClientHello ({args.hello}) and wait, "
              f"{TLS_ROUNDS} rounds; {args.seconds:g} s of attack; a valid scraper every {SCRAPE_EVERY:g} s; "
              f"medians of {args.runs} runs")
        print(f"before: {_load()}", flush=True)
        results: dict[tuple[str, str], list[dict[str, float]]] = {}
        for run in range(args.runs):
            for case in cases:
                for name, code in codes:
                    r = measure(case, code, files, args)
                    results.setdefault((case, name), []).append(r)
                    print(f"  run {run + 1} {case} {name}: p50 {r['p50']:.0f} ms, p99 {r['p99']:.0f} ms, "
                          f"failed {r['failed']}/{r['scrapes']}, cpu {r['cpu']:.0f} %, RSS peak {r['rss_peak']:.0f} "
                          f"MiB, after {r['rss_after']:.0f} MiB", flush=True)
        print(f"after: {_load()}\n")
        print("| case | code | alone p50 / p99 ms | attacked p50 / p99 / max ms | failed scrapes | daemon CPU % "
              "| RSS MiB alone / peak / 5 s after | threads | samples / expected | attacker's refused or dropped |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for (case, name), runs in results.items():
            m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"| {case} | {name} | {m['alone_p50']:.0f} / {m['alone_p99']:.0f} "
                  f"| {m['p50']:.0f} / {m['p99']:.0f} / {m['max']:.0f} | {m['failed']:.0f} of {m['scrapes']:.0f} "
                  f"| {m['cpu']:.0f} | {m['rss_alone']:.0f} / {m['rss_peak']:.0f} / {m['rss_after']:.0f} "
                  f"| {m['threads']:.0f} | {m['samples']:.0f} / {m['expected']:.0f} | {m['dropped']:.0f} |")


if __name__ == "__main__":
    main()
