"""Cost of the allocator probe inside a serving process, and of reading its files in the exporter.

    python bench/probe_cost.py [--repeats 2000] [--ticks 200] [--gpus 8] [--procs 64]

1. The probe: one read and write (`Probe.poll`: memory_stats per device, the JSON, the atomic
   write) against the stand-in torch.cuda of the tests, for 1 and 8 devices; median µs and the
   share of one core at the default 5 s interval. Real torch's memory_stats() is a C++ call that
   builds a similar dict; the stand-in is pure Python, so this errs on the high side.
2. The exporter: one `AllocatorSource.collect` over GPUS x 2 processes (a typical host: one or
   two serving processes per GPU) and GPUS x PROCS processes (the stress case), each with its
   own probe file, against the same processes with no probe files (the directory listing alone).
Medians of CPU time (this thread's) from one run, side by side; compare ratios across machines,
not absolute figures. The whole tick with probe files (sources and analysis, which keeps and reads
five series per probed process) is bench/probe_tick.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import types
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "probe"))

from gpumem_probe.probe import Probe, initialised_cuda  # noqa: E402

from exporter.model import GpuSample, ProcessSample, Snapshot  # noqa: E402
from exporter.sources.allocator import AllocatorSource  # noqa: E402

STANDIN_CUDA = ROOT / "tests" / "fixtures" / "probe" / "standin_torch" / "torch" / "cuda.py"
GiB = 1 << 30
NS = 4026532000


def median_us(fn, repeats: int) -> float:
    """Median CPU time of this thread per call: on a shared, oversubscribed machine the wall
    time of a 10 ms call also counts the other processes' time slices."""
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e6


def standin_cuda(devices: int):
    spec = importlib.util.spec_from_file_location(f"standin_cuda_{devices}", STANDIN_CUDA)
    cuda = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cuda)
    cuda.reset(devices=devices, initialised=True)
    for d in range(devices):
        cuda.set_stats(d, allocated=60 * GiB, reserved=70 * GiB, active=61 * GiB, inactive_split=GiB,
                       alloc_retries=3, device_allocs=900, device_frees=20)
    return cuda


def probe_cost(repeats: int) -> list[tuple[str, float]]:
    rows = []
    for devices in (1, 8):
        cuda = standin_cuda(devices)
        modules = {"torch": types.SimpleNamespace(cuda=cuda, __version__="2.6.0")}
        with tempfile.TemporaryDirectory() as directory:
            probe = Probe(directory, 5.0, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                          cuda=partial(initialised_cuda, modules), modules=modules)
            probe.poll()  # first write: identity, file, sweep
            rows.append((f"probe read + write, {devices} device(s)", median_us(probe.poll, repeats)))
            rows.append((f"probe read only, {devices} device(s)", median_us(partial(probe.document, cuda), repeats)))
            probe.close()
    return rows


def exporter_cost(gpus: int, procs: int, ticks: int) -> list[tuple[str, float]]:
    now = time.time()
    samples = []
    for g in range(gpus):
        uuid = f"a1000000-0000-0000-0000-{g:012x}"
        processes = tuple(ProcessSample(pid=100_000 + g * procs + i, used_bytes=10 * GiB, start_time=now - 3600,
                                        ns_pid=10 + g * procs + i) for i in range(procs))
        samples.append((uuid, GpuSample(index=str(g), uuid="GPU-" + uuid, processes=processes)))
    gpu_samples = tuple(s for _, s in samples)
    snapshot = Snapshot(now, gpus=gpu_samples)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        source = AllocatorSource(directory, pid_namespace=lambda pid: NS)
        rows.append((f"exporter tick, {gpus} GPUs x {procs} processes, no probe files",
                     median_us(lambda: source.collect(snapshot), ticks)))
        for uuid, gpu in samples:
            for p in gpu.processes:
                doc = {"schema": 1, "probe_version": "0.1.0", "pid": p.ns_pid, "pid_ns": NS, "start_ticks": 1,
                       "start_time": now - 3600, "written_at": now, "interval": 5.0, "seq": 1,
                       "torch_version": "2.6.0", "backend": "native",
                       "alloc_conf": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                       "errors": dict.fromkeys(("device_count", "memory_stats", "device_properties", "cumem",
                                                "write", "sweep", "internal"), 0),
                       "devices": [{"index": 0, "uuid": uuid,
                                    "allocated_bytes": 60 * GiB, "allocated_peak_bytes": 61 * GiB,
                                    "reserved_bytes": 70 * GiB, "reserved_peak_bytes": 71 * GiB,
                                    "active_bytes": 60 * GiB, "active_peak_bytes": 61 * GiB,
                                    "inactive_split_bytes": GiB, "inactive_split_peak_bytes": 2 * GiB,
                                    "alloc_retries": 3, "ooms": 0, "device_allocs": 900, "device_frees": 20,
                                    "cumem_bytes": None}]}
                Path(directory, f"gpumem-{NS}-{p.ns_pid}.json").write_text(json.dumps(doc, separators=(",", ":")))
        reading = source.collect(snapshot)
        attached = sum(p.allocator is not None for g in reading.snapshot.gpus for p in g.processes)
        assert attached == gpus * procs and not reading.errors, (attached, reading.errors[:3])
        rows.append((f"exporter tick, {gpus} GPUs x {procs} processes, {gpus * procs} probe files",
                     median_us(lambda: source.collect(snapshot), ticks)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--ticks", type=int, default=200)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--procs", type=int, default=64)
    args = ap.parse_args()
    print("| what | median CPU µs | share of one core at a 5 s interval |")
    print("|---|---:|---:|")
    rows = probe_cost(args.repeats) + exporter_cost(args.gpus, 2, args.ticks)  # a typical host
    rows += exporter_cost(args.gpus, args.procs, args.ticks)  # the stress case
    for what, us in rows:
        print(f"| {what} | {us:,.1f} | {us / 5e6:.5%} |")


if __name__ == "__main__":
    main()
