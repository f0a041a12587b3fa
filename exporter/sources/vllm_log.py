"""vLLM's own start-up account of its memory, read from the server log.

At start-up vLLM loads the weights, profiles one forward pass, sizes the KV cache from what
is left of its budget and captures CUDA graphs, logging each figure. The wording changed
across releases (all of these are handled, each fragment matched on its own because
multi-line messages are sometimes split over lines):

  V0 <= 0.6.4  worker.py        "Loading model weights took 2.6419 GB"
                                "Memory profiling results: total_gpu_memory=7.92GiB initial_memory_usage=...
                                 peak_torch_memory=0.71GiB ... non_torch_memory=0.15GiB kv_cache_size=6.27GiB
                                 gpu_memory_utilization=0.90"
  V0 0.6.5-0.8 worker.py        "the current vLLM instance can use total_gpu_memory (79.25GiB) x
                                 gpu_memory_utilization (0.15) = 11.89GiB" / "model weights take 8.51GiB;
                                 non_torch_memory takes 0.26GiB; PyTorch activation peak memory takes 0.94GiB;
                                 the rest of the memory reserved for KV Cache is 2.18GiB."
               model_runner.py  "Model loading took 8.6253 GB and 7.67 seconds",
                                "Graph capturing finished in 13 secs, took 0.50 GiB"
  V1 0.8+      gpu_model_runner "Model loading took 14.9888 GiB [memory] and 13.2 seconds",
                                "Estimated CUDA graph memory: 0.45 GiB total",
                                "Graph capturing finished in 9 secs, took 0.93 GiB"
               gpu_worker.py    "Memory profiling takes 6.42 seconds. Total non KV cache memory: 17.73GiB;
                                 torch peak memory increase: 1.87GiB; non-torch forward increase memory:
                                 0.25GiB; weights memory: 14.99GiB." / "Available KV cache memory: 55.05 GiB"
               kv_cache_utils   "GPU KV cache size: 450,816 tokens"

vLLM prints "GB" in its older lines but divides by 2**30, so GB there means GiB.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, fields
from typing import Iterable

from ..boundedio import read_head

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
MAX_LINE_CHARS = 4096
MAX_LINES = 200_000

_UNITS = {"gib": 2 ** 30, "gb": 2 ** 30, "mib": 2 ** 20, "mb": 2 ** 20, "kib": 2 ** 10, "kb": 2 ** 10}
_SIZE = r"(-?\d+(?:\.\d+)?)\s*(GiB|GB|MiB|MB|KiB|KB)"


@dataclass(frozen=True)
class MemoryProfile:
    """Per-GPU start-up figures (the first worker's, with tensor parallelism); None = not logged."""

    weights_bytes: int | None = None
    kv_cache_bytes: int | None = None  # negative when vLLM found no room: it then fails to start
    activation_peak_bytes: int | None = None
    non_torch_bytes: int | None = None
    cuda_graph_bytes: int | None = None
    total_gpu_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    non_kv_cache_bytes: int | None = None
    kv_cache_tokens: int | None = None
    num_gpu_blocks: int | None = None
    error: str = ""  # why the log could not be read

    def components(self) -> dict[str, int]:
        """The `component` values of gpumem_vllm_memory_profile_bytes that are known."""
        named = {"weights": self.weights_bytes, "kv_cache": self.kv_cache_bytes,
                 "activation_peak": self.activation_peak_bytes, "non_torch": self.non_torch_bytes,
                 "cuda_graph": self.cuda_graph_bytes}
        return {k: v for k, v in named.items() if v is not None}

    @property
    def empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self) if f.name != "error")


# (field, regex, priority): a higher priority replaces a lower one (a measured CUDA graph size
# beats an estimate); at equal priority the first line wins, which with tensor parallelism
# is the first worker's report.
_SIZE_RULES: tuple[tuple[str, re.Pattern, int], ...] = tuple(
    (field, re.compile(pattern, re.IGNORECASE), priority) for field, pattern, priority in (
        ("weights_bytes", r"Loading model weights took " + _SIZE, 1),
        ("weights_bytes", r"Model loading took " + _SIZE, 1),
        ("weights_bytes", r"model weights take " + _SIZE, 2),
        ("weights_bytes", r"weights memory: " + _SIZE, 2),
        ("non_torch_bytes", r"non_torch_memory takes " + _SIZE, 1),
        ("non_torch_bytes", r"\bnon_torch_memory=" + _SIZE, 1),
        ("non_torch_bytes", r"non-torch forward increase memory: " + _SIZE, 1),
        ("activation_peak_bytes", r"PyTorch activation peak memory takes " + _SIZE, 1),
        ("activation_peak_bytes", r"torch peak memory increase: " + _SIZE, 1),
        ("kv_cache_bytes", r"the rest of the memory reserved for KV Cache is " + _SIZE, 1),
        ("kv_cache_bytes", r"\bkv_cache_size=" + _SIZE, 1),
        ("kv_cache_bytes", r"Available KV cache memory: " + _SIZE, 1),
        ("cuda_graph_bytes", r"Estimated CUDA graph memory: " + _SIZE, 1),
        ("cuda_graph_bytes", r"Graph capturing finished in \d+(?:\.\d+)? secs?, took " + _SIZE, 2),
        ("cuda_graph_bytes", r"CUDA graph pool memory: " + _SIZE + r" \(actual\)", 2),
        ("total_gpu_bytes", r"total_gpu_memory \(" + _SIZE + r"\)", 1),
        ("total_gpu_bytes", r"\btotal_gpu_memory=" + _SIZE, 1),
        ("non_kv_cache_bytes", r"Total non KV cache memory: " + _SIZE, 1),
    )
)
_UTILIZATION = (re.compile(r"gpu_memory_utilization \((\d+(?:\.\d+)?)\)"),
                re.compile(r"\bgpu_memory_utilization=(\d+(?:\.\d+)?)"))
# 0.6.4's peak_torch_memory includes the weights; the activation peak is the difference.
_PEAK_TORCH = re.compile(r"\bpeak_torch_memory=" + _SIZE)
_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_GPU_BLOCKS = re.compile(r"# (?:GPU|CUDA) blocks: (\d+)", re.IGNORECASE)


def parse_profile(lines: Iterable[str]) -> MemoryProfile:
    found: dict[str, tuple[int, float | int]] = {}
    peak_torch: int | None = None
    for count, line in enumerate(lines):
        if count >= MAX_LINES:
            break
        line = line[:MAX_LINE_CHARS]
        for field, pattern, priority in _SIZE_RULES:
            match = pattern.search(line)
            if match:
                _keep(found, field, priority, _bytes(match.group(1), match.group(2)))
        for pattern in _UTILIZATION:
            match = pattern.search(line)
            if match:
                _keep(found, "gpu_memory_utilization", 1, float(match.group(1)))
        if peak_torch is None and (match := _PEAK_TORCH.search(line)):
            peak_torch = _bytes(match.group(1), match.group(2))
        if match := _KV_TOKENS.search(line):
            _keep(found, "kv_cache_tokens", 1, int(match.group(1).replace(",", "")))
        if match := _GPU_BLOCKS.search(line):
            _keep(found, "num_gpu_blocks", 1, int(match.group(1)))
    values = {field: value for field, (_, value) in found.items()}
    weights = values.get("weights_bytes")
    if "activation_peak_bytes" not in values and peak_torch is not None and weights is not None:
        values["activation_peak_bytes"] = max(0, peak_torch - weights)
    return MemoryProfile(**values)


def read_profile(path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> MemoryProfile:
    """Parse the head of a vLLM log (the profile is logged at start-up). Never raises: an
    unreadable file gives an empty profile with `error` saying why."""
    try:
        head, _ = read_head(path, max_bytes)  # never blocks: a FIFO here must not hang sampling
    except OSError as exc:
        return MemoryProfile(error=f"cannot read {path}: {exc.strerror or exc}")
    text = head.decode("utf-8", errors="replace").replace("\x00", "")
    return parse_profile(text.splitlines())


def _keep(found: dict, field: str, priority: int, value: float | int) -> None:
    old = found.get(field)
    if old is None or priority > old[0]:
        found[field] = (priority, value)


def _bytes(number: str, unit: str) -> int:
    return round(float(number) * _UNITS[unit.lower()])


class ProfileCache:
    """Attaches each server's start-up memory profile to its samples, re-reading a log only
    when it changed (size or mtime), never on every tick."""

    def __init__(self, log_files: dict[str, str]):
        self.log_files = log_files  # endpoint label -> log path
        self._cache: dict[str, tuple[tuple, tuple]] = {}

    def _profile(self, path: str) -> tuple[tuple[str, int], ...]:
        try:
            st = os.stat(path)
            key = (st.st_size, st.st_mtime_ns, st.st_ino)
        except OSError:
            return ()
        cached = self._cache.get(path)
        if cached is None or cached[0] != key:
            cached = (key, tuple(sorted(read_profile(path).components().items())))
            self._cache[path] = cached
        return cached[1]

    def attach(self, samples):
        return tuple(dataclasses.replace(s, memory_profile=self._profile(self.log_files[s.endpoint]))
                     if s.endpoint in self.log_files else s for s in samples)
