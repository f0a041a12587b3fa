"""Cost of reading one vLLM /metrics page: parsing all of it against reading only what we use.

    python bench/vllm_parse.py [--repeats 300] [--engines 1]

The page is the simulator's, which carries what a real vLLM V1 page carries (vLLM's fourteen
request histograms with its own buckets, the API server's http_* families, Python's
collectors), with `--engines` data-parallel engines. Timed side by side in one run, medians of
`--repeats` rounds:
- the whole page through prometheus_client's parser (what a scraper that reads every family pays);
- `normalise()`, which hands the parser only the vllm: gauges and counters it reads;
- one whole scrape of the one-engine page over loopback (HTTP over a kept-alive connection,
  then `normalise()`), as CPU time of this process; the server runs in a child process;
- following a server log: the most one tick reads (READ_BUDGET_BYTES of request lines around
  vLLM 0.33's start-up lines, the rendered fixture) through LogFollower;
- a 7.6 MB page of valid text without vllm: series (#21 M6): parsed whole, as 350e227 did to
  say it holds none, against normalise(), which parses only its first 8 KiB.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SERVE = """
import sys, time
sys.path.insert(0, {repo!r})
from exporter.clock import FixedClock
from exporter.sim import scenario as sc
from exporter.sim.fake_vllm import FakeVllmServer
with FakeVllmServer(sc.load("steady"), FixedClock(time.time() - 3600, 3600)) as server:
    print(server.url, flush=True)
    sys.stdin.read()
"""


def page(engines: int) -> str:
    from exporter.clock import FixedClock
    from exporter.sim import scenario as sc
    from exporter.sim.fake_vllm import FakeVllmServer

    text = FakeVllmServer(sc.load("steady"), FixedClock(time.time() - 3600, 3600)).render().decode()
    if engines == 1:
        return text
    # Data parallelism: every engine-labelled series once per engine.
    lines = []
    for line in text.splitlines():
        lines.append(line)
        if 'engine="0"' in line:
            lines += [line.replace('engine="0"', f'engine="{i}"') for i in range(1, engines)]
    return "\n".join(lines) + "\n"


def follow_one_tick() -> None:
    import tempfile

    from exporter.sources.vllm_log import READ_BUDGET_BYTES, LogFollower

    start = (REPO / "tests" / "fixtures" / "vllm" / "v0_33_failed_then_restarted.log").read_bytes()
    request = b'(APIServer pid=1) INFO:     10.0.0.9:51234 - "POST /v1/chat/completions HTTP/1.1" 200 OK\n'
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        log.write(start + request * ((READ_BUDGET_BYTES - len(start)) // len(request)))
        log.flush()
        LogFollower(log.name).profile()


def timed(fn, repeats: int, clock=time.perf_counter) -> float:
    samples = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--engines", type=int, default=1)
    args = ap.parse_args()

    import requests
    from prometheus_client.parser import text_string_to_metric_families

    from exporter.sources.vllm import VllmEndpoint, _plain_session, prepare, scrape
    from exporter.sources.vllm_normalise import normalise

    text = page(args.engines)
    full = timed(lambda: list(text_string_to_metric_families(text)), args.repeats)
    ours = timed(lambda: normalise(text), args.repeats)

    server = subprocess.Popen([sys.executable, "-c", SERVE.format(repo=str(REPO))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        endpoint = VllmEndpoint(server.stdout.readline().strip())
        session: requests.Session = _plain_session()
        request = prepare(endpoint, session)  # built once per endpoint, as VllmSource does
        assert scrape(endpoint, session, request).up
        whole = timed(lambda: scrape(endpoint, session, request), args.repeats, clock=time.process_time)
    finally:
        server.stdin.close()
        server.wait(timeout=10)

    log_tick = timed(follow_one_tick, max(3, args.repeats // 30))

    # #21 M6: 7.6 MB of valid text without a vllm: series. 350e227 parsed all of it to say so.
    sys.path.insert(0, str(REPO / "tests"))
    from exporter.sources.vllm_normalise import ParseError
    from helpers.flood import other_exporters_page
    foreign = other_exporters_page().decode()

    def refused() -> None:
        try:
            normalise(foreign)
        except ParseError:
            pass
    foreign_whole = timed(lambda: list(text_string_to_metric_families(foreign)), 3)
    foreign_ours = timed(refused, max(3, args.repeats // 30))

    print(json.dumps({"lines": text.count("\n"), "kib": round(len(text) / 1024, 1)}))
    print("| step | median ms |")
    print("|---|---|")
    print(f"| whole page through prometheus_client's parser | {1000 * full:.2f} |")
    print(f"| normalise() (vllm: gauges and counters only) | {1000 * ours:.2f} |")
    print(f"| one scrape over loopback, CPU (HTTP + normalise) | {1000 * whole:.2f} |")
    print(f"| a server log's largest tick (4 MiB of log lines) | {1000 * log_tick:.2f} |")
    print(f"| 7.6 MB page without vllm: series, parsed whole (350e227) | {1000 * foreign_whole:.2f} |")
    print(f"| 7.6 MB page without vllm: series, normalise() | {1000 * foreign_ours:.2f} |")
    print(f"\nnormalise / whole-page parse: {ours / full:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
