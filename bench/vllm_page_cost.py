"""Cost of reading one real vLLM /metrics page: vLLM 0.32.0's own page (about 620 lines, 50 KiB,
captured from a real server: tests/fixtures/vllm/v0_32_cpu_served.prom), read as the `vllm`
source reads it.

    python bench/vllm_page_cost.py [--repeats 400] [--baseline 21accee]

Timed side by side in one run, medians of `--repeats` rounds (CPU time of this process):
- the whole page through prometheus_client's parser (what a scraper that reads every family pays);
- `normalise()`: the page into the values the exporter exports;
- one scrape over loopback: HTTP GET over a kept-alive connection, then `normalise()` (the page
  served by pageserver.py in a child process, as uvicorn serves it and as late as a real server
  answers: the whole page, as vLLM 0.32 serves /metrics whatever `?name[]=` asks, its
  instrumentator's route being first);
- the same for the families read alone, as the source asks for them (`/metrics/?name[]=...`,
  prometheus_client's app mounted behind that route, answered sooner as a real server does);
- one tick of the `vllm` source with 4 such endpoints (scrapes run on its worker threads).
With `--baseline REF` the same steps run on that commit's code too (`git archive`, in a
subprocess), and the table shows both and their ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "tests" / "fixtures" / "vllm" / "v0_32_cpu_served.prom"
ENDPOINTS = 4


def timed(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        samples.append(time.process_time() - t0)
    return statistics.median(samples)


def measure(repeats: int, ports: list[int]) -> dict[str, float]:
    """The steps, on the `exporter` package first on sys.path."""
    from prometheus_client.parser import text_string_to_metric_families

    from exporter.model import Snapshot
    from exporter.sources.vllm import VllmEndpoint, VllmSource, _plain_session, prepare, scrape
    from exporter.sources.vllm_normalise import normalise

    text = PAGE.read_text().partition("\n")[2]
    out = {"whole page, prometheus_client": timed(lambda: list(text_string_to_metric_families(text)), repeats),
           "normalise()": timed(lambda: normalise(text), repeats)}
    endpoint = VllmEndpoint(f"http://127.0.0.1:{ports[0]}/metrics")
    session = _plain_session()
    request = prepare(endpoint, session)
    assert scrape(endpoint, session, request).up
    out["one scrape over loopback (HTTP + normalise)"] = timed(lambda: scrape(endpoint, session, request), repeats)
    try:
        from exporter.sources.vllm import only_read_url
    except ImportError:  # a baseline from before the source asked for its families by name
        pass
    else:
        by_name = prepare(endpoint, session, only_read_url(endpoint.metrics_url))
        assert scrape(endpoint, session, by_name).up
        out["one scrape of the families read (/metrics/?name[]=...)"] = timed(
            lambda: scrape(endpoint, session, by_name), repeats)
    source = VllmSource([VllmEndpoint(f"http://127.0.0.1:{p}/metrics", name=f"ep{i}") for i, p in enumerate(ports)])
    snapshot = Snapshot(timestamp=time.time())
    assert all(s.up for s in source.collect(snapshot).snapshot.vllm)
    out[f"a vllm source tick, {len(ports)} endpoints"] = timed(lambda: source.collect(snapshot), max(50, repeats // 4))
    source.close()
    return out


def baseline(ref: str, repeats: int, ports: list[int]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "exporter"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        code = (f"import json, sys; sys.path.insert(0, {tmp!r}); sys.path.insert(1, {str(REPO / 'bench')!r});"
                f"import vllm_page_cost as b; print(json.dumps(b.measure({repeats}, {ports!r})))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp)
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--baseline", help="a commit to measure beside the working tree")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    serve = [sys.executable, str(REPO / "bench" / "pageserver.py"), str(PAGE)]
    servers = [subprocess.Popen(serve, stdout=subprocess.PIPE, text=True) for _ in range(ENDPOINTS)]
    try:
        ports = [int(s.stdout.readline()) for s in servers]
        text = PAGE.read_text().partition("\n")[2]
        print(json.dumps({"page": PAGE.name, "lines": text.count("\n"), "kib": round(len(text) / 1024, 1),
                          "vllm_lines": sum(1 for line in text.splitlines() if line.startswith("vllm:"))}))
        rounds = []  # alternate, so a change in the machine's load hits both alike
        for _ in range(3):
            now = measure(args.repeats, ports)
            old = baseline(args.baseline, args.repeats, ports) if args.baseline else {}
            rounds.append((now, old))
    finally:
        for s in servers:
            s.kill()
            s.wait()
    steps = list(rounds[0][0])
    if args.baseline:
        print(f"| step (median CPU ms) | {args.baseline} | this tree | ratio |")
        print("|---|---|---|---|")
        for step in steps:
            new = statistics.median(r[0][step] for r in rounds)
            if step not in rounds[0][1]:
                print(f"| {step} | - | {1000 * new:.3f} | - |")
                continue
            old = statistics.median(r[1][step] for r in rounds)
            print(f"| {step} | {1000 * old:.3f} | {1000 * new:.3f} | {new / old:.2f} |")
    else:
        print("| step | median CPU ms |")
        print("|---|---|")
        for step in steps:
            print(f"| {step} | {1000 * statistics.median(r[0][step] for r in rounds):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
