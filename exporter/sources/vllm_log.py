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
  V1 0.11-0.33 gpu_worker.py    at INFO, once graphs are captured: "Free memory on device (78.68/79.19 GiB)
                                 on startup. Desired GPU memory utilization is (0.92, 72.85 GiB). Actual usage
                                 is 15.62 GiB for consumed memory (weights + non-torch), 2.32 GiB for peak
                                 activation, and 0.93 GiB for CUDAGraph memory. ... Current kv cache memory in
                                 use is 54.91 GiB." ("Memory profiling takes ..." is DEBUG only);
                                "CUDA graph pool memory: 0.93 GiB (actual), 0.45 GiB (estimated), ...";
                                with --kv-cache-memory instead: "Initial free memory 78.68 GiB, reserved 32.0
                                 GiB memory for KV Cache as specified by kv_cache_memory_bytes config ...";
                                sleep mode: "Sleep mode freed 70.25 GiB memory, 1.21 GiB memory is still in use."
               kv_cache_utils   "GPU KV cache size: 449,856 tokens, Maximum concurrency for 32,768 tokens per
                                 request: 13.73x"
  V1 CPU backend cpu_worker.py  "Explicitly set (0.03/10.96) GiB for KV cache on node 0." (an explicit
               (0.11-0.32)       --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE, of the memory node's
                                 total) or "Auto set (K/T) GiB for KV cache on node 0, with R GiB requested
                                 memory for the worker. C GiB memory was consumed by non-kv usages.";
                                 "CPU KV cache size: 32,768 tokens, ..." (its memory is host memory: the
                                 "GPU" figures below are the memory node's)
(tests/fixtures/vllm/v0_33_*.log are rendered by vLLM 0.33's own logger and statements;
v0_32_cpu_*.log are a real CPU server's.)

A log can hold several starts (a failed one, then the one that serves): every start line
("Initializing a V1 LLM engine", "vLLM API server version", ...) begins a new profile, so the
figures are always the latest start's and never mix with a failed one's.

In 0.21+ the summary's "peak activation" includes the CUDA graph estimate (vLLM budgets it
there); the activation figure kept here is the peak without it, so that weights, non-torch,
activation peak, CUDA graphs (measured) and KV cache add up to what the server holds.

vLLM prints "GB" in its older lines but divides by 2**30, so GB there means GiB.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable
from typing import Any

from ..boundedio import open_regular, read_head
from ..model import MemoryProfile, VllmSample
from ..units import bytes_in_message

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
READ_BUDGET_BYTES = 4 * 1024 * 1024  # what a followed log may add per tick (a first read catches up over ticks)
MAX_LINE_CHARS = 4096
MAX_LINES = 200_000

_NUM = r"(-?\d+(?:\.\d+)?)"
_SIZE = _NUM + r"\s*(GiB|GB|MiB|MB|KiB|KB)"

# (field, regex, priority): a higher priority replaces a lower one (a measured CUDA graph size
# beats an estimate); at equal priority the first line wins, which with tensor parallelism
# is the first worker's report.
_SIZE_RULES: tuple[tuple[str, re.Pattern[str], int], ...] = tuple(
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
        ("kv_cache_bytes", r"Current kv cache memory in use is " + _SIZE, 1),
        ("kv_cache_bytes", r"reserved " + _SIZE + r" memory for KV Cache as specified by kv_cache_memory_bytes", 1),
        ("kv_cache_memory_flag_bytes",
         r"reserved " + _SIZE + r" memory for KV Cache as specified by kv_cache_memory_bytes", 1),
        ("free_at_start_bytes", r"Initial free memory " + _SIZE + r", reserved", 1),
        ("free_at_start_bytes", r"Free memory on device (?:\S+ )?\(" + _NUM + r"/[\d.]+ (GiB)\) on startup", 1),
        ("total_gpu_bytes", r"Free memory on device (?:\S+ )?\([\d.]+/" + _SIZE + r"\) on startup", 1),
        ("requested_bytes", r"Desired GPU memory utilization is \([\d.]+, " + _SIZE + r"\)", 1),
        ("consumed_bytes", r"Actual usage is " + _SIZE + r" for consumed memory", 1),
        ("summary_peak_bytes", _SIZE + r" for peak activation", 1),
        ("cuda_graph_bytes", _SIZE + r" for CUDAGraph memory", 2),
        ("cuda_graph_bytes", r"Estimated CUDA graph memory: " + _SIZE, 1),
        ("cuda_graph_bytes", r"Graph capturing finished in \d+(?:\.\d+)? secs?, took " + _SIZE, 2),
        ("cuda_graph_bytes", r"CUDA graph pool memory: " + _SIZE + r" \(actual\)", 2),
        ("cuda_graph_estimate_bytes", r"Estimated CUDA graph memory: " + _SIZE, 1),
        ("cuda_graph_estimate_bytes", r"\(actual\), " + _SIZE + r" \(estimated\)", 1),
        ("total_gpu_bytes", r"total_gpu_memory \(" + _SIZE + r"\)", 1),
        ("total_gpu_bytes", r"\btotal_gpu_memory=" + _SIZE, 1),
        ("non_kv_cache_bytes", r"Total non KV cache memory: " + _SIZE, 1),
        # The CPU backend (format_gib: two decimals, so a size below 0.005 GiB reads 0.0 and is
        # kept only as a lower-priority figure; the page's kv_cache_memory_bytes is exact).
        ("kv_cache_bytes", r"(?:Explicitly|Auto) set \(" + _NUM + r"/[\d.]+\) (GiB) for KV cache on node", 1),
        ("kv_cache_memory_flag_bytes", r"Explicitly set \(" + _NUM + r"/[\d.]+\) (GiB) for KV cache on node", 1),
        ("total_gpu_bytes", r"(?:Explicitly|Auto) set \(-?[\d.]+/" + _NUM + r"\) (GiB) for KV cache on node", 1),
        ("requested_bytes", _SIZE + r" requested memory for the worker", 1),
        ("non_kv_cache_bytes", _SIZE + r" memory was consumed by non-kv usages", 1),
    )
)
# The CPU backend's sizes, printed with two decimals of GiB: a 0.0 is a size below 5 MiB.
_ZERO_IS_UNKNOWN = frozenset(pattern for _, pattern, _ in _SIZE_RULES if "for KV cache on node" in pattern.pattern)
_UTILIZATION = (re.compile(r"gpu_memory_utilization \((\d+(?:\.\d+)?)\)"),
                re.compile(r"\bgpu_memory_utilization=(\d+(?:\.\d+)?)"),
                re.compile(r"Desired GPU memory utilization is \((\d+(?:\.\d+)?),", re.IGNORECASE))
# 0.6.4's peak_torch_memory includes the weights; the activation peak is the difference.
_PEAK_TORCH = re.compile(r"\bpeak_torch_memory=" + _SIZE)
_KV_TOKENS = re.compile(r"\b(?:GPU|[A-Z]{2,5})(?: \+ host)? KV cache size: ([\d,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: (\d+(?:\.\d+)?)x")
_MAX_MODEL_LEN = re.compile(r"\bmax_seq_len=(\d+)")
_GPU_BLOCKS = re.compile(r"# (?:GPU|CUDA) blocks: (\d+)", re.IGNORECASE)
_SLEEP = re.compile(r"Sleep mode freed " + _SIZE + r" memory, " + _SIZE + r" memory is still in use")
# Without the estimate in the budget (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0) the summary's
# peak activation is the activation peak alone.
_ESTIMATE_OFF = re.compile(r"CUDA graph memory profiling is disabled")
# A new start of the server: what came before belongs to an earlier start.
_START = re.compile(r"Initializing a V1 LLM engine|Initializing an LLM engine|vLLM (?:API )?server version")
# Every line a rule above reads holds one of these words. Most of a serving log is request
# lines that hold none, and a substring test is a hundred times cheaper than the rules.
_KEYWORDS = ("GiB", "GB", "MiB", "MB", "KiB", "KB", "tokens", "blocks", "utilization", "Initializing",
             "server version", "disabled")


class ProfileParser:
    """Reads log lines one at a time and keeps the figures of the latest start."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._found: dict[str, tuple[int, float | int]] = {}
        self._peak_torch: int | None = None
        self._estimate_applied = True
        self._sleeps = 0

    def feed(self, line: str) -> None:
        line = line[:MAX_LINE_CHARS]
        if not any(word in line for word in _KEYWORDS):
            return
        if _START.search(line):
            self._reset()
            if match := _MAX_MODEL_LEN.search(line):  # the engine's config, on its start line
                _keep(self._found, "max_model_len", 1, int(match.group(1)))
            return
        found = self._found
        for field, pattern, priority in _SIZE_RULES:
            match = pattern.search(line)
            if match:
                value = _bytes(match.group(1), match.group(2))
                if value == 0 and pattern in _ZERO_IS_UNKNOWN:
                    continue  # printed as 0.0 GiB: below 0.005 GiB, not nothing
                _keep(found, field, priority, value)
        for pattern in _UTILIZATION:
            match = pattern.search(line)
            if match:
                _keep(found, "gpu_memory_utilization", 1, float(match.group(1)))
        if self._peak_torch is None and (match := _PEAK_TORCH.search(line)):
            self._peak_torch = _bytes(match.group(1), match.group(2))
        if match := _KV_TOKENS.search(line):
            _keep(found, "kv_cache_tokens", 1, int(match.group(1).replace(",", "")))
        if match := _CONCURRENCY.search(line):
            _keep(found, "kv_cache_max_concurrency", 1, float(match.group(2)))
            _keep(found, "max_model_len", 2, int(match.group(1).replace(",", "")))
        if match := _GPU_BLOCKS.search(line):
            _keep(found, "num_gpu_blocks", 1, int(match.group(1)))
        if match := _SLEEP.search(line):  # the latest sleep is the one that matters
            found["sleep_freed_bytes"] = (1, _bytes(match.group(1), match.group(2)))
            found["sleep_still_in_use_bytes"] = (1, _bytes(match.group(3), match.group(4)))
            self._sleeps += 1
        if _ESTIMATE_OFF.search(line):
            self._estimate_applied = False

    def profile(self) -> MemoryProfile:
        values: dict[str, Any] = {field: value for field, (_, value) in self._found.items()}
        weights = values.get("weights_bytes")
        summary_peak = values.pop("summary_peak_bytes", None)
        if "activation_peak_bytes" not in values and summary_peak is not None:
            estimate = values.get("cuda_graph_estimate_bytes") if self._estimate_applied else None
            values["activation_peak_bytes"] = max(0, summary_peak - (estimate or 0))
        if "activation_peak_bytes" not in values and self._peak_torch is not None and weights is not None:
            values["activation_peak_bytes"] = max(0, self._peak_torch - weights)
        consumed = values.get("consumed_bytes")
        if "non_torch_bytes" not in values and consumed is not None and weights is not None:
            values["non_torch_bytes"] = max(0, consumed - weights)
        return MemoryProfile(**values, sleeps=self._sleeps)


def parse_profile(lines: Iterable[str]) -> MemoryProfile:
    """The latest start's profile in `lines` (at most MAX_LINES of them)."""
    parser = ProfileParser()
    for count, line in enumerate(lines):
        if count >= MAX_LINES:
            break
        parser.feed(line)
    return parser.profile()
def read_profile(path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> MemoryProfile:
    """Parse the head of a vLLM log (the profile is logged at start-up). Never raises: an
    unreadable file gives an empty profile with `error` saying why."""
    try:
        head, _ = read_head(path, max_bytes)  # never blocks: a FIFO here must not hang sampling
    except OSError as exc:
        return MemoryProfile(error=f"cannot read {path}: {exc.strerror or exc}")
    text = head.decode("utf-8", errors="replace").replace("\x00", "")
    return parse_profile(text.splitlines())


def _keep(found: dict[str, tuple[int, float | int]], field: str, priority: int, value: float | int) -> None:
    old = found.get(field)
    if old is None or priority > old[0]:
        found[field] = (priority, value)


def _bytes(number: str, unit: str) -> int:
    """vLLM logs sizes as signed numbers ('-0.25GiB' when the profile went wrong)."""
    size = bytes_in_message(number.lstrip("-"), unit) or 0
    return -size if number.startswith("-") else size


class LogFollower:
    """One server log read as it grows: each call reads what was added since the last (at most
    READ_BUDGET_BYTES), so a start logged after gigabytes of request lines is still seen, and
    starts over when the file is replaced or truncated (log rotation)."""

    def __init__(self, path: str, budget_bytes: int = READ_BUDGET_BYTES):
        self.path = path
        self.budget_bytes = budget_bytes
        self._restart(None)

    def _restart(self, identity: tuple[int, int] | None) -> None:
        self._identity = identity
        self._offset = 0
        self._partial = b""
        self._skipping = False  # inside a line too long to matter
        self._parser = ProfileParser()

    def profile(self) -> MemoryProfile:
        """Never raises: an unreadable file gives an empty profile saying why."""
        try:
            with open_regular(self.path) as fh:  # never blocks: a FIFO must not hang sampling
                st = os.fstat(fh.fileno())
                if (st.st_dev, st.st_ino) != self._identity or st.st_size < self._offset:
                    self._restart((st.st_dev, st.st_ino))
                if st.st_size > self._offset:
                    fh.seek(self._offset)
                    data = fh.read(min(self.budget_bytes, st.st_size - self._offset))
                    self._offset += len(data)
                    self._feed(data)
        except OSError as exc:
            return MemoryProfile(error=f"cannot read {self.path}: {exc.strerror or exc}")
        return self._parser.profile()

    def _feed(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            if self._skipping:
                self._skipping = False  # the end of the long line: skip it, then read on
                continue
            self._parser.feed(raw.decode("utf-8", errors="replace").replace("\x00", ""))
        if len(self._partial) > MAX_LINE_CHARS * 4:
            self._partial, self._skipping = b"", True


class ProfileCache:
    """Attaches each server's start-up memory profile to its samples, following each log as it
    grows (LogFollower)."""

    def __init__(self, log_files: dict[str, str]):
        self.log_files = log_files  # endpoint label -> log path
        self._followers = {path: LogFollower(path) for path in log_files.values()}

    def attach(self, samples: Iterable[VllmSample]) -> tuple[VllmSample, ...]:
        out = []
        for sample in samples:
            path = self.log_files.get(sample.endpoint)
            if path is None:
                out.append(sample)
                continue
            profile = self._followers[path].profile()
            out.append(dataclasses.replace(sample, memory_profile=tuple(sorted(profile.components().items())),
                                           startup=None if profile.empty else profile))
        return tuple(out)
