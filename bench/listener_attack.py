"""A valid scraper's latency while an attacker on loopback holds slow connections and sends wrong
passwords, and what the attack costs the daemon (threads, resident memory, sampling).

    python bench/listener_attack.py [--slow 1000] [--wrong 8] [--seconds 20] [--code DIR ...]

Starts `python -m exporter run --simulate steady --interval 1` with basic auth (one user, a
bcrypt hash of cost 10, as `htpasswd -nBC 10` makes) on a free loopback port. A valid scraper
(a Prometheus stand-in: its credential is verified once, then cached) scrapes /metrics every
0.2 s: first for 5 s alone, then for `--seconds` while an attacker process
- holds `--slow` connections that each send a request line and then one header line every 2 s
  (never finishing the head), reconnecting whenever the server closes one, and
- runs `--wrong` clients sending wrong passwords for the known user back to back.
Reported: the scraper's latency median / p99 / max and failed scrapes, alone and under attack;
the daemon's peak thread count and resident memory; samples taken during the attack against the
number expected (one per interval). Each `--code DIR` (default: this checkout) runs in turn,
with DIR as the daemon's import path, so two versions compare side by side in one run.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import select
import signal
import socket
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_status(pid: int) -> tuple[int, int]:
    """(threads, resident bytes) of a process, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) * 1024


def _samples_total(text: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpumem_exporter_samples_total":
                return sample.value
    return None


def _hold_slow_connections(port: int, count: int, stop, reconnects) -> None:
    """`count` connections that never finish their request head; closed ones are reopened."""
    socks: dict[int, tuple[socket.socket, float]] = {}  # fd -> (socket, last send)
    poller = select.poll()

    def connect():
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=1)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            s.setblocking(False)
            socks[s.fileno()] = (s, time.monotonic())
            poller.register(s, select.POLLIN)
        except OSError:
            pass

    def drop(fd):
        s, _ = socks.pop(fd)
        poller.unregister(fd)
        s.close()

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
            reconnects.value += 1
            connect()
    for fd in list(socks):
        drop(fd)


def _wrong_passwords(url: str, stop, answers) -> None:
    with requests.Session() as session:
        while not stop.is_set():
            try:
                status = session.get(url, auth=(USER, "wrong password"), timeout=10).status_code
                answers[status] = answers.get(status, 0) + 1
            except requests.RequestException:
                answers["error"] = answers.get("error", 0) + 1


def _attack(port: int, slow: int, wrong: int, stop, reconnects, answers) -> None:
    url = f"http://127.0.0.1:{port}/metrics"
    workers = [threading.Thread(target=_wrong_passwords, args=(url, stop, answers), daemon=True)
               for _ in range(wrong)]
    for w in workers:
        w.start()
    _hold_slow_connections(port, slow, stop, reconnects)
    for w in workers:
        w.join(15)


class Daemon:
    def __init__(self, code: Path, web_config: Path, interval: float):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exporter", "run", "--simulate", "steady", "--interval", str(interval),
             "--listen", f"127.0.0.1:{self.port}", "--web-config", str(web_config)],
            cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(code)})

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if requests.get(self.url, auth=(USER, PASSWORD), timeout=2).status_code == 200:
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


def _scrape_for(daemon: Daemon, seconds: float, peaks: list[int]) -> dict:
    """The valid scraper, every SCRAPE_EVERY s; the daemon's threads and RSS watched meanwhile."""
    latencies, failures, samples = [], 0, []
    deadline = time.monotonic() + seconds
    with requests.Session() as session:
        while time.monotonic() < deadline:
            began = time.perf_counter()
            try:
                r = session.get(daemon.url, auth=(USER, PASSWORD), timeout=10)
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
    return {"latencies": latencies, "failures": failures,
            "samples": samples[-1] - samples[0] if len(samples) > 1 else 0.0}


def _ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return f"{values[min(len(values) - 1, int(q * len(values)))] * 1e3:.0f}"


def measure(code: Path, web_config: Path, args) -> dict:
    daemon = Daemon(code, web_config, args.interval)
    try:
        daemon.wait_ready()
        peaks = [0, 0]
        quiet = _scrape_for(daemon, QUIET_SECONDS, peaks)
        quiet_peaks = list(peaks)
        stop = multiprocessing.Event()
        manager = multiprocessing.Manager()
        answers, reconnects = manager.dict(), manager.Value("i", 0)
        attacker = multiprocessing.Process(target=_attack, args=(daemon.port, args.slow, args.wrong, stop,
                                                                  reconnects, answers), daemon=True)
        attacker.start()
        peaks = [0, 0]
        attacked = _scrape_for(daemon, args.seconds, peaks)
        stop.set()
        attacker.join(30)
        result = {"quiet": quiet, "quiet_peaks": quiet_peaks, "attacked": attacked, "peaks": peaks,
                  "answers": dict(answers), "reconnects": reconnects.value}
        manager.shutdown()
        return result
    finally:
        daemon.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slow", type=int, default=1000, help="slow connections held (default 1000)")
    ap.add_argument("--wrong", type=int, default=8, help="clients sending wrong passwords (default 8)")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the attack (default 20)")
    ap.add_argument("--interval", type=float, default=1.0, help="the daemon's sampling interval")
    ap.add_argument("--code", type=Path, action="append",
                    help="a checkout whose exporter package runs the daemon; repeatable (default: this one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        web_config = Path(tmp) / "web.yml"
        hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
        web_config.write_text(f"basic_auth_users:\n  {USER}: '{hashed}'\n")
        print(f"attack: {args.slow} slow connections (a header line every 2 s) + {args.wrong} wrong-password "
              f"clients for {args.seconds:g} s; valid scraper every {SCRAPE_EVERY:g} s\n")
        print("| code | alone p50 / p99 ms | attacked p50 / p99 / max ms | failed scrapes | threads alone / attacked "
              "| RSS MiB alone / attacked | samples / expected | wrong-password answers | attacker reconnects |")
        print("|---|---|---|---|---|---|---|---|---|")
        for code in args.code or [ROOT]:
            r = measure(code.resolve(), web_config, args)
            q, a = r["quiet"], r["attacked"]
            answers = ", ".join(f"{k}: {v}" for k, v in sorted(r["answers"].items(), key=str))
            print(f"| {code} | {_ms(q['latencies'], .5)} / {_ms(q['latencies'], .99)} "
                  f"| {_ms(a['latencies'], .5)} / {_ms(a['latencies'], .99)} / {_ms(a['latencies'], 1)} "
                  f"| {a['failures']} of {a['failures'] + len(a['latencies'])} "
                  f"| {r['quiet_peaks'][0]} / {r['peaks'][0]} "
                  f"| {r['quiet_peaks'][1] / 2**20:.0f} / {r['peaks'][1] / 2**20:.0f} "
                  f"| {a['samples']:.0f} / {args.seconds / args.interval:.0f} | {answers} | {r['reconnects']} |",
                  flush=True)


if __name__ == "__main__":
    main()
