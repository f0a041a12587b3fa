"""Overhead of the exporter against nvitop-exporter on the same simulated hosts, in the same run.

    python3 -m venv /tmp/nvitop-venv && /tmp/nvitop-venv/bin/pip install nvitop-exporter
    python bench/overhead.py [--nvitop-site /tmp/nvitop-venv/lib/python3.11/site-packages]
                             [--gpus 1 8 16] [--procs 16 64 256] [--ticks 12] [--scrapes 200]
                             [--warm-ticks 3] [--rounds 1] [--vllm-page FILE]

Hosts: 1, 8 and 16 simulated GPUs with 16, 64 or 256 processes on each and 4 vLLM endpoints,
sampled every 5 s. Both exporters read the simulator's drop-in pynvml module (nvitop-exporter
gets it as sys.modules["pynvml"] before it is imported), and the GPU processes are REAL
processes (idle `sleep`s spawned here, their PIDs written into the scenario), so both look up
name, memory and owner in the real /proc as they would on a GPU host.

Each (exporter, host) runs in its own worker process, so its CPU time and resident memory are
its own. Each vLLM server runs in a process of its own too, as a real API server does, and the
engine of each (the GPU process the exporter must tie to that endpoint) is its child; the other
GPU processes are children of this parent process, which serves nothing. Measured per worker:
- CPU seconds per hour: CPU time (user + system) of a sampling tick, ticks run back to back
  with the clock advanced 5 s each, times 720 ticks an hour; scrapes excluded (they depend on
  Prometheus's interval, not ours: see scrape latency). The first `--warm-ticks` (3) are not
  timed: caches fill. `--warm-ticks 720` times the steady state instead, an hour of raw history
  behind every tick, as after the daemon's first hour (detectors that read the history pay
  for its length);
- resident memory (RSS) after the ticks;
- scrape latency: wall time of GET /metrics over loopback from this process, median and p99.
Our exporter runs sources + analysis (history and every detector) + its collector, the way the
daemon does; nvitop-exporter runs its own `update_host()` + `update_device()` loop body. Both
serve /metrics with prometheus_client's HTTP server, so the listener is the same.

With `--rounds N` the three workers run in turn N times and each one's ticks are pooled before
the median, so a change in the machine's load falls on all three alike.

Ours runs twice: with the 4 vLLM endpoints ("ours"), and without them ("ours, no vLLM"), which
is the same work nvitop-exporter does. The simulated vLLM servers answer with a page the size
of a real one (about 500 lines: vLLM's request histograms, the API server's http_* families)
over keep-alive connections, as uvicorn does; with `--vllm-page FILE` each answers with that
file instead (tests/fixtures/vllm/v0_32_cpu_served.prom: a real vLLM 0.32's page, 620 lines).
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

INTERVAL = 5.0
VLLM_ENDPOINTS = 4
TICKS_PER_HOUR = 3600 / INTERVAL
WINDOW_TICKS = 6  # CPU is summarised over this many ticks: one idle page read each (30 s)


def server_positions(gpus: int, procs_per_gpu: int) -> list[int]:
    """Where, in the host's process list, each vLLM server's engine is: the first process of GPUs
    0..3, or of GPU 0 and the ones after it where there are fewer GPUs."""
    firsts = [g * procs_per_gpu for g in range(min(gpus, VLLM_ENDPOINTS))]
    rest = [i for i in range(gpus * procs_per_gpu) if i not in firsts]
    return firsts + rest[:VLLM_ENDPOINTS - len(firsts)]


def scenario_dict(gpus: int, procs_per_gpu: int, pids: list[int]) -> dict:
    """A host of `gpus` H100s with `procs_per_gpu` processes each (PIDs in that order); the
    processes at server_positions() are the engines of 4 vLLM servers with a /metrics endpoint."""
    processes = [{"pid": pid, "name": "python3", "gpu": i // procs_per_gpu,
                  "memory": [{"constant": f"{max(1, 60 // procs_per_gpu)}GiB"},
                             {"sawtooth": {"period": 60, "amplitude": "64MiB"}},
                             {"noise": {"stddev": "8MiB"}}],
                  "rss": "512MiB"} for i, pid in enumerate(pids)]
    vllm = []
    for n, i in enumerate(server_positions(gpus, procs_per_gpu)):
        big = n < gpus  # one server per GPU; where GPUs are fewer, the extra servers are small
        vllm.append({"port": 8000 + n, "pid": pids[i], "model": f"model-{n}",
                     "kv_cache_usage": 0.5, "running": 8, "waiting": 1,
                     "cache_config": {"gpu_memory_utilization": 0.9 if big else 0.2,
                                      "num_gpu_blocks": 30000 if big else 3000}})
    return {"name": f"bench-{gpus}x{procs_per_gpu}", "description": "overhead benchmark", "duration": "2h",
            "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory": "81559MiB", "reserved": "527MiB",
                      "count": gpus}],
            "host": {"memory": "2015GiB", "available": "1500GiB"},
            "processes": processes, "vllm": vllm}


# -- workers (each in its own process) ------------------------------------------------------------
def _serve(registry) -> int:
    from prometheus_client import start_http_server
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    return server.server_address[1]


def _rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def worker_ours(spec: dict, endpoints: list[str], ticks: int, warm: int, by_name: bool = True,
                working: bool = False) -> dict:
    from exporter.cli import make_analyzer
    from exporter.clock import FixedClock
    from exporter.config import build as build_config
    from exporter.daemon import Sampler
    from exporter.model import State
    from exporter.serve.exposition import build_registry
    from exporter.sim import fake_nvml
    from exporter.sim.scenario import from_dict
    from exporter.sources.host import HostSource, LocalHost
    from exporter.sources.nvml import NvmlSource
    from exporter.sources.vllm import VllmEndpoint, VllmSource

    clock = FixedClock(float(int(time.time()) // 60 * 60), at=600.0)
    fake_nvml.configure(from_dict(spec), clock)
    host = LocalHost(monotonic=clock.now)  # its caches expire on the played clock, as in 5 s ticks
    nvml = NvmlSource(fake_nvml, host.memory, now=clock.now)
    sources = [nvml, HostSource(host)]
    if endpoints:  # as the daemon: no endpoint configured, no vLLM source
        # Working servers' pages are read every tick; idle ones' every 30 s (vllm_idle.py): these
        # servers' processes are idle, so `working` reads every tick as a working server is read.
        options = {"by_name": by_name, **({"idle_read_seconds": 0} if working else {})}
        sources.append(VllmSource([VllmEndpoint(url=u, name=f"ep{i}", **options) for i, u in enumerate(endpoints)],
                                  host=host))
    sampler = Sampler(sources, now=clock.now)
    analyzer = make_analyzer(build_config())
    logging.getLogger("exporter.findings").propagate = False  # logged, not printed over the table
    logging.getLogger("exporter.findings").addHandler(logging.NullHandler())
    state = State()
    registry = build_registry(lambda: state, clock.now)
    cpu = []
    for i in range(ticks + warm):
        clock.advance(INTERVAL)
        c0 = time.process_time()
        snap = sampler.sample()
        analysis = analyzer.update(snap)
        state = State(snapshot=snap, analysis=analysis, last_sample_at=snap.timestamp, samples_total=i + 1)
        if i >= warm:  # warm-up: caches and history fill in the first ticks
            cpu.append(time.process_time() - c0)
    procs = sum(len(g.processes) for g in state.snapshot.gpus)
    if endpoints:  # the measurement is of the real work only if each server's engine is found as its
        tied = {p.pid: p.endpoint for g in state.snapshot.gpus for p in g.processes if p.role == "vllm"}
        print(f"ours: {len(tied)} GPU processes tied to {len(set(tied.values()))} of {len(endpoints)} "
              "endpoints", file=sys.stderr)
    return {"cpu_per_tick": cpu, "rss": _rss(), "port": _serve(registry), "gpu_processes": procs}


def worker_nvitop(spec: dict, site: str, ticks: int, warm: int) -> dict:
    from exporter.clock import FixedClock
    from exporter.sim import fake_nvml
    from exporter.sim.scenario import from_dict

    clock = FixedClock(float(int(time.time()) // 60 * 60), at=600.0)
    fake_nvml.configure(from_dict(spec), clock)
    sys.modules["pynvml"] = fake_nvml  # before nvitop is imported: it binds pynvml at import
    # nvitop checks pynvml's functions at import and says the simulator's module is "corrupted"
    # where it lacks one (NVLink, temperature...), and logs each missing one once with a
    # traceback: true of the simulator, not of the run, so not printed over the table. Its
    # logger takes its level from LOGLEVEL when it is imported.
    os.environ["LOGLEVEL"] = "CRITICAL"
    sys.path.append(site)
    from nvitop import Device
    from nvitop_exporter.exporter import PrometheusExporter
    from prometheus_client import CollectorRegistry

    devices = Device.from_indices(range(Device.count()))
    registry = CollectorRegistry()
    exporter = PrometheusExporter(devices, hostname="bench", registry=registry, interval=INTERVAL)
    cpu = []
    for i in range(ticks + warm):
        clock.advance(INTERVAL)
        c0 = time.process_time()
        exporter.update_host()
        for d in devices:
            exporter.update_device(d)
        if i >= warm:
            cpu.append(time.process_time() - c0)
    procs = sum(len(v) for v in exporter.alive_pids.values())
    return {"cpu_per_tick": cpu, "rss": _rss(), "port": _serve(registry), "gpu_processes": procs}


def worker_main(kind: str, spec_file: str, endpoints: list[str], site: str, ticks: int, warm: int) -> None:
    spec = json.loads(Path(spec_file).read_text())
    result = (worker_nvitop(spec, site, ticks, warm) if kind == "nvitop"
              else worker_ours(spec, endpoints, ticks, warm, by_name=kind != "ours-whole",
                               working=kind == "ours-working"))
    print(json.dumps(result), flush=True)
    sys.stdin.read()  # serve /metrics until the parent closes stdin


# -- the parent: spawn processes and servers, run workers, scrape, report ---------------------------
def server_main(index: int, page: str | None) -> None:
    """One vLLM server, in its own process as a real one is: it serves /metrics, and its child
    (an idle `sleep`) is its engine, the GPU process. Prints the engine's PID, reads the
    scenario's path (once every engine's PID is in it), prints its URL, serves until stdin closes."""
    from pageserver import page_server  # beside this script

    from exporter.clock import VirtualClock
    from exporter.sim.fake_vllm import FakeVllmServer
    from exporter.sim.scenario import from_dict

    engine = subprocess.Popen(["sleep", "36000"])
    try:
        print(engine.pid, flush=True)
        spec_file = sys.stdin.readline().strip()
        with contextlib.ExitStack() as stack:
            if page:
                url = stack.enter_context(page_server(page))
            else:
                scenario = from_dict(json.loads(Path(spec_file).read_text()))
                url = stack.enter_context(FakeVllmServer(scenario, VirtualClock(speed=1.0), server_index=index)).url
            print(url, flush=True)
            sys.stdin.read()
    finally:
        engine.kill()
        engine.wait()


@contextlib.contextmanager
def host_processes(gpus: int, per_gpu: int, page: str | None, spec_file: str):
    """The host's GPU processes, real and idle: 4 vLLM servers' engines (each the child of its
    server's process, so the exporter ties each endpoint to its own engine) and unrelated ones
    (children of this process, which serves nothing). Writes the scenario to `spec_file`;
    yields the 4 endpoints' URLs."""
    servers = [subprocess.Popen([sys.executable, __file__, "--serve", str(i), *(["--vllm-page", page] if page else [])],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for i in range(VLLM_ENDPOINTS)]
    others: list[subprocess.Popen] = []
    try:
        engines = [int(s.stdout.readline()) for s in servers]
        others = [subprocess.Popen(["sleep", "36000"]) for _ in range(gpus * per_gpu - VLLM_ENDPOINTS)]
        pids, spare = [0] * (gpus * per_gpu), iter(p.pid for p in others)
        for engine, i in zip(engines, server_positions(gpus, per_gpu), strict=True):
            pids[i] = engine
        pids = [pid or next(spare) for pid in pids]
        Path(spec_file).write_text(json.dumps(scenario_dict(gpus, per_gpu, pids)))
        for s in servers:
            s.stdin.write(spec_file + "\n")
            s.stdin.flush()
        yield [s.stdout.readline().strip() for s in servers]
    finally:
        for s in servers:
            with contextlib.suppress(OSError):
                s.stdin.close()
        for p in others:
            p.kill()
        for p in (*servers, *others):
            p.wait(timeout=30)


def scrape_latencies(port: int, n: int) -> tuple[list[float], int]:
    url = f"http://127.0.0.1:{port}/metrics"
    times, size = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=30) as r:
            size = len(r.read())
        times.append(time.perf_counter() - t0)
    return times, size


def merged(before: dict | None, result: dict) -> dict:
    """A worker's result with the ticks and scrapes of its earlier rounds; RSS, the largest."""
    if before is None:
        return result
    return {**result, "cpu_per_tick": before["cpu_per_tick"] + result["cpu_per_tick"],
            "scrape": before["scrape"] + result["scrape"], "rss": max(before["rss"], result["rss"])}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_worker(kind, spec_file, endpoints, site, ticks, warm, scrapes) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--spec", spec_file, "--site", site,
           "--ticks", str(ticks), "--warm-ticks", str(warm), *(arg for e in endpoints for arg in ("--endpoint", e))]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{kind} worker failed (exit {proc.wait()})")
        result = json.loads(line)
        result["scrape"], result["bytes"] = scrape_latencies(result["port"], scrapes)
        return result
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--procs", type=int, nargs="+", default=[16, 64, 256], help="processes per GPU")
    ap.add_argument("--ticks", type=int, default=12)
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--warm-ticks", type=int, default=3, help="untimed ticks first (720: an hour of history)")
    ap.add_argument("--rounds", type=int, default=1, help="run the workers in turn this many times, ticks pooled")
    ap.add_argument("--vllm-page", help="serve this page (a real one) from the 4 vLLM endpoints, not the simulator's")
    default_site = next(iter(sorted(glob.glob("/tmp/nvitop-venv/lib/python3*/site-packages"))), "")
    ap.add_argument("--nvitop-site", default=default_site, help="site-packages holding nvitop-exporter")
    ap.add_argument("--whole-pages", action="store_true",
                    help="also run ours reading the vLLM pages whole (vllm.endpoints[].by_name false)")
    ap.add_argument("--working", action="store_true",
                    help="also run ours reading every page every tick, as while the servers work")
    ap.add_argument("--worker", choices=["ours", "ours-whole", "ours-working", "nvitop"], help=argparse.SUPPRESS)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--site", default="", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ticks % WINDOW_TICKS:
        ap.error(f"--ticks must be a multiple of {WINDOW_TICKS} (CPU is summarised over {WINDOW_TICKS}-tick windows)")
    if args.worker:
        worker_main(args.worker, args.spec, args.endpoint, args.site, args.ticks, args.warm_ticks)
        return 0
    if args.serve is not None:
        server_main(args.serve, args.vllm_page)
        return 0

    import tempfile

    have_nvitop = bool(args.nvitop_site) and os.path.isdir(os.path.join(args.nvitop_site, "nvitop_exporter"))
    if not have_nvitop:
        print(f"nvitop-exporter not found under {args.nvitop_site!r}: measuring ours only", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for gpus in args.gpus:
            for per_gpu in args.procs:
                spec_file = os.path.join(tmp, f"{gpus}x{per_gpu}.json")
                # Exactly the host's GPU processes exist: the cost of walking /proc grows with them.
                with host_processes(gpus, per_gpu, args.vllm_page, spec_file) as urls:
                    workers = {"ours": ("ours", urls, ""), "ours, no vLLM": ("ours", [], "")}
                    if args.whole_pages:
                        workers["ours, whole pages"] = ("ours-whole", urls, "")
                    if args.working:
                        workers["ours, servers working"] = ("ours-working", urls, "")
                    if have_nvitop:
                        workers["nvitop"] = ("nvitop", [], args.nvitop_site)
                    row = {"gpus": gpus, "procs": per_gpu}
                    for _ in range(args.rounds):  # in turn: a change in the machine's load hits all alike
                        for name, (kind, endpoints, site) in workers.items():
                            result = run_worker(kind, spec_file, endpoints, site, args.ticks, args.warm_ticks,
                                                args.scrapes)
                            row[name] = merged(row.get(name), result)
                rows.append(row)
                print(f"  {gpus} GPUs x {per_gpu} processes done", file=sys.stderr)
    print_table(rows, have_nvitop, args.whole_pages, args.working)
    return 0


def summarise(r: dict) -> dict:
    # An idle server's page is read one tick in six (every 30 s): the median of single ticks
    # would be a tick that reads nothing. The median of 6-tick windows' means counts the reads.
    per_tick = r["cpu_per_tick"]
    tick = statistics.median(statistics.fmean(per_tick[i:i + WINDOW_TICKS])
                             for i in range(0, len(per_tick) - WINDOW_TICKS + 1, WINDOW_TICKS))
    return {"cpu_s_per_h": tick * TICKS_PER_HOUR, "core_pct": 100 * tick / INTERVAL, "rss_mib": r["rss"] / 2**20,
            "p50_ms": 1000 * statistics.median(r["scrape"]), "p99_ms": 1000 * pct(r["scrape"], 0.99),
            "kib": r["bytes"] / 1024, "seen": r["gpu_processes"]}


def print_table(rows: list[dict], have_nvitop: bool, whole_pages: bool = False, working: bool = False) -> None:
    head = ("| GPUs | procs/GPU | exporter | CPU s/h | % of a core | RSS MiB | scrape p50 ms | scrape p99 ms "
            "| /metrics KiB | GPU procs seen |")
    print(head)
    print("|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|")
    for row in rows:
        kinds = ("ours", *(("ours, whole pages",) if whole_pages else ()),
                 *(("ours, servers working",) if working else ()), "ours, no vLLM",
                 *(("nvitop",) if have_nvitop else ()))
        for kind in kinds:
            s = summarise(row[kind])
            print(f"| {row['gpus']} | {row['procs']} | {kind} | {s['cpu_s_per_h']:.1f} | {s['core_pct']:.2f} "
                  f"| {s['rss_mib']:.0f} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['kib']:.0f} | {s['seen']} |")
    if have_nvitop:
        print()
        print("| GPUs | procs/GPU | CPU ours/nvitop |" + (" CPU ours, servers working/nvitop |" if working else "")
              + " CPU ours, no vLLM/nvitop | RSS ours/nvitop | scrape p50 ours/nvitop | scrape p99 ours/nvitop |")
        print("|---|---|---|---|---|---|---|" + ("---|" if working else ""))
        for row in rows:
            o, b, n = summarise(row["ours"]), summarise(row["ours, no vLLM"]), summarise(row["nvitop"])
            w = (f"| {summarise(row['ours, servers working'])['cpu_s_per_h'] / n['cpu_s_per_h']:.2f} "
                 if working else "")
            print(f"| {row['gpus']} | {row['procs']} | {o['cpu_s_per_h'] / n['cpu_s_per_h']:.2f} {w}"
                  f"| {b['cpu_s_per_h'] / n['cpu_s_per_h']:.2f} | {o['rss_mib'] / n['rss_mib']:.2f} "
                  f"| {o['p50_ms'] / n['p50_ms']:.2f} | {o['p99_ms'] / n['p99_ms']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
