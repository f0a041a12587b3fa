"""Find out-of-memory messages in server logs, parse their numbers, classify and advise.

Pure: no I/O. `OomParser` is fed one line at a time (so the live log source and the offline
`explain` command share it) and keeps the little context that multi-line messages need:
a PyTorch OOM message wrapped over several lines, NCCL's warning pair, the kernel's
`oom-kill:` line followed by `Killed process`. `parse_lines` is the one-shot wrapper.

Message shapes were taken from the sources that print them: PyTorch
c10/cuda/CUDACachingAllocator.cpp (2.x and the 1.x "(GPU 0; ... total capacity; ...)" form),
vLLM's worker / kv_cache_utils start-up checks, NCCL's alloc.h warnings and the Linux OOM killer.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable

from ..model import OomEvent

GiB = 1024**3
MAX_MESSAGE_CHARS = 500  # what an event keeps of its message
MAX_LINE_CHARS = 16384  # a longer line is cut before matching (bounds regex work)
MAX_PENDING_LINES = 24  # a multi-line message longer than this is cut off
MAX_PENDING_CHARS = 8192
DEDUPE_WINDOW_LINES = 100  # the same event re-printed (traceback chaining) within this is one event

# The share of a GPU that makes a number "large" (see classify()).
FRAGMENTATION_SHARE = 0.20
CONTENTION_SHARE = 0.10
UNACCOUNTED_SHARE = 0.20

KINDS = (
    "torch_cuda_oom",
    "vllm_insufficient_memory",
    "vllm_kv_cache_too_small",
    "cuda_runtime_oom",
    "nccl_oom",
    "kernel_oom_kill",
    "cgroup_oom",
    "host_memory_error",
)
CLASSES = ("shortage", "fragmentation", "contention", "configuration", "host")

# ---------------------------------------------------------------------------- sizes

_UNITS = {
    "b": 1, "byte": 1, "bytes": 1,
    "kib": 1024, "kb": 1024, "k": 1024,
    "mib": 1024**2, "mb": 1024**2, "m": 1024**2,
    "gib": 1024**3, "gb": 1024**3, "g": 1024**3,
    "tib": 1024**4, "tb": 1024**4, "t": 1024**4,
}
# Bounded repetitions keep matching linear on hostile input (a line of 16,000 digits).
_SIZE = r"(?<![\d.])(\d{1,15}(?:\.\d{1,6})?)\s{0,2}(bytes|byte|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b"
_MAX_BYTES = 1 << 62  # anything bigger is garbage, not a size


def parse_size(number: str, unit: str) -> int | None:
    """'2.00', 'GiB' -> 2147483648. None for nonsense (unknown unit, absurd size)."""
    factor = _UNITS.get(unit.strip().lower())
    if factor is None:
        return None
    try:
        value = float(number)
    except ValueError:
        return None
    if not math.isfinite(value) or value < 0:
        return None
    result = int(round(value * factor))
    return result if result <= _MAX_BYTES else None


def format_bytes(n: int | None) -> str:
    """Bytes as PyTorch prints them (2 decimals, binary units)."""
    if n is None:
        return "?"
    if n < 0:
        return "-" + format_bytes(-n)
    for unit, factor in (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{n} bytes"


def _size_after(pattern: str, text: str) -> int | None:
    """The size captured by `pattern`, which must contain _SIZE once."""
    m = re.search(pattern, text)
    return parse_size(m.group(1), m.group(2)) if m else None


# ------------------------------------------------------------------ prefix handling

# Log prefixes that precede the message proper: timestamps, syslog and dmesg headers, vLLM's
# "ERROR 11-22 10:11:12 [core.py:123]", process tags like "(VllmWorker rank=0 pid=123)",
# docker compose's "vllm-1  | ". Stripped (repeatedly) only at the start of a line.
_PREFIX = re.compile(
    r"""^\s*(?:
        \[\s*\d+\.\d+\]                                                   # dmesg [12345.678]
      | \d{4}-\d{2}-\d{2}[T\ ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?  # ISO time
      | \[\d{4}-\d{2}-\d{2}[T\ ][^\]]{1,40}\]                              # [2025-01-01 10:00:00]
      | [A-Z][a-z]{2}\s+\d{1,2}\s\d{2}:\d{2}:\d{2}\s\S+\s+[\w\-./]+(?:\[\d+\])?:  # syslog
      | (?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s\d{2}-\d{2}\s\d{2}:\d{2}:\d{2}(?:\.\d+)?
        \s(?:\[[\w.\-]+:\d+\]|[\w.\-]+:\d+\])                             # vLLM logger
      | \((?:[A-Za-z_]\w*)(?:\s+[\w.]+=[^()\s,]+,?)+\)                    # (VllmWorker rank=0 pid=1)
      | \[(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|[EWIDF])\]           # [E]
      | (?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)(?::|\s(?=\S))         # ERROR: / ERROR x
      | -\s[\w.]+\s-\s(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s-            # - name - ERROR -
      | [\w.\-]+\s*\|(?=\s)                                               # compose "vllm-1 |"
      | kernel:                                                           # journal after syslog
    )""",
    re.VERBOSE,
)


def strip_prefixes(text: str) -> str:
    """The line without leading log decorations (bounded number of passes)."""
    for _ in range(8):
        m = _PREFIX.match(text)
        if not m or m.end() == 0:
            break
        text = text[m.end():]
    return text.strip()


_SECRET = re.compile(
    r"(?i)((?:bearer|basic)\s+)\S+"
    r"|((?:api[_-]?key|token|password|secret|authorization)\s*[=:]\s*(?:bearer\s+|basic\s+)?)\S+"
)


def _clean_message(text: str) -> str:
    """What an event keeps of the log text: one line, secrets masked, truncated."""
    text = " ".join(text.split())
    text = _SECRET.sub(lambda m: (m.group(1) or m.group(2)) + "<redacted>", text)
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 3] + "..."
    return text


# ---------------------------------------------------------------------- patterns

# vLLM's own warm-up message wraps a torch OOM; checked before the torch pattern.
_VLLM_WARMUP = re.compile(
    r"CUDA out of memory occurred when warming up (sampler|pooler) with (\d+) dummy requests"
)
_TORCH_START = re.compile(r"\bCUDA out of memory(?! occurred)")
_VLLM_FREE = re.compile(
    r"Free memory on device(?:\s+(\S+))?\s*\(\s*([\d.]+)\s*/\s*([\d.]+)\s*GiB\)\s*on startup is less"
    r" than desired GPU memory utilization\s*\(\s*([\d.]+)\s*,\s*([\d.]+)\s*GiB\)"
)
_VLLM_FREE_LOOSE = re.compile(r"less than desired GPU memory utilization")
_VLLM_NO_CACHE = re.compile(r"No available memory for the cache blocks")
_VLLM_MAX_LEN_OLD = re.compile(
    r"The model's max seq len \((\d+)\) is larger than the maximum number of tokens that can be"
    r" stored in KV cache \((\d+)\)"
)
_VLLM_MAX_LEN_V1 = re.compile(
    r"To serve at least one request with the models?(?:'s|s's|') max seq len \((\d+)\),\s*\(?"
    r"\s*(-?[\d.]+)\s*GiB KV cache is needed, which is larger than the available KV cache memory"
    r"\s*\(\s*(-?[\d.]+)\s*GiB\)"
)
_VLLM_WRAPPED_START = re.compile(
    r"Free memory on device|To serve at least one request with the model")
_VLLM_ESTIMATED_LEN = re.compile(r"estimated maximum model length is (\d+)")
_CUDA_RUNTIME = re.compile(
    r"CUDA error: out of memory|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED"
    r"|CUDA_ERROR_OUT_OF_MEMORY|CUDA driver error: out of memory"
)
_NCCL = re.compile(
    r"Cuda failure(?: \d+)? 'out of memory'"
    r"|Failed to CUDA calloc(?: async)? \d+ bytes"
    r"|(?:ncclSystemError|ncclUnhandledCudaError)\b.{0,300}?\bout of memory\b"
)
_NCCL_CALLOC = re.compile(r"Failed to CUDA calloc(?: async)? (\d+) bytes")
_OOM_KILL_LINE = re.compile(r"\boom-kill:constraint=(\w+)(.*)")
_KILLED = re.compile(
    r"(Memory cgroup out of memory|Out of memory(?: \(oom_kill_allocating_task\))?):"
    r" Kill(?:ed)? process (\d+) \(([^)]*)\)(.*)"
)
_RSS = re.compile(r"\b(anon-rss|file-rss|shmem-rss):(\d+)kB")
_HOST_PY = re.compile(r"^(?:builtins\.)?MemoryError(?::|$)")
_HOST_CPU_ALLOC = re.compile(
    r"DefaultCPUAllocator: (?:not enough memory|can't allocate memory): you tried to allocate"
    r" (\d+) bytes"
)


def _vllm_startup_match(text: str) -> re.Match | None:
    return _VLLM_FREE.search(text) or _VLLM_MAX_LEN_V1.search(text)


# ------------------------------------------------------------------ torch parsing

@dataclass
class TorchNumbers:
    gpu: str | None = None
    requested: int | None = None
    total: int | None = None
    free: int | None = None
    allowed: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    reserved_unallocated: int | None = None
    self_bytes: int | None = None
    processes: list[tuple[int, int]] = field(default_factory=list)
    legacy: bool = False  # 1.x/2.0/2.1 message: no expandable_segments advice there


def parse_torch_message(text: str) -> TorchNumbers:
    """Every number a PyTorch CUDA OOM message carries (old and new shapes)."""
    n = TorchNumbers()
    n.requested = _size_after(r"Tried to allocate " + _SIZE, text)
    m = re.search(r"GPU (\d+) has a total capac(?:i)?ty of " + _SIZE + r" of which " + _SIZE
                  + r" is free", text)
    if m:  # PyTorch >= 2.1 (2.1 spelt it "capacty")
        n.gpu = m.group(1)
        n.total = parse_size(m.group(2), m.group(3))
        n.free = parse_size(m.group(4), m.group(5))
        n.legacy = "capacty" in m.group(0) or "max_split_size_mb" in text
        for pid, num, unit in re.findall(r"Process (\d+) has " + _SIZE + r" memory in use", text):
            size = parse_size(num, unit)
            if size is not None:
                n.processes.append((int(pid), size))
        n.self_bytes = _size_after(r"this process has " + _SIZE + r" memory in use", text)
        n.allocated = _size_after(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch",
                                  text)
        n.reserved_unallocated = _size_after(
            r"and " + _SIZE + r" is reserved by PyTorch but unallocated", text)
        if n.allocated is not None and n.reserved_unallocated is not None:
            n.reserved = n.allocated + n.reserved_unallocated
    else:  # PyTorch 1.x / 2.0: "(GPU 0; 15.78 GiB total capacity; 14.56 GiB already allocated; ..."
        n.legacy = True
        g = re.search(r"\(GPU (\d+);", text)
        n.gpu = g.group(1) if g else None
        n.total = _size_after(_SIZE + r" total capacity", text)
        n.allocated = _size_after(_SIZE + r" already allocated", text)
        n.free = _size_after(_SIZE + r" free\b", text)
        n.reserved = _size_after(_SIZE + r" reserved in total by PyTorch", text)
        cached = _size_after(_SIZE + r" cached\b", text)
        if n.reserved is None and cached is not None:
            # PyTorch < 1.4 printed "cached": the total cache in some releases, the unused part
            # in others. It cannot be below what is allocated, so a smaller one is the unused part.
            if n.allocated is not None and cached < n.allocated:
                n.reserved = n.allocated + cached
            else:
                n.reserved = cached
        if n.reserved is not None and n.allocated is not None:
            n.reserved_unallocated = max(0, n.reserved - n.allocated)
    n.allowed = _size_after(_SIZE + r" allowed;", text)
    _separate_self(n)
    return n


def _separate_self(n: TorchNumbers) -> None:
    """Inside a container PyTorch cannot recognise its own PID (a PID namespace hides it), so it
    lists itself as "Process N". The listed process holding at least what PyTorch reserved, and
    the least such, is taken to be this process."""
    if n.self_bytes is not None or not n.processes or not n.reserved:
        return
    candidates = [p for p in n.processes if p[1] >= n.reserved * 0.99]
    if not candidates:
        return
    me = min(candidates, key=lambda p: p[1])
    n.self_bytes = me[1]
    n.processes = [p for p in n.processes if p is not me]


def _torch_complete(text: str) -> bool:
    """The message's numbers are all there (its trailing hint may still follow)."""
    return ("reserved by PyTorch but unallocated" in text
            or "reserved in total by PyTorch)" in text
            or bool(re.search(r"\(GPU \d+;[^)]*cached\)", text)))


def _torch_finished(text: str) -> bool:
    """Nothing of the message is left to come: the numbers and PyTorch's closing hint."""
    return _torch_complete(text) and (
        text.endswith("environment-variables)")
        or text.endswith("Memory Management and PYTORCH_CUDA_ALLOC_CONF"))


# A line that carries on a wrapped PyTorch message (after its log prefix is stripped).
_TORCH_CONTINUATION = re.compile(
    r"^(?:\d+(?:\.\d+)?\s*(?:bytes|B|KiB|MiB|GiB|TiB)\b|GPU \d|Process \d|Including non-PyTorch"
    r"|this process|Of the allocated|is allocated|is reserved|is free|and \d|with \d|reserved"
    r"|If reserved|PYTORCH_CUDA_ALLOC_CONF|to avoid|fragmentation|See documentation"
    r"|for Memory Management|Management|\(?https?://|\(GPU|total capac|of which|already allocated"
    r"|free;|allowed;|memory in use|in total by|max_split_size_mb|Tried to allocate|has a total)"
)


# ------------------------------------------------------------------ classification

def _floor2(x: float) -> float:
    return math.floor(x * 100 + 1e-9) / 100  # the epsilon keeps 0.47 from printing as 0.46


def _ceil2(x: float) -> float:
    return math.ceil(x * 100 - 1e-9) / 100


def classify_torch(n: TorchNumbers) -> tuple[str, tuple[str, ...]]:
    """(class, advice) for a PyTorch CUDA OOM.

    fragmentation: the request would have fit in memory PyTorch holds but cannot use
      (reserved-but-unallocated >= requested, or >= 20 % of the GPU), or the GPU had the
      free memory yet the allocation failed;
    contention: other processes hold >= 10 % of the GPU;
    configuration: the process is capped below the GPU (set_per_process_memory_fraction);
    shortage: the load does not fit.
    Fragmentation that the request fits in is named first: fixing it alone is enough.
    """
    R, T, F, U = n.requested, n.total, n.free, n.reserved_unallocated
    others = sum(b for _, b in n.processes)
    gpu = f"GPU {n.gpu}" if n.gpu is not None else "the GPU"
    alloc_conf = ("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 (this PyTorch predates"
                  " expandable_segments)" if n.legacy
                  else "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    fits_in_cache = U is not None and R is not None and U > 0 and U >= R
    fits_in_free = F is not None and R is not None and F >= R
    large_cache = U is not None and T and U >= FRAGMENTATION_SHARE * T
    # Memory on the GPU that is neither free nor this process's reserved pool: other processes.
    unaccounted = None
    if not n.processes and T and F is not None and n.reserved is not None:
        unaccounted = T - F - (n.self_bytes if n.self_bytes is not None else n.reserved)

    advice: list[str] = []
    if n.allowed is not None and (fits_in_free or (R is not None and n.allocated is not None
                                                   and n.allocated + R > n.allowed)):
        klass = "configuration"
        advice.append(f"The process is capped at {format_bytes(n.allowed)} of {gpu}"
                      " (torch.cuda.set_per_process_memory_fraction): raise the fraction or"
                      " lower the load.")
    elif fits_in_cache or fits_in_free:
        klass = "fragmentation"
        if fits_in_cache:
            advice.append(f"{format_bytes(U)} is reserved by PyTorch but unallocated, more than the"
                          f" {format_bytes(R)} requested: set {alloc_conf}.")
        else:
            advice.append(f"{format_bytes(F)} was free yet {format_bytes(R)} could not be allocated in one"
                          f" piece: set {alloc_conf}.")
        advice.append("Restart the server to release the fragmented cache if it persists.")
    elif others and T and others >= CONTENTION_SHARE * T:
        klass = "contention"
        names = ", ".join(f"pid {pid} ({format_bytes(b)})" for pid, b in
                          sorted(n.processes, key=lambda p: -p[1])[:5])
        advice.append(f"Other processes hold {format_bytes(others)} ({others / T:.0%}) of {gpu}: {names};"
                      " stop them or move them to another GPU.")
        share = _floor2((T - others) / T - 0.02)
        if share > 0:
            advice.append(f"Or lower --gpu-memory-utilization to {share:.2f} or below so vLLM"
                          " fits beside them.")
    elif unaccounted is not None and unaccounted >= UNACCOUNTED_SHARE * T:
        klass = "contention"
        advice.append(f"{format_bytes(unaccounted)} of {gpu} is held outside this process's PyTorch pool"
                      " (other processes or stale memory): check nvidia-smi and stop them.")
    elif large_cache:
        klass = "fragmentation"
        advice.append(f"{format_bytes(U)} ({U / T:.0%} of {gpu}) is reserved by PyTorch but unallocated:"
                      f" set {alloc_conf}.")
    else:
        klass = "shortage"
        if R is not None and T and R > T:
            advice.append(f"One allocation of {format_bytes(R)} is larger than all of {gpu} ({format_bytes(T)}):"
                          " lower --max-model-len or the batch size; no memory setting helps.")
        elif R is not None and F is not None and T:
            short = R - F
            advice.append(f"Needed {format_bytes(R)} with {format_bytes(F)} free of {format_bytes(T)}: lower"
                          f" --gpu-memory-utilization by at least {_ceil2(short / T + 0.01):.2f}"
                          f" to leave {format_bytes(short)} more headroom for activations.")
        advice.append("Lower --max-num-seqs or --max-num-batched-tokens to shrink the"
                      " activation peak.")
        advice.append("Quantise the weights (--quantization fp8/awq) or shard the model with"
                      " --tensor-parallel-size 2 or more.")
    if klass != "contention" and others and T and others >= CONTENTION_SHARE * T:
        advice.append(f"Other processes also hold {format_bytes(others)} of {gpu}.")
    return klass, tuple(advice)


def _suggest_utilization(free: int, total: int) -> float:
    """A gpu_memory_utilization that fits in what was free, with a 1 % margin."""
    return max(0.0, _floor2(free / total - 0.01))


# ------------------------------------------------------------------ the parser

@dataclass
class _Pending:
    """A message that may continue on the next lines."""

    kind: str
    line: int
    last_line: int
    text: str
    lines: int = 1
    data: dict = field(default_factory=dict)


class OomParser:
    """Incremental parser: `feed(line_no, text)` returns the events finished so far,
    `flush()` the one still open. Never raises on any input."""

    def __init__(self, source: str = ""):
        self.source = source
        self._pending: _Pending | None = None
        self._recent: list[tuple[int, tuple]] = []  # (line, signature) of recent events
        self._last_line = 0
        self.faults = 0  # lines dropped because the parser itself failed (a bug, counted)

    def feed(self, line_no: int, text: str) -> list[OomEvent]:
        try:
            return self._feed(line_no, text)
        except Exception:  # a parser bug must not take the daemon down; drop the line
            self._pending = None
            self.faults += 1
            return []

    def flush(self) -> list[OomEvent]:
        """Finish the open multi-line message (end of file, or the log went quiet)."""
        try:
            return self._emit(self._finish())
        except Exception:
            self._pending = None
            self.faults += 1
            return []

    # -- internals

    def _feed(self, line_no: int, text: str) -> list[OomEvent]:
        if not isinstance(text, str):
            return []
        text = text[:MAX_LINE_CHARS].rstrip("\r\n")
        out: list[OomEvent] = []
        if line_no <= self._last_line:  # the file was truncated or rotated: start over
            out += self._emit(self._finish())
            self._recent.clear()
        self._last_line = line_no
        body = strip_prefixes(text)
        if self._pending is not None:
            if self._continue(line_no, body):
                if self._pending is not None and self._done(self._pending):
                    out += self._emit(self._finish())
                return out
            out += self._emit(self._finish())
        out += self._emit(self._start(line_no, body))
        if self._pending is not None and self._done(self._pending):
            out += self._emit(self._finish())
        return out

    def _emit(self, event: OomEvent | None) -> list[OomEvent]:
        if event is None:
            return []
        signature = (event.kind, event.gpu, event.requested_bytes, event.total_bytes,
                     event.free_bytes, event.reserved_unallocated_bytes, event.other_processes,
                     event.process_bytes, event.message if event.requested_bytes is None
                     and event.total_bytes is None else "")
        self._recent = [(ln, sig) for ln, sig in self._recent
                        if event.line - ln <= DEDUPE_WINDOW_LINES]
        if any(sig == signature for _, sig in self._recent):
            return []
        self._recent.append((event.line, signature))
        return [event]

    def _start(self, line_no: int, body: str) -> OomEvent | None:
        """Recognise the first line of a message; single-line messages finish here."""
        m = _VLLM_WARMUP.search(body)
        if m:
            seqs = int(m.group(2))
            return self._event("vllm_insufficient_memory", "configuration", line_no, body,
                               advice=(f"vLLM ran out of memory warming up the {m.group(1)} with"
                                       f" {seqs} requests: lower --max-num-seqs to"
                                       f" {max(1, seqs // 2)}.",
                                       "Or lower --gpu-memory-utilization by 0.05 to leave"
                                       " room for the sampler's peak."))
        if _TORCH_START.search(body):
            self._pending = _Pending("torch_cuda_oom", line_no, line_no, body)
            return None
        if _VLLM_WRAPPED_START.search(body):
            # vLLM's start-up checks print one line, but log shippers and docs wrap them.
            self._pending = _Pending("vllm_startup", line_no, line_no, body)
            return None
        if _VLLM_FREE_LOOSE.search(body):
            return self._vllm_free(line_no, body, None)
        m = _VLLM_MAX_LEN_OLD.search(body)
        if m:
            max_len, tokens = int(m.group(1)), int(m.group(2))
            return self._event(
                "vllm_kv_cache_too_small", "configuration", line_no, body,
                advice=(f"The KV cache holds {tokens} tokens but --max-model-len is {max_len}:"
                        f" set --max-model-len {tokens} or lower.",
                        "Or raise --gpu-memory-utilization, use --kv-cache-dtype fp8, or add"
                        " --tensor-parallel-size to make room for the KV cache."))
        if _VLLM_NO_CACHE.search(body):
            return self._event(
                "vllm_kv_cache_too_small", "configuration", line_no, body,
                advice=("Weights and activation peak already use the whole memory budget:"
                        " raise --gpu-memory-utilization if the GPU has room.",
                        "Lower --max-num-batched-tokens / --max-num-seqs, quantise the weights"
                        " (--quantization fp8/awq) or add --tensor-parallel-size."))
        if _NCCL.search(body):
            self._pending = _Pending("nccl_oom", line_no, line_no, body)
            self._nccl_merge(self._pending, body)
            return None
        if _CUDA_RUNTIME.search(body):
            return self._cuda_runtime(line_no, body)
        m = _OOM_KILL_LINE.search(body)
        if m:
            self._pending = _Pending("kernel_oom_kill", line_no, line_no, body)
            self._kernel_merge(self._pending, body)
            return None
        if _KILLED.search(body):
            pending = _Pending("kernel_oom_kill", line_no, line_no, body)
            self._kernel_merge(pending, body)
            return self._kernel_event(pending)
        m = _HOST_CPU_ALLOC.search(body)
        if m:
            return self._host_python(line_no, body, requested=int(m.group(1)))
        if _HOST_PY.search(body) and not re.search(r"OutOfMemoryError|out of memory", body):
            return self._host_python(line_no, body, requested=None)
        return None

    def _continue(self, line_no: int, body: str) -> bool:
        """Merge a line into the open message; False when it is not part of it."""
        p = self._pending
        assert p is not None
        if p.lines >= MAX_PENDING_LINES or len(p.text) >= MAX_PENDING_CHARS:
            return False
        if p.kind == "torch_cuda_oom":
            if not body:
                return False
            joined_open = not p.text.rstrip().endswith((".", ")"))
            if _TORCH_CONTINUATION.match(body) or (joined_open and re.match(r"^[a-z0-9(]", body)):
                if _TORCH_START.search(body) and _torch_complete(p.text):
                    return False  # a second OOM message begins
                p.text = (p.text + " " + body)[:MAX_PENDING_CHARS]
                p.lines += 1
                p.last_line = line_no
                return True
            return False
        if p.kind == "vllm_startup":
            if (line_no - p.last_line <= 2 and body and not _VLLM_WRAPPED_START.search(body)
                    and not _vllm_startup_match(p.text)
                    and (re.match(r"^[a-z0-9(]", body) or "GiB" in body)):
                p.text = p.text + " " + body
                p.lines += 1
                p.last_line = line_no
                return True
            return False
        if p.kind == "nccl_oom":
            if line_no - p.last_line <= 3 and _NCCL.search(body):
                self._nccl_merge(p, body)
                p.lines += 1
                p.last_line = line_no
                return True
            return False
        if p.kind in ("kernel_oom_kill", "cgroup_oom"):
            if line_no - p.last_line <= 5 and _KILLED.search(body) and "killed_pid" not in p.data:
                self._kernel_merge(p, body)
                p.lines += 1
                p.last_line = line_no
                return True
            return False
        return False

    def _done(self, p: _Pending) -> bool:
        if p.kind == "torch_cuda_oom":
            return _torch_finished(p.text)
        if p.kind in ("kernel_oom_kill", "cgroup_oom"):
            return "killed_pid" in p.data
        if p.kind == "vllm_startup":
            return _vllm_startup_match(p.text) is not None
        return False

    def _finish(self) -> OomEvent | None:
        p, self._pending = self._pending, None
        if p is None:
            return None
        if p.kind == "torch_cuda_oom":
            n = parse_torch_message(p.text)
            klass, advice = classify_torch(n)
            return OomEvent(
                kind="torch_cuda_oom", klass=klass, line=p.line, source=self.source,
                message=_clean_message(p.text), gpu=n.gpu, requested_bytes=n.requested,
                total_bytes=n.total, free_bytes=n.free, allocated_bytes=n.allocated,
                reserved_bytes=n.reserved, reserved_unallocated_bytes=n.reserved_unallocated,
                process_bytes=n.self_bytes, other_processes=tuple(n.processes), advice=advice)
        if p.kind == "vllm_startup":
            m = _VLLM_FREE.search(p.text)
            if m:
                return self._vllm_free(p.line, p.text, m)
            m = _VLLM_MAX_LEN_V1.search(p.text)
            if m:
                return self._vllm_kv_v1(p.line, p.text, m)
            if _VLLM_FREE_LOOSE.search(p.text):
                return self._vllm_free(p.line, p.text, None)
            return None  # "Free memory on device" in an informational line: not a failure
        if p.kind == "nccl_oom":
            req = p.data.get("requested")
            first = (f"NCCL could not allocate {format_bytes(req)} for its buffers: " if req is not None
                     else "NCCL ran out of GPU memory for its buffers: ")
            return self._event(
                "nccl_oom", "shortage", p.line, p.text, requested=req,
                advice=(first + "lower --gpu-memory-utilization by 0.03-0.05 to leave room"
                        " outside vLLM's pool.",
                        "With tensor parallelism set NCCL_CUMEM_ENABLE=0, or a smaller"
                        " NCCL_BUFFSIZE."))
        return self._kernel_event(p)

    # -- event builders

    def _event(self, kind: str, klass: str, line: int, text: str, *, advice: tuple[str, ...],
               **numbers) -> OomEvent:
        return OomEvent(
            kind=kind, klass=klass, line=line, source=self.source, message=_clean_message(text),
            gpu=numbers.get("gpu"), requested_bytes=numbers.get("requested"),
            total_bytes=numbers.get("total"), free_bytes=numbers.get("free"),
            process_bytes=numbers.get("process"), advice=advice)

    def _vllm_free(self, line_no: int, body: str, m: re.Match | None) -> OomEvent:
        gpu = free = total = desired = None
        util = None
        if m:
            device = m.group(1) or ""
            g = re.search(r"(\d+)$", device)
            gpu = g.group(1) if g else None
            free = parse_size(m.group(2), "GiB")
            total = parse_size(m.group(3), "GiB")
            try:
                util = float(m.group(4))
            except ValueError:
                util = None
            desired = parse_size(m.group(5), "GiB")
        advice: list[str] = []
        if free is not None and total:
            suggestion = _suggest_utilization(free, total)
            used = total - free
            cur = f" from {util:g}" if util is not None else ""
            lower = (f"lower --gpu-memory-utilization{cur} to {suggestion:.2f} or below"
                     f" ({format_bytes(free)} of {format_bytes(total)} was free at start-up).")
            stop = (f"stop what else holds {format_bytes(used)} on"
                    f" {'GPU ' + gpu if gpu is not None else 'the GPU'} (nvidia-smi), e.g. a"
                    " previous vLLM that did not exit.")
            if suggestion >= 0.05:
                advice += ["Lower " + lower[len("lower "):], "Or " + stop]
            else:  # almost nothing is free: only freeing the GPU helps
                advice += ["Stop " + stop[len("stop "):], "Then, if it must share the GPU, " + lower]
        else:
            advice.append("Lower --gpu-memory-utilization, or stop the other processes using"
                          " this GPU (nvidia-smi).")
        return self._event("vllm_insufficient_memory", "configuration", line_no, body,
                           advice=tuple(advice), gpu=gpu, free=free, total=total,
                           requested=desired)

    def _vllm_kv_v1(self, line_no: int, body: str, m: re.Match) -> OomEvent:
        max_len = int(m.group(1))
        needed = parse_size(m.group(2), "GiB") if not m.group(2).startswith("-") else None
        # A negative "available" (weights alone exceed the budget) means none.
        available = 0 if m.group(3).startswith("-") else (parse_size(m.group(3), "GiB") or 0)
        est = _VLLM_ESTIMATED_LEN.search(body)
        if est:
            fit = int(est.group(1))
        elif needed:
            fit = int(max_len * available / needed)
        else:
            fit = 0
        advice = []
        if fit > 0:
            advice.append(f"--max-model-len {max_len} needs {format_bytes(needed)} of KV cache but"
                          f" {format_bytes(available)} is available: set --max-model-len {fit} or lower.")
        if needed is not None:
            advice.append(f"Or raise --gpu-memory-utilization to give the KV cache"
                          f" {format_bytes(max(0, needed - available))} more, or use"
                          " --kv-cache-dtype fp8 / --tensor-parallel-size.")
        return self._event("vllm_kv_cache_too_small", "configuration", line_no, body,
                           advice=tuple(advice), requested=needed, free=available)

    def _cuda_runtime(self, line_no: int, body: str) -> OomEvent:
        if "CUBLAS_STATUS_ALLOC_FAILED" in body:
            first = "cuBLAS could not allocate its workspace: the GPU is full outside PyTorch's pool."
        else:
            first = ("A CUDA call outside PyTorch's allocator (context, library workspace, custom"
                     " kernel) ran out of memory.")
        return self._event(
            "cuda_runtime_oom", "shortage", line_no, body,
            advice=(first + " Lower --gpu-memory-utilization by 0.05 to leave headroom.",
                    "Check nvidia-smi for other processes or memory left by a crashed server."))

    @staticmethod
    def _nccl_merge(p: _Pending, body: str) -> None:
        m = _NCCL_CALLOC.search(body)
        if m and "requested" not in p.data:
            try:
                p.data["requested"] = int(m.group(1))
            except ValueError:
                pass
        if body not in p.text and len(p.text) < MAX_PENDING_CHARS:
            p.text = p.text + " | " + body if p.text != body else p.text

    @staticmethod
    def _kernel_merge(p: _Pending, body: str) -> None:
        m = _OOM_KILL_LINE.search(body)
        if m:
            p.data["constraint"] = m.group(1)
            task = re.search(r"\btask=([^,\s]+)", m.group(2))
            pid = re.search(r"\bpid=(\d+)", m.group(2))
            memcg = re.search(r"\boom_memcg=([^,\s]+)", m.group(2))
            if task:
                p.data.setdefault("name", task.group(1))
            if pid:
                p.data.setdefault("pid", int(pid.group(1)))
            if memcg:
                p.data["memcg"] = memcg.group(1)
        k = _KILLED.search(body)
        if k:
            p.data["killed_pid"] = int(k.group(2))
            p.data["pid"] = int(k.group(2))
            p.data["name"] = k.group(3)
            p.data["cgroup"] = k.group(1).startswith("Memory cgroup")
            rss = sum(int(v) * 1024 for _, v in _RSS.findall(k.group(4)))
            if _RSS.search(k.group(4)):
                p.data["rss"] = rss
            if p.text != body:
                p.text = p.text + " | " + body

    def _kernel_event(self, p: _Pending) -> OomEvent:
        d = p.data
        cgroup = d.get("cgroup") or d.get("constraint") == "CONSTRAINT_MEMCG"
        kind = "cgroup_oom" if cgroup else "kernel_oom_kill"
        who = f"pid {d['pid']} ({d.get('name', '?')})" if "pid" in d else "a process"
        rss = d.get("rss")
        held = f" holding {format_bytes(rss)} of host memory" if rss is not None else ""
        if cgroup:
            where = f" ({d['memcg']})" if "memcg" in d else ""
            advice = (f"The memory cgroup limit{where} was hit and {who} was killed{held}:"
                      " raise the container memory limit.",
                      "Or cut vLLM's host memory: smaller --swap-space / --cpu-offload-gb, fewer"
                      " API server processes.")
        else:
            advice = (f"The host ran out of RAM and the kernel killed {who}{held}.",
                      "Cut host memory use (smaller --swap-space / --cpu-offload-gb, fewer"
                      " workers) or stop other memory-hungry processes on the host.")
        return self._event(kind, "host", p.line, p.text, advice=advice, process=rss)

    def _host_python(self, line_no: int, body: str, requested: int | None) -> OomEvent:
        what = f" allocating {format_bytes(requested)}" if requested is not None else ""
        return self._event(
            "host_memory_error", "host", line_no, body, requested=requested,
            advice=(f"Host RAM ran out in the Python process{what} (not GPU memory).",
                    "Cap prompt size (--max-model-len) and concurrent requests, or raise the"
                    " container memory limit."))


def parse_lines(lines: Iterable[str], source: str = "") -> list[OomEvent]:
    """Every OOM event in `lines` (line numbers 1-based)."""
    parser = OomParser(source)
    events: list[OomEvent] = []
    for number, text in enumerate(lines, start=1):
        events += parser.feed(number, text)
    events += parser.flush()
    return events


def event_to_dict(event: OomEvent) -> dict:
    """The `explain --format json` shape of one event."""
    return {
        "file": event.source,
        "line": event.line,
        "kind": event.kind,
        "class": event.klass,
        "gpu": event.gpu,
        "requested_bytes": event.requested_bytes,
        "total_bytes": event.total_bytes,
        "free_bytes": event.free_bytes,
        "allocated_bytes": event.allocated_bytes,
        "reserved_bytes": event.reserved_bytes,
        "reserved_unallocated_bytes": event.reserved_unallocated_bytes,
        "process_bytes": event.process_bytes,
        "other_processes": [{"pid": pid, "bytes": b} for pid, b in event.other_processes],
        "advice": list(event.advice),
        "message": event.message,
    }
