"""What `analyze` costs at its input limits: time and peak memory (RSS) of reading a trace and
replaying it, and of `analyze --prometheus` against a server that answers as much as it may.

    python bench/trace_cost.py [--rows 100000 500000 1000000] [--shape 8x8] [--ticks-only 100000]
                               [--prom-mib 15 60] [--repeats 1] [--code DIR ...] [--max-rss-gib 8]

Cases, each run in a fresh worker process (its peak RSS is the process's own, VmHWM; times are
the worker's CPU time, since the machines these run on are shared):
  csv ROWS     a trace CSV of ROWS rows shaped like a busy host (SHAPE = GPUs x processes per
               GPU, one GPU-level row per GPU per tick, 5 s apart): load_traces, then the replay
               through the detectors (analyze's JSON output, no report);
  ticks N      N ticks of one GPU with one process (2 rows a tick): the replay's cost per tick,
               the shape where the row limit alone does not bound the time;
  prom MIB     `analyze --prometheus` against a loopback server that answers every range query
               (the 12 series analyze asks for) with MIB MiB of valid process-memory points.
The figure for a case that an input limit refuses is the cost of refusing it (the outcome
column says which).

With `--code DIR ...` every case runs once per tree (its `exporter` package on the path), so
an older tree compares with this one in the same run (`git worktree add /tmp/base <commit>`
then `--code /tmp/base .`). `--max-rss-gib` caps each worker's address space, so an old tree's
blow-up ends as a MemoryError instead of taking the machine. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_732_280_400
GiB = 1 << 30


def write_csv_trace(path: Path, rows: int, gpus: int, procs: int) -> int:
    """A five-column-plus trace of about `rows` rows; returns the number of ticks."""
    per_tick = gpus * (procs + 1)
    ticks = max(1, rows // per_tick)
    with open(path, "w", encoding="utf-8") as out:
        out.write("timestamp,gpu,pid,process,used_bytes,total_bytes,role\n")
        for k in range(ticks):
            ts = T0 + 5 * k
            for g in range(gpus):
                lines, used = [], 0
                for p in range(procs):
                    u = GiB + ((k * 7919 + p * 104729) % (1 << 24))  # deterministic wobble
                    used += u
                    lines.append(f"{ts},{g},{10000 + g * 100 + p},python3,{u},85899345920,"
                                 f"{'vllm' if p == 0 else 'other'}\n")
                out.write(f"{ts},{g},,,{used},85899345920,\n")
                out.writelines(lines)
    return ticks


def prometheus_body(mib: float) -> bytes:
    """A range-query answer of about `mib` MiB: process-memory series of 10,000 points each."""
    series, size, s = [], 0, 0
    while size < mib * (1 << 20):
        values = [[T0 + 15 * i, str(GiB + i)] for i in range(10_000)]
        item = {"metric": {"__name__": "gpumem_process_memory_used_bytes", "gpu": str(s % 8),
                           "pid": str(1000 + s), "process": "python3", "role": "other"},
                "values": values}
        text = json.dumps(item)
        size += len(text)
        series.append(text)
        s += 1
    return ('{"status":"success","data":{"resultType":"matrix","result":['
            + ",".join(series) + "]}}").encode()


def serve(body: bytes) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            try:
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # analyze stopped reading at its cap

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


# ---------------------------------------------------------------- worker (one case, one tree)

def worker(case: dict[str, object]) -> dict[str, object]:
    if case.get("max_rss_gib"):
        limit = int(float(str(case["max_rss_gib"])) * GiB)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from exporter.postmortem.analyze import analyze_snapshots
    from exporter.postmortem.trace import TraceError, load_traces

    out: dict[str, object] = {}
    t0 = time.process_time()  # CPU time: these machines are shared, wall time is not comparable
    try:
        if case["kind"] == "prom":
            from exporter.postmortem.promquery import fetch

            snaps = fetch(str(case["url"]), T0, T0 + 15 * 9_999, step=15.0)
        else:
            snaps = load_traces([str(case["path"])]).snapshots
        out["load_s"] = time.process_time() - t0
        out["snapshots"] = len(snaps)
        t1 = time.process_time()
        analyze_snapshots(snaps, "json")
        out["replay_s"] = time.process_time() - t1
        out["outcome"] = "analyzed"
    except TraceError as exc:
        out["load_s"] = time.process_time() - t0
        out["outcome"] = "refused: " + str(exc).split(": ")[-1][:70]
    except MemoryError:
        out["load_s"] = time.process_time() - t0
        out["outcome"] = f"MemoryError (over --max-rss-gib {case['max_rss_gib']})"
    out["rss_mib"] = peak_rss_mib()
    return out


def peak_rss_mib() -> float:
    """This process's own peak RSS (VmHWM). Not ru_maxrss: Linux carries that over from the
    parent across fork and exec, so a worker would report at least the bench's own size."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_case(tree: Path, case: dict[str, object]) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(case)], env=env,
                          capture_output=True, text=True, cwd=tree)
    if proc.returncode != 0:
        return {"outcome": "crashed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:80]}
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _num(result: dict[str, object], key: str) -> str:
    value = result.get(key)
    return f"{value:.1f}" if isinstance(value, float) else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="*", default=[100_000, 500_000, 1_000_000])
    ap.add_argument("--shape", default="8x8", help="GPUs x processes per GPU for the csv cases")
    ap.add_argument("--ticks-only", type=int, nargs="*", default=[20_000])
    ap.add_argument("--prom-mib", type=float, nargs="*", default=[15.0, 60.0])
    ap.add_argument("--code", nargs="*", default=[str(ROOT)])
    ap.add_argument("--max-rss-gib", type=float, default=8.0)
    ap.add_argument("--worker")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    gpus, procs = (int(x) for x in args.shape.split("x"))
    trees = [Path(c).resolve() for c in args.code]
    print("| case | tree | outcome | snapshots | load, CPU s | replay, CPU s | peak RSS MiB |")
    print("|---|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        cases: list[tuple[str, dict[str, object]]] = []
        for rows in args.rows:
            path = Path(tmp) / f"rows{rows}.csv"
            ticks = write_csv_trace(path, rows, gpus, procs)
            cases.append((f"csv {rows:,} rows ({args.shape}, {ticks:,} ticks)", {"kind": "csv", "path": str(path)}))
        for ticks in args.ticks_only:
            path = Path(tmp) / f"ticks{ticks}.csv"
            write_csv_trace(path, 2 * ticks, 1, 1)
            cases.append((f"csv {ticks:,} ticks (1x1)", {"kind": "csv", "path": str(path)}))
        servers = []
        for mib in args.prom_mib:
            server, url = serve(prometheus_body(mib))
            servers.append(server)
            cases.append((f"prometheus {mib:g} MiB per answer", {"kind": "prom", "url": url}))
        for name, case in cases:
            for tree in trees:
                r = run_case(tree, {**case, "max_rss_gib": args.max_rss_gib})
                print(f"| {name} | {tree.name} | {r.get('outcome')} | {r.get('snapshots', '')} | "
                      f"{_num(r, 'load_s')} | {_num(r, 'replay_s')} | {_num(r, 'rss_mib')} |", flush=True)
        for server in servers:
            server.shutdown()


if __name__ == "__main__":
    main()
