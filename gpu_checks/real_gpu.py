"""Checks that need a real NVIDIA GPU (never run in CI; see gpu_checks/README.md).

    python gpu_checks/real_gpu.py nvml            # real NVML through the exporter's source
    python gpu_checks/real_gpu.py start           # leave a leaking PyTorch process and the daemon running
    python gpu_checks/real_gpu.py check [--expect-leak]   # what the daemon reports about them
    python gpu_checks/real_gpu.py stop            # end the leaker and the daemon `start` left running
    python gpu_checks/real_gpu.py probe           # the allocator probe's components, end to end
    python gpu_checks/real_gpu.py nvml-cost       # the NVML source's CPU per tick, real beside simulated

`start` detaches both processes (setsid) so they outlive the command; the leak detector needs
its settling period (10 min after the start-up allocation) plus its shortest window (8 min), so
run `check --expect-leak` about 20 minutes after `start`. Results go to $OUT (or /tmp/gpu-checks) as JSON.

`probe` (about half a minute) needs gpu-memory-probe installed (`pip install ./probe`): it starts
the daemon and three PyTorch processes that load the probe the way vLLM's plugin loader does
(entry point group vllm.general_plugins, GPUMEM_PROBE_DIR set), each growing one component on
purpose — live tensors (torch allocated), cudaMalloc through ctypes on libcudart (non-torch), and
a cache full of blocks too small for the next request under a memory cap (allocation retries) —
and reads each component's growth back from the exporter's /metrics and from the probe's file.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = Path(os.environ.get("OUT", "/tmp/gpu-checks"))
PORT = 9842
STATE = Path("/tmp/gpumem-gpu-check.json")

# Allocates 2 GiB at start (the "model"), then leaks 16 MiB every 2 s (480 MiB/min) for 30 min.
LEAKER = """
import time, torch
hold = [torch.empty(2 << 30, dtype=torch.uint8, device="cuda")]
print("ready", flush=True)
for _ in range(900):
    hold.append(torch.empty(16 << 20, dtype=torch.uint8, device="cuda"))
    time.sleep(2)
"""


def nvml() -> dict:
    import pynvml

    from exporter.model import Snapshot
    from exporter.sources.host import LocalHost, enrich
    from exporter.sources.nvml import NvmlSource

    host = LocalHost()
    reading = NvmlSource(pynvml, host.memory).collect(Snapshot(timestamp=time.time()))
    assert reading.up, reading.errors
    gpus = enrich(reading.snapshot.gpus, host)
    for g in gpus:
        assert g.up and g.total_bytes and g.used_bytes is not None, g
        parts = g.used_bytes + g.free_bytes + (g.reserved_bytes or 0)
        assert abs(parts - g.total_bytes) <= 0.01 * g.total_bytes, (g.index, parts, g.total_bytes)
    return {"driver": reading.snapshot.driver_version, "errors": [e.kind for e in reading.errors],
            "nvidia_smi_apps": _nvidia_smi_apps(),
            "gpus": [{"index": g.index, "name": g.name, "total": g.total_bytes, "used": g.used_bytes,
                      "free": g.free_bytes, "reserved": g.reserved_bytes, "unified": g.unified,
                      "processes": [(p.pid, p.name, p.used_bytes) for p in g.processes]} for g in gpus]}


def _nvidia_smi_apps() -> str:
    """nvidia-smi's own per-process view, to set beside what the source read through NVML."""
    try:
        return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv"],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi: {e}"


def start() -> dict:
    # Its stderr goes to a file: it outlives this command, and must not hold the caller's pipe open.
    with open("/tmp/gpumem-leaker.log", "w") as errors:
        leaker = subprocess.Popen([sys.executable, "-c", LEAKER], stdout=subprocess.PIPE, text=True,
                                  stderr=errors, start_new_session=True)
    assert leaker.stdout.readline().strip() == "ready", "the PyTorch leaker did not start"
    # The daemon outlives this command (it is checked by a later `check`), so its log stays open.
    with open("/tmp/gpumem-daemon.log", "w") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "exporter", "run", "--listen", f"127.0.0.1:{PORT}"],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    state = {"leaker_pid": leaker.pid, "daemon_pid": daemon.pid, "started": time.time()}
    STATE.write_text(json.dumps(state))
    return state


def stop() -> dict:
    """Ends what `start` started, so that a later step sees only its own processes."""
    state = json.loads(STATE.read_text())
    ended = {}
    for name in ("leaker_pid", "daemon_pid"):
        try:
            os.killpg(state[name], signal.SIGTERM)
            ended[name] = state[name]
        except ProcessLookupError:
            pass
    # Gone, not just told: the next step counts the GPU's processes. (Not our children: polled.)
    deadline = time.time() + 20
    while time.time() < deadline and any(_alive(pid) for pid in ended.values()):
        time.sleep(0.2)
    left = [pid for pid in ended.values() if _alive(pid)]
    for pid in left:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # gone since
    STATE.unlink()
    return {"ended": ended, "killed": left}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def check(expect_leak: bool, watch_seconds: float) -> dict:
    state = json.loads(STATE.read_text())
    pid = str(state["leaker_pid"])
    # The leaker's series as the daemon exports them, every 5 s while watching: the real NVML
    # readings the leak detector works on, and the growth rate it reports meanwhile.
    watched = []
    until = time.time() + watch_seconds
    while time.time() < until:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10) as r:
            text = r.read().decode()
        row: dict[str, float] = {"t": round(time.time() - state["started"], 1)}
        for line in text.splitlines():
            if f'pid="{pid}"' in line and line.startswith(("gpumem_process_memory_used_bytes{",
                                                           "gpumem_process_memory_growth_bytes_per_second{",
                                                           "gpumem_leak_suspected{")):
                series, value = line.rsplit(" ", 1)
                row[series] = float(value)
        watched.append(row)
        time.sleep(5)
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/api/findings", timeout=10) as r:
        findings = json.loads(r.read())["findings"]
    mine = [line for line in metrics.splitlines() if f'pid="{pid}"' in line]
    assert any(line.startswith("gpumem_process_memory_used_bytes") for line in mine), "leaker not exported"
    leaks = [f for f in findings if f["kind"] == "leak" and str(f["pid"]) == pid]
    if expect_leak:
        assert leaks, f"no leak finding for pid {pid} after {time.time() - state['started']:.0f} s"
    return {"elapsed_seconds": time.time() - state["started"], "leaker_series": mine, "watched": watched,
            "leak_findings": leaks, "all_findings": findings}


def nvml_cost(processes: int, ticks: int) -> dict:
    """CPU per tick of the NVML source on this GPU with `processes` PyTorch processes on it, beside
    the simulator's pynvml module serving the same GPU and PIDs (what bench/overhead.py measures
    with): whether the simulated ticks cost what real ones do."""
    import statistics

    import pynvml

    from exporter.clock import FixedClock
    from exporter.model import Snapshot
    from exporter.sim import fake_nvml
    from exporter.sim.scenario import from_dict
    from exporter.sources.host import LocalHost
    from exporter.sources.nvml import NvmlSource

    holders = [subprocess.Popen([sys.executable, "-c", "import sys, torch; x = torch.ones(1 << 30, "
                                 "dtype=torch.uint8, device='cuda'); print('ready', flush=True); sys.stdin.read()"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    try:
        for h in holders:
            assert h.stdout is not None and h.stdout.readline().strip() == "ready", "a PyTorch process did not start"
        clock = FixedClock(float(int(time.time())), at=600.0)
        pynvml.nvmlInit()  # the real GPU's name and size, for the simulated one
        try:
            gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(gpu)
            name = name.decode() if isinstance(name, bytes) else name
            mib = pynvml.nvmlDeviceGetMemoryInfo(gpu).total >> 20
        finally:
            pynvml.nvmlShutdown()
        fake_nvml.configure(from_dict({
            "name": "nvml-cost", "description": "the real GPU's processes", "duration": "1h",
            "gpus": [{"name": name, "memory": f"{mib}MiB", "reserved": "527MiB"}],
            "host": {"memory": "128GiB"},
            "processes": [{"pid": h.pid, "name": "python3", "gpu": 0, "memory": "1GiB"} for h in holders]}), clock)
        out = {}
        for name, module in (("real", pynvml), ("simulated", fake_nvml), ("real again", pynvml)):
            host = LocalHost()
            source = NvmlSource(module, host.memory)
            seen = len(source.collect(Snapshot(timestamp=time.time())).snapshot.gpus[0].processes)
            cpu = []
            for _ in range(ticks):
                time.sleep(0.05)  # a tick finds cold caches, as one every 5 s does
                clock.advance(5)
                c0 = time.process_time()
                source.collect(Snapshot(timestamp=time.time()))
                cpu.append(time.process_time() - c0)
            out[name] = {"processes_seen": seen, "median_cpu_ms": 1000 * statistics.median(cpu),
                         "p90_cpu_ms": 1000 * sorted(cpu)[int(0.9 * len(cpu))]}
        return out
    finally:
        for h in holders:
            h.kill()
            h.wait()


# -- the allocator probe, end to end -------------------------------------------------------------
MiB = 1 << 20
PROBE_SERIES = {"allocated": "gpumem_process_torch_allocated_bytes", "reserved": "gpumem_process_torch_reserved_bytes",
                "non_torch": "gpumem_process_non_torch_bytes", "retries": "gpumem_process_alloc_retries_total",
                "used": "gpumem_process_memory_used_bytes"}
# The fields of the probe's own file (docs/probe.md) that give the same numbers.
FILE_FIELDS = {"allocated": "allocated_bytes", "reserved": "reserved_bytes", "retries": "alloc_retries"}

# One PyTorch process. It loads the probe exactly as vLLM does (vllm/plugins/__init__.py:
# entry_points(group="vllm.general_plugins"), VLLM_PLUGINS as an allow-list, load() then call; vLLM
# may call it more than once per process, so this calls it twice), before CUDA is initialised;
# then initialises CUDA, prints "ready", waits for a line on stdin, grows one component on purpose,
# prints "done <json>" and holds its memory until stdin closes.
WORKER = r"""
import ctypes, ctypes.util, glob, json, os, sys, time
from importlib.metadata import entry_points

MODE, STEPS, STEP_BYTES, PAUSE = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
allowed = os.environ.get("VLLM_PLUGINS")
plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")
           if allowed is None or ep.name in allowed.split(",")}
assert "gpumem_probe" in plugins, f"gpumem_probe is not in vllm.general_plugins: {sorted(plugins)}"
for _ in range(2):
    for ep in plugins.values():
        ep.load()()

import torch
assert not torch.cuda.is_initialized()
torch.cuda.set_device(0)
base = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")  # CUDA is up, the fill kernel loaded
print("ready", flush=True)
sys.stdin.readline()
keep, result = [], {}

def cudart():
    here = os.path.dirname(torch.__file__)
    names = glob.glob(os.path.join(here, "lib", "libcudart*.so*"))
    try:
        import nvidia.cuda_runtime as rt
        names += [n for d in rt.__path__ for n in glob.glob(os.path.join(d, "lib", "libcudart.so*"))]
    except Exception:
        pass
    names += [n for n in (ctypes.util.find_library("cudart"),) if n]
    names += ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaMalloc.restype = ctypes.c_int
        result["libcudart"] = name
        return lib
    raise SystemExit(f"no libcudart among {names}")

if MODE == "tensor_leak":  # live tensors nobody frees: torch allocated grows
    for _ in range(STEPS):
        keep.append(torch.ones(STEP_BYTES, dtype=torch.uint8, device="cuda"))
        time.sleep(PAUSE)
elif MODE == "cudamalloc":  # memory PyTorch never sees: non-torch grows
    lib = cudart()
    for _ in range(STEPS):
        ptr = ctypes.c_void_p()
        rc = lib.cudaMalloc(ctypes.byref(ptr), STEP_BYTES)
        assert rc == 0, f"cudaMalloc returned {rc}"
        keep.append(ptr)  # never freed
        time.sleep(PAUSE)
elif MODE == "fragment":
    # Cap the allocator at 16.5 blocks. Each round fills the cache with 16 blocks, frees them (the
    # cache now holds 16 free blocks, none big enough for a double block), then asks for a double
    # block: a new segment would pass the cap, so the allocator frees its whole cache and calls
    # cudaMalloc again, which is one num_alloc_retries. Each round starts from an empty cache.
    del base
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((16 * STEP_BYTES + STEP_BYTES // 2) / total, 0)
    result["ooms"] = 0
    for _ in range(STEPS):
        blocks = [torch.empty(STEP_BYTES, dtype=torch.uint8, device="cuda") for _ in range(16)]
        del blocks
        try:
            big = torch.empty(2 * STEP_BYTES, dtype=torch.uint8, device="cuda")
            del big
        except torch.cuda.OutOfMemoryError:
            result["ooms"] += 1
        torch.cuda.empty_cache()
        time.sleep(PAUSE)
    base = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # keep the process on the GPU
torch.cuda.synchronize()
stats = torch.cuda.memory_stats(0)
result.update(torch=torch.__version__, allocated=stats.get("allocated_bytes.all.current"),
              reserved=stats.get("reserved_bytes.all.current"), retries=stats.get("num_alloc_retries"))
print("done " + json.dumps(result), flush=True)
sys.stdin.read()
"""

# What each worker must show, component by component, as growth between the readings before and
# after its work: "at least" a share of what it took on purpose, or "at most" a bound (noise).
EXPECT = {
    "tensor_leak": {"allocated": ("at least", 0.9), "non_torch": ("at most", 64 * MiB)},
    "cudamalloc": {"non_torch": ("at least", 0.9), "allocated": ("at most", 1 * MiB)},
    "fragment": {"retries": ("at least", 0.5)},
}


def _probe_readings(metrics_text: str, pids: dict[str, int]) -> dict[str, dict[str, float]]:
    """{worker: {component: value}} from the exporter's /metrics, for the workers' host PIDs."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {v: k for k, v in PROBE_SERIES.items()}
    by_pid = {str(pid): worker for worker, pid in pids.items()}
    out: dict[str, dict[str, float]] = {w: {} for w in pids}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            worker = by_pid.get(sample.labels.get("pid", ""))
            if worker and sample.name in names:
                out[worker][names[sample.name]] = out[worker].get(names[sample.name], 0.0) + sample.value
    return out


def _probe_files(directory: Path, pids: dict[str, int]) -> dict[str, dict[str, float]]:
    """The same numbers from the probe's own files (device 0), whatever the exporter makes of them."""
    out: dict[str, dict[str, float]] = {w: {} for w in pids}
    by_pid = {pid: worker for worker, pid in pids.items()}
    for path in directory.glob("gpumem-*.json"):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        worker = by_pid.get(doc.get("pid"))
        if worker and doc.get("devices"):
            device = doc["devices"][0]
            out[worker] = {k: device.get(f) for k, f in FILE_FIELDS.items()}
            out[worker]["errors"] = sum((doc.get("errors") or {}).values())
    return out


def probe(steps: int, step_mib: int, pause: float, port: int, daemon_args: list[str]) -> dict:
    import tempfile
    from importlib.metadata import entry_points

    if "gpumem_probe" not in {ep.name for ep in entry_points(group="vllm.general_plugins")}:
        raise SystemExit("gpu-memory-probe is not installed here: pip install ./probe")
    directory = Path(tempfile.mkdtemp(prefix="gpumem-probe-"))
    # The exporter reads the probes' directory from its configuration only (allocator.probe_dir);
    # GPUMEM_PROBE_DIR is the probes' side of the same setting.
    config = directory.parent / f"{directory.name}.yaml"
    config.write_text(json.dumps({"allocator": {"probe_dir": str(directory)}}))
    env = {**os.environ, "GPUMEM_PROBE_DIR": str(directory), "GPUMEM_PROBE_INTERVAL": "1"}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # the fragmenting pattern assumes the default allocator
    env.pop("PYTORCH_ALLOC_CONF", None)
    url = f"http://127.0.0.1:{port}"
    with open(OUT / "gpu-check-probe-daemon.log", "w") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "exporter", "run", "--listen", f"127.0.0.1:{port}",
                                   "--interval", "1", "--config", str(config), *daemon_args],
                                  stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        workers: dict[str, subprocess.Popen[str]] = {}
        step_bytes = step_mib * MiB
        try:
            for mode in EXPECT:
                workers[mode] = subprocess.Popen(
                    [sys.executable, "-c", WORKER, mode, str(steps), str(step_bytes), str(pause)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            for mode, w in workers.items():
                assert w.stdout is not None
                line = w.stdout.readline().strip()
                assert line == "ready", f"{mode} worker did not start: {line!r} (exit {w.poll()})"
            pids = {mode: w.pid for mode, w in workers.items()}

            def scrape() -> dict[str, dict[str, float]]:
                with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
                    return _probe_readings(r.read().decode(), pids)

            deadline = time.monotonic() + 90
            while True:  # the exporter must attribute a probe file to every worker before the work starts
                try:
                    before = scrape()
                    if all("allocated" in v for v in before.values()):
                        break
                except OSError:
                    before = {}
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise SystemExit(f"the exporter shows no probe series for {pids} after 90 s (exporter "
                                     f"exit {daemon.poll()}; series seen: {before}; probe files: "
                                     f"{_probe_files(directory, pids)}); see {log.name}")
                time.sleep(1)
            files_before = _probe_files(directory, pids)
            for w in workers.values():
                assert w.stdin is not None
                w.stdin.write("go\n")
                w.stdin.flush()
            own = {}
            for mode, w in workers.items():
                assert w.stdout is not None
                line = w.stdout.readline().strip()
                assert line.startswith("done "), f"{mode} worker failed: {line!r} (exit {w.poll()})"
                own[mode] = json.loads(line[5:])
            time.sleep(4)  # a probe interval, a sampling interval and some slack: the last step is visible
            after = scrape()
            files_after = _probe_files(directory, pids)
        finally:
            for w in workers.values():
                w.kill()
                w.wait()
            daemon.terminate()
            daemon.wait(timeout=20)

    taken = {"tensor_leak": steps * step_bytes, "cudamalloc": steps * step_bytes, "fragment": steps}
    rows, failures = [], []
    for mode, checks in EXPECT.items():
        for component in ("allocated", "reserved", "non_torch", "used", "retries"):
            b, a = before[mode].get(component), after[mode].get(component)
            grew = None if a is None or b is None else a - b
            fb, fa = files_before[mode].get(component), files_after[mode].get(component)
            file_grew = None if fa is None or fb is None else fa - fb
            verdict = ""
            if component in checks:
                how, amount = checks[component]
                bound = amount * taken[mode] if how == "at least" else amount
                ok = grew is not None and (grew >= bound if how == "at least" else abs(grew) <= bound)
                verdict = f"{'ok' if ok else 'FAIL'} ({how} {bound:,.0f})"
                if not ok:
                    failures.append(f"{mode}: {component} grew by {grew}, expected {how} {bound:,.0f}")
            rows.append({"worker": mode, "pid": pids[mode], "component": component, "before": b, "after": a,
                         "grew": grew, "probe_file_grew": file_grew, "check": verdict})
    return {"steps": steps, "step_bytes": step_bytes, "taken_on_purpose": taken, "rows": rows,
            "workers_own_view": own, "failures": failures, "ok": not failures}


def _print_probe(result: dict) -> None:
    def fmt(v: float | None, component: str) -> str:
        if v is None:
            return "-"
        return f"{v:,.0f}" if component == "retries" else f"{v / MiB:,.1f} MiB"

    print(f"{'worker':<12} {'pid':>7} {'component':<10} {'before':>14} {'after':>14} {'grew':>14} "
          f"{'probe file':>14}  check")
    for r in result["rows"]:
        c = r["component"]
        print(f"{r['worker']:<12} {r['pid']:>7} {c:<10} {fmt(r['before'], c):>14} {fmt(r['after'], c):>14} "
              f"{fmt(r['grew'], c):>14} {fmt(r['probe_file_grew'], c):>14}  {r['check']}")
    print("workers' own torch.cuda.memory_stats():", json.dumps(result["workers_own_view"]))
    print("RESULT:", "ok" if result["ok"] else "FAILED: " + "; ".join(result["failures"]))


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", choices=["nvml", "start", "check", "stop", "probe", "nvml-cost"], default="nvml")
    ap.add_argument("--expect-leak", action="store_true", help="check: fail without a leak finding")
    ap.add_argument("--watch", type=float, default=0, metavar="SECONDS",
                    help="check: first record the leaker's exported series every 5 s for this long")
    ap.add_argument("--steps", type=int, default=20, help="probe: growth steps (and fragmenting rounds) per worker")
    ap.add_argument("--step-mib", type=int, default=32, help="probe: MiB per step (the fragmenting block size)")
    ap.add_argument("--pause", type=float, default=1.0, help="probe: seconds between steps")
    ap.add_argument("--port", type=int, default=PORT + 1, help="probe: port of the exporter it starts")
    ap.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                    help="probe: extra argument for `gpu-memory-exporter run` (repeat); the daemon is "
                         "given a config file naming the probes' directory")
    args = ap.parse_args()
    if args.what in ("check", "stop") and not STATE.exists():
        ap.error(f"no {STATE}: run `start` first")
    what = args.what
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"nvml": nvml, "start": start, "check": lambda: check(args.expect_leak, args.watch), "stop": stop,
              "probe": lambda: probe(args.steps, args.step_mib, args.pause, args.port, args.daemon_arg),
              "nvml-cost": lambda: nvml_cost(4, 200)}[what]()
    (OUT / f"gpu-check-{what}.json").write_text(json.dumps(result, indent=1, default=str))
    if what == "probe":
        _print_probe(result)
        sys.exit(0 if result["ok"] else 1)
    print(json.dumps(result, indent=1, default=str)[:4000])


if __name__ == "__main__":
    main()
