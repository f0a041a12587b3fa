"""Find out-of-memory messages in server logs and read the numbers they state.

A source: it reads text and reports what the text says, as OomMessages. What the numbers mean
(contention, fragmentation, shortage) and what to do is decided in analysis/oom.py.

`OomParser` is fed one line at a time (the live log source and the offline `explain` share it)
and keeps the little context that messages spread over several lines need: a PyTorch message
wrapped over several prefixed lines, NCCL's warning pair, a vLLM check hard-wrapped by a log
shipper, the kernel's OOM report (`invoked oom-killer` ... `oom-kill:` ... `Killed process`).
Lines arrive decorated: log prefixes of several processes interleaved, ANSI colours, messages
inside the repr of other exceptions, JSON strings with escaped newlines. `parse_lines` is the
one-shot wrapper.

Message shapes were taken from the code that prints them: PyTorch c10/cuda/CUDACachingAllocator
(2.x, the 1.x "(GPU 0; ... total capacity; ...)" form and the memory-fraction table), vLLM's
worker and kv_cache_utils start-up checks, SGLang's and TGI's start-up checks, NCCL's alloc.h
warnings, the Linux OOM killer, the kubelet and Ray's memory monitor; tests/fixtures/oom_corpus
holds real copies of each.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ..model import OomMessage
from ..units import bytes_in_message
from .vllm_args import SettingsReader

MAX_MESSAGE_CHARS = 500  # what a message keeps of its text
MAX_LINE_CHARS = 16384  # a longer line is cut before matching (bounds regex work)
MAX_PENDING_LINES = 24  # a multi-line message longer than this is cut off
MAX_PENDING_CHARS = 8192
# The same message re-printed is one event: a traceback re-printing its exception, a worker
# logging its error twice, the engine echoing it ("Worker failed with error '...'"), the API
# server re-raising it. Each copy comes within DEDUPE_WINDOW_LINES of the one before, a failure's
# copies within DEDUPE_CHAIN_LINES of the first (vLLM 0.32's CPU worker: four copies over 110
# lines); a storm of identical errors still counts once per chain.
DEDUPE_WINDOW_LINES = 100
DEDUPE_CHAIN_LINES = 500
# The kernel prints `invoked oom-killer`, then a memory and task dump (a line per process), then
# the kill: the report is one event if the kill comes within this many lines.
KERNEL_REPORT_LINES = 2000

# ---------------------------------------------------------------------------- sizes

# Bounded repetitions keep matching linear on hostile input (a line of 16,000 digits).
_SIZE = r"(?<![\d.])(\d{1,15}(?:\.\d{1,6})?)\s{0,2}(bytes|byte|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b"
EXBIBYTE = 1 << 60  # "Tried to allocate more than 1EB": an overflowed size


def _size_after(pattern: str, text: str) -> int | None:
    """The size captured by `pattern`, which must contain _SIZE once."""
    m = re.search(pattern, text)
    return bytes_in_message(m.group(1), m.group(2)) if m else None


# ------------------------------------------------------------------ line clean-up

_ANSI = re.compile(r"(?:\x1b|#033)\[[0-9;]{0,20}[A-Za-z]")  # colours, raw or as syslog escapes
_ESCAPED_NEWLINE = re.compile(r"\\r?\\n")  # a JSON or repr string's "\n"

# Log prefixes that precede the message proper: timestamps, syslog and dmesg headers, vLLM's
# "ERROR 11-22 10:11:12 [core.py:123]", process tags like "(VllmWorker rank=0 pid=123)",
# docker compose's "vllm-1  | ", torch.distributed's "[rank0]:". Stripped (repeatedly) only at
# the start of a line.
_PREFIX = re.compile(
    r"""^\s*(?:
        \[\s*\d+\.\d+\]                                                   # dmesg [12345.678]
      | \[[A-Z][a-z]{2}\ [A-Z][a-z]{2}\s+\d{1,2}\ \d{2}:\d{2}:\d{2}\ \d{4}\]  # dmesg -T
      | \d{4}-\d{2}-\d{2}[T\ ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?  # ISO time
      | \[\d{4}-\d{2}-\d{2}[T\ ][^\]]{1,40}\]                              # [2025-01-01 10:00:00]
      | [A-Z][a-z]{2}\s+\d{1,2}\s\d{2}:\d{2}:\d{2}\s\S+\s+[\w\-./]+(?:\[\d+\])?:  # syslog
      | (?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s\d{2}-\d{2}\s\d{2}:\d{2}:\d{2}(?:\.\d+)?
        \s(?:\[[\w.\-/]+:\d+\]|[\w.\-/]+:\d+\])                           # vLLM logger
      | \((?:[A-Za-z_]\w*)(?:\s+[\w.]+=[^()\s,]+,?)+\)                    # (VllmWorker rank=0 pid=1)
      | \([A-Za-z_][\w:.\-]*\)(?=\s)                                      # (raylet), (Process)
      | \[rank\d+\]:                                                      # [rank0]:
      | \[(?i:debug|info|warning|warn|error|critical|[ewidf])\]           # [E], [Error]
      | (?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)(?::|\s(?=\S))         # ERROR: / ERROR x
      | -\s[\w.]+\s-\s(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s-            # - name - ERROR -
      | [\w.\-]*\s*\|(?=\s)                                               # compose "vllm-1 |"
      | kernel:                                                           # journal after syslog
    )""",
    re.VERBOSE,
)
_TAG_PID = re.compile(r"\bpid=(\d{1,9})\b")


def _strip(text: str) -> tuple[str, int | None, int]:
    """The line without leading log decorations, the pid a process tag names, and how far the
    rest was indented (a traceback's source lines are)."""
    pid = None
    for _ in range(8):
        m = _PREFIX.match(text)
        if not m or m.end() == 0:
            break
        tag = _TAG_PID.search(m.group(0))
        if tag:
            pid = int(tag.group(1))
        text = text[m.end():]
    body = text.strip()
    return body, pid, len(text) - len(text.lstrip())


# Records that quote what a client sent, by the shape of the record their logger writes: vLLM's
# request logger (vllm/entrypoints/logger.py: "Received request <id>: prompt: %r, ...", "Request
# <id> details: prompt: %r", "Generated response <id>: output: %r", "Received raw HTTP request
# <id>: <json>"), vLLM's note of request fields it ignored (its JSON keys), and uvicorn's access
# log ('<client> - "<method> <path> HTTP/1.1" <status>'). Their text is a prompt, a model's output
# or a request line: evidence of a request, never an out-of-memory incident, whatever it quotes.
# Matched on the whole physical line after its log prefix, before escaped newlines are split: a
# prompt's "\n" must not start a line of its own.
_REQUEST_RECORD = re.compile(
    r"""(?:Received\ request[ ]|Received\ raw\ HTTP\ request[ ]|Generated\ response[ ]
         |Request\ .{1,300}?\ details:\ prompt:
         |The\ following\ fields\ were\ present\ in\ the\ request\ but\ ignored:
         |[^\s"]{1,100}\ -\ "[A-Z]{1,16}\ [^\s"]{0,8192}\ HTTP/\d(?:\.\d)?"\ \d{3}\b)""",
    re.VERBOSE)
# vLLM's logger prefix at a routine level. vLLM reports out-of-memory failures as errors (and
# warnings); its INFO and DEBUG records are routine work, and many quote clients: request ids
# (a client may set its own), prompts, outputs, tool-call text.
_VLLM_ROUTINE = re.compile(
    r"\s*(?:INFO|DEBUG)\s\d{2}-\d{2}\s\d{2}:\d{2}:\d{2}(?:\.\d+)?\s(?:\[[\w.\-/]+:\d+\]|[\w.\-/]+:\d+\])")
_ROUTINE_WORDS = ("request", "response", "HTTP/", "INFO", "DEBUG")  # cheap test before any regex


def is_routine_record(text: str) -> bool:
    """Whether a physical log line is a record that cannot report an incident, whatever text it
    quotes: a client's request as vLLM's request logger or uvicorn's access log writes it, or
    any record vLLM's logger writes at INFO or DEBUG."""
    if not any(word in text for word in _ROUTINE_WORDS):
        return False
    text = _ANSI.sub("", text[:MAX_LINE_CHARS])
    for _ in range(8):  # the prefixes _strip() removes, looked at one by one
        m = _PREFIX.match(text)
        if not m or m.end() == 0:
            break
        if _VLLM_ROUTINE.match(m.group(0)):
            return True
        text = text[m.end():]
    return bool(_REQUEST_RECORD.match(text.strip()))


def strip_prefixes(text: str) -> str:
    """The line without leading log decorations (bounded number of passes)."""
    return _strip(text)[0]


def logical_lines(text: str) -> list[str]:
    """A physical line as the lines it stands for: colours removed, escaped newlines split."""
    text = _ANSI.sub("", text[:MAX_LINE_CHARS].rstrip("\r\n"))
    return _ESCAPED_NEWLINE.split(text) if "\\n" in text else [text]


_SECRET = re.compile(
    r"(?i)((?:bearer|basic)\s+)\S+"
    r"|((?:api[_-]?key|token|password|secret|authorization)\s*[=:]\s*(?:bearer\s+|basic\s+)?)\S+"
)


def _clean_message(text: str) -> str:
    """What a message keeps of the log text: one line, secrets masked, truncated."""
    text = " ".join(text.split())
    text = _SECRET.sub(lambda m: (m.group(1) or m.group(2)) + "<redacted>", text)
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 3] + "..."
    return text


# ---------------------------------------------------------------------- patterns

# Source lines a traceback prints (`raise ValueError("No available memory ...`, the string's
# next line, indented) quote messages without being them.
_SOURCE_LINE = re.compile(r"""^(?:raise\b|File\ "|\.\.\.<|\^)""", re.VERBOSE)
_STRING_LINE = re.compile(r"""^(?:f?["'])""")  # a string literal continuing a statement


def _is_source_line(body: str, indent: int) -> bool:
    return bool(_SOURCE_LINE.match(body)) or (indent >= 2 and bool(_STRING_LINE.match(body)))

# vLLM's own warm-up message wraps a torch OOM; checked before the torch pattern.
_VLLM_WARMUP = re.compile(
    r"CUDA out of memory occurred when warming up (sampler|pooler) with (\d+)")
_TORCH_START = re.compile(  # no \b: pasted titles glue it to the word before ("whyCUDA")
    r"(?:CUDA|HIP|NPU) out of memory(?! occurred)|Allocation on device \d+ would exceed allowed memory")
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
# vLLM's CPU backend (v1/worker/cpu_worker.py, 0.11+) checks the memory node, in three wordings:
# at start-up without an explicit KV size; before allocating an explicit KV size; before
# allocating an automatic one ("(kv/requested GiB)", kv <= 0 when the worker alone exceeds it).
_VLLM_CPU_STARTUP = re.compile(
    r"Available memory on node (\d{1,4})\s*\(\s*([\d.]+)\s*/\s*([\d.]+)\s*GiB\)\s*on startup is less than"
    r" desired CPU memory utilization\s*\(\s*([\d.]+)\s*,\s*([\d.]+)\s*GiB\)")
_VLLM_CPU_KV = re.compile(
    r"Available memory on node (\d{1,4})\s*\(\s*([\d.]+)\s*/\s*([\d.]+)\s*GiB\)\s*on kv cache\s*allocation is less"
    r" than requested memory for kv\s*\(\s*(-?[\d.]+)\s*(?:/\s*([\d.]+)\s*)?GiB\)")
_VLLM_WRAPPED_START = re.compile(
    r"Free memory on device|To serve at least one request with the model|Available memory on node \d")
_VLLM_ESTIMATED_LEN = re.compile(r"estimated maximum model length is (\d+)")
_SGLANG_NO_KV = re.compile(r"Not enough memory\. Please try to increase --mem-fraction-static")
_TGI_WARMUP = re.compile(r"Not enough memory to handle (\d+) (?:total tokens with \d+ )?prefill tokens")
_CUDA_RUNTIME = re.compile(
    r"CUDA error: out of memory|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED"
    r"|CUDA_ERROR_OUT_OF_MEMORY|CUDA driver error: out of memory|HIP error: out of memory"
    r"|hipErrorOutOfMemory|cudaMalloc failed: out of memory"
)
_NCCL = re.compile(
    r"Cuda failure(?: \d+)? 'out of memory'"
    r"|Failed to CUDA calloc(?: async)? \d+ bytes"
    r"|(?:ncclSystemError|ncclUnhandledCudaError)\b.{0,300}?\bout of memory\b"
)
_NCCL_CALLOC = re.compile(r"Failed to CUDA calloc(?: async)? (\d+) bytes")
_NCCL_DEVICE = re.compile(r"^[\w.\-]+:\d+:\d+ \[(\d+)\]")  # host:pid:tid [cuda device]
_HOST_PY = re.compile(r"^(?:builtins\.)?MemoryError(?::|$)")
_HOST_CPU_ALLOC = re.compile(
    r"DefaultCPUAllocator: (?:not enough memory|can't allocate memory): you tried to allocate"
    r" (\d+) bytes"
)
_CONTAINER_OOM = re.compile(
    r"\bReason:\s+OOMKilled\b|\"reason\"\s*:\s*\"OOMKilled\"|\"OOMKilled\"\s*:\s*true\b"
    r"|\s\d+/\d+\s+OOMKilled\s|\bcontainer oom [0-9a-f]{12,64}\b"
)
_KUBELET_OOM = re.compile(r"\b(System|Cgroup) OOM encountered(?:, victim process: (.{1,64}?), pid: (\d+))?")
_RAY_KILLED = re.compile(
    r"Task was killed due to the node running low on memory|killed due to memory pressure \(OOM\)")
_RAY_NODE = re.compile(r"Memory on the node \(IP: ")
_RAY_USAGE = re.compile(r"\bwas running was ([\d.]{1,12})GB / ([\d.]{1,12})GB")
_RAY_TASK = re.compile(r"\bname=([^,()]{1,64}), pid=(\d+), memory used=([\d.]{1,12})GB")
_RAY_THRESHOLD = re.compile(r"memory usage threshold of (\d(?:\.\d{1,6})?)")

# The kernel's OOM report.
_INVOKED = re.compile(r"^(\S{1,64}) invoked oom-killer:")
_OOM_KILL_LINE = re.compile(r"\boom-kill:constraint=(\w+)")
_OOM_HEAD = re.compile(r"\b(Memory cgroup out of memory|Out of memory(?: \(oom_kill_allocating_task\))?):")
_KILLED = re.compile(r"\bKilled process (\d+) \((.{1,64}?)\)(?=[ ,]|$)")
_CHOSEN = re.compile(r"\bKill process (\d+) \((.{1,64}?)\) score")  # older kernels, before the kill
_MEMCG_TRACE = re.compile(r"\bmem_cgroup_(?:out_of_memory|oom_synchronize)\b")
_KILL_COMPLETE = re.compile(r"\bshmem-rss:[\d,]+\s?kB|\boom_score_adj:-?\d")  # the kill line's end
_KERNEL_CONTINUATION = re.compile(r"^(?:[\d,]*\s?kB\b|[a-z_\-]{1,32}[=:]\S)")
_RSS = re.compile(r"\b(anon-rss|file-rss|shmem-rss):([\d,]{1,20})\s?kB")


def _vllm_startup_match(text: str) -> re.Match[str] | None:
    return (_VLLM_FREE.search(text) or _VLLM_MAX_LEN_V1.search(text) or _VLLM_CPU_STARTUP.search(text)
            or _VLLM_CPU_KV.search(text))


def _gib(number: str) -> int | None:
    """A size vLLM printed in GiB with format_gib (rounded to 2 decimals): None where it printed
    0 (anything below 0.005 GiB, about 5 MiB: the size is unknown, not zero)."""
    value = bytes_in_message(number.lstrip("-"), "GiB")
    return value if value else None


# ------------------------------------------------------------------ PyTorch messages

@dataclass
class TorchNumbers:
    """Every number a PyTorch allocator message states."""

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
    processes_listed: bool = False
    allocator_hint: str = ""


_HINT = re.compile(r"(PYTORCH_\w{0,10}ALLOC_CONF=expandable_segments:True|max_split_size_mb)")


def parse_torch_message(text: str, log_pid: int | None = None) -> TorchNumbers:
    """Every number a PyTorch out-of-memory message carries (the 2.x, 1.x and table shapes).
    `log_pid` is the pid the log prefix names, which tells this process in the process list."""
    n = TorchNumbers()
    if re.search(r"Tried to allocate more than 1EB", text):  # an overflowed size
        n.requested = EXBIBYTE
    else:
        n.requested = _size_after(r"Tried to allocate " + _SIZE, text)
    hint = _HINT.search(text)
    n.allocator_hint = hint.group(1) if hint else ""
    m = re.search(r"GPU (\d+) has a total capac(?:i)?ty of " + _SIZE + r" of which " + _SIZE
                  + r" is free", text)
    cut = re.search(r"GPU (\d+) has a total capac", text)  # the GPU, even from a cut message
    if cut:
        n.gpu = cut.group(1)
    if m:  # PyTorch >= 2.1 (2.1 spelt it "capacty")
        n.total = bytes_in_message(m.group(2), m.group(3))
        n.free = bytes_in_message(m.group(4), m.group(5))
        if "capacty" in m.group(0) and not n.allocator_hint:
            n.allocator_hint = "max_split_size_mb"
        for pid, num, unit in re.findall(r"Process (\d+) has " + _SIZE + r" memory in use", text):
            size = bytes_in_message(num, unit)
            if size is not None:
                n.processes.append((int(pid), size))
        n.self_bytes = _size_after(r"this process has " + _SIZE + r" memory in use", text)
        n.processes_listed = bool(n.processes) or n.self_bytes is not None
        n.allocated = _size_after(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch",
                                  text)
        n.reserved_unallocated = _size_after(
            r"and " + _SIZE + r" is reserved by PyTorch but unallocated", text)
        if n.allocated is not None and n.reserved_unallocated is not None:
            n.reserved = n.allocated + n.reserved_unallocated
    elif "Allocation on device" in text:  # with a memory fraction set (PyTorch 2.0, TGI)
        g = re.search(r"Allocation on device (\d+)", text)
        n.gpu = g.group(1) if g else None
        n.requested = _size_after(r"Requested\s*:\s*" + _SIZE, text)
        n.total = _size_after(r"Device limit\s*:\s*" + _SIZE, text)
        n.free = _size_after(r"Free \(according to CUDA\)\s*:\s*" + _SIZE, text)
        n.allocated = _size_after(r"Currently allocated\s*:\s*" + _SIZE, text)
        n.allowed = _size_after(r"PyTorch limit \(set by user-supplied memory fraction\)\s*:\s*"
                                + _SIZE, text)
        n.allocator_hint = n.allocator_hint or "max_split_size_mb"
    else:  # PyTorch 1.x / 2.0: "(GPU 0; 15.78 GiB total capacity; 14.56 GiB already allocated; ..."
        n.allocator_hint = n.allocator_hint or "max_split_size_mb"
        g = re.search(r"\((?:GPU|NPU) (\d+);", text)
        n.gpu = g.group(1) if g else n.gpu
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
    if n.allowed is None:
        n.allowed = _size_after(_SIZE + r" allowed;", text)
    _separate_self(n, log_pid)
    return n


def _separate_self(n: TorchNumbers, log_pid: int | None) -> None:
    """Inside a container PyTorch cannot recognise its own PID (NVML reports host PIDs), so it
    lists itself as "Process N" and prints no "this process" line. Which listed process is this
    one: the pid the log prefix names when it is listed (no container), else the one holding at
    least what PyTorch reserved (its pool is part of its use), the least such."""
    if n.self_bytes is not None or not n.processes:
        return
    me = next((p for p in n.processes if p[0] == log_pid), None)
    if me is None and n.reserved is not None:
        candidates = [p for p in n.processes if p[1] >= n.reserved * 0.99]  # printed rounded
        me = min(candidates, key=lambda p: p[1]) if candidates else None
    if me is not None:
        n.self_bytes = me[1]
        n.processes = [p for p in n.processes if p is not me]


def _torch_complete(text: str) -> bool:
    """The message's numbers are all there (its trailing hint may still follow)."""
    return ("reserved by PyTorch but unallocated" in text
            or "reserved in total by PyTorch)" in text
            or bool(re.search(r"\((?:GPU|NPU) \d+;[^)]*cached\)", text)))


def _torch_finished(text: str) -> bool:
    """Nothing of the message is left to come: the numbers and PyTorch's closing hint."""
    return _torch_complete(text) and (
        text.endswith("environment-variables)")
        or text.endswith("Memory Management and PYTORCH_CUDA_ALLOC_CONF"))


# A line that carries on a wrapped PyTorch message (after its log prefix is stripped).
_TORCH_CONTINUATION = re.compile(
    r"^(?:\d+(?:\.\d+)?\s*(?:bytes|B|KiB|MiB|GiB|TiB)\b|GPU \d|Process \d|Including non-PyTorch"
    r"|this process|Of the allocated|is allocated|is reserved|is free|and \d|with \d|reserved"
    r"|If reserved|PYTORCH_\w*ALLOC_CONF|to avoid|fragmentation|See documentation"
    r"|for Memory Management|Management|\(?https?://|\((?:GPU|NPU)|total capac|of which|already allocated"
    r"|free;|allowed;|memory in use|in total by|max_split_size_mb|Tried to allocate|has a total"
    r"|Currently allocated|Requested\s|Device limit|Free \(according|PyTorch limit|:\s*\d)"
)


# ------------------------------------------------------------------ the parser

@dataclass
class _Pending:
    """A message that may continue on the next lines."""

    kind: str
    line: int
    last_line: int
    text: str
    lines: int = 1
    pid: int | None = None  # the pid its log prefix names


@dataclass
class _KernelReport:
    """The kernel's OOM report, gathered from its lines (other messages may interleave)."""

    line: int  # where it started
    last_line: int
    kill_line: int | None = None  # the first line that names the kill
    text: str = ""
    killed: bool = False
    memcg: bool = False  # the call trace shows a memory cgroup's OOM


class OomParser:
    """Incremental parser: `feed(line_no, text)` returns the messages finished so far,
    `flush()` those still open. Never raises on any input."""

    def __init__(self, source: str = ""):
        self.source = source
        self._pending: _Pending | None = None
        self._kernel: _KernelReport | None = None
        # (first line, last line, signature) of recent messages
        self._recent: list[tuple[int, int, tuple[object, ...]]] = []
        self._settings = SettingsReader()  # the server's settings, from its own lines
        self._last_line = 0
        self.faults = 0  # lines dropped because the parser itself failed (a bug, counted)
        self.routine_records = 0  # lines skipped as routine records (is_routine_record)

    def feed(self, line_no: int, text: str) -> list[OomMessage]:
        try:
            return self._feed(line_no, text)
        except Exception:  # a parser bug must not take the daemon down; drop the line
            self._pending = self._kernel = None
            self.faults += 1
            return []

    def flush(self) -> list[OomMessage]:
        """Finish the open messages (end of file, or the log went quiet)."""
        try:
            return self._finish_pending() + self._emit(self._finish_kernel())
        except Exception:
            self._pending = self._kernel = None
            self.faults += 1
            return []

    # -- internals

    def _feed(self, line_no: int, text: object) -> list[OomMessage]:
        if not isinstance(text, str):  # callers may pass bytes or None despite the annotation
            return []
        out: list[OomMessage] = []
        if line_no <= self._last_line:  # the file was truncated or rotated: start over
            out += self.flush()
            self._recent.clear()
        self._last_line = line_no
        if is_routine_record(text):
            self.routine_records += 1
            # No incident, but vLLM's own INFO records say how the server was started (its
            # non-default args, the CPU backend's KV cache line): read for the advice. A client's
            # request, quoted by the request logger or the access log, never is.
            body = _strip(logical_lines(text)[0])[0]
            if not _REQUEST_RECORD.match(body.strip()):
                self._settings.feed(body)
            return out
        for part in logical_lines(text):
            out += self._feed_part(line_no, part)
        return out

    def _feed_part(self, line_no: int, text: str) -> list[OomMessage]:
        body, pid, indent = _strip(text)
        self._settings.feed(body)
        out, consumed = self._kernel_line(line_no, body)
        if consumed:
            return out
        if self._pending is not None:
            if not body and self._pending.kind in ("nccl_oom", "vllm_startup", "ray_oom_kill"):
                return out  # blank lines separate NCCL's warnings; wait for the next
            if self._continue(line_no, body):
                if self._pending is not None and self._done(self._pending):
                    out += self._finish_pending()
                return out
            out += self._finish_pending()
        if not _is_source_line(body, indent):
            out += self._emit(self._start(line_no, body, pid), pid)
        if self._pending is not None and self._done(self._pending):
            out += self._finish_pending()
        return out

    def _finish_pending(self) -> list[OomMessage]:
        pid = self._pending.pid if self._pending is not None else None
        return self._emit(self._finish(), pid)

    def _emit(self, message: OomMessage | None, pid: int | None = None) -> list[OomMessage]:
        """The message unless it repeats one just reported: the same numbers (a traceback
        re-prints its exception, a server re-raises a worker's), or, for a message without
        numbers, the same text from the same process."""
        if message is None:
            return []
        numbers = (message.gpu, message.requested_bytes, message.total_bytes, message.free_bytes,
                   message.reserved_unallocated_bytes, message.other_processes, message.process_bytes,
                   message.victim_pid, message.max_model_len, message.max_model_len_fits,
                   message.memory_node)
        numbered = any(n not in (None, ()) for n in numbers[1:])
        signature = (message.kind, *numbers, "" if numbered else message.message, None if numbered else pid)
        line = message.line
        self._recent = [r for r in self._recent if line - r[1] <= DEDUPE_WINDOW_LINES]
        for i, (first, _, sig) in enumerate(self._recent):
            if sig == signature and line - first <= DEDUPE_CHAIN_LINES:
                self._recent[i] = (first, line, sig)  # the chain goes on from this copy
                return []
        self._recent.append((line, line, signature))
        settings = self._settings.settings
        return [replace(message, settings=settings) if not settings.empty else message]

    def _message(self, kind: str, line: int, text: str, **numbers: Any) -> OomMessage:
        return OomMessage(kind=kind, line=line, source=self.source, message=_clean_message(text),
                          **numbers)

    def _start(self, line_no: int, body: str, pid: int | None) -> OomMessage | None:
        """Recognise the first line of a message; single-line messages finish here."""
        m = _VLLM_WARMUP.search(body)
        if m:
            return self._message("vllm_insufficient_memory", line_no, body, batch=int(m.group(2)))
        if _TORCH_START.search(body):
            self._pending = _Pending("torch_cuda_oom", line_no, line_no, body, pid=pid)
            return None
        if _VLLM_WRAPPED_START.search(body):
            # vLLM's start-up checks print one line, but log shippers and terminals wrap them.
            self._pending = _Pending("vllm_startup", line_no, line_no, body, pid=pid)
            return None
        if _VLLM_FREE_LOOSE.search(body):
            return self._vllm_free(line_no, body, None)
        m = _VLLM_MAX_LEN_OLD.search(body)
        if m:
            return self._message("vllm_kv_cache_too_small", line_no, body,
                                 max_model_len=int(m.group(1)), max_model_len_fits=int(m.group(2)))
        if _VLLM_NO_CACHE.search(body):
            return self._message("vllm_kv_cache_too_small", line_no, body)
        if _SGLANG_NO_KV.search(body):
            return self._message("sglang_kv_cache_too_small", line_no, body)
        m = _TGI_WARMUP.search(body)
        if m:
            return self._message("tgi_warmup_oom", line_no, body, batch=int(m.group(1)))
        if _NCCL.search(body):
            self._pending = _Pending("nccl_oom", line_no, line_no, body, pid=pid)
            return None
        if _CUDA_RUNTIME.search(body):
            return self._message("cuda_runtime_oom", line_no, body)
        if _RAY_KILLED.search(body) or _RAY_NODE.search(body):
            self._pending = _Pending("ray_oom_kill", line_no, line_no, body, pid=pid)
            return None
        m = _KUBELET_OOM.search(body)
        if m:
            kind = "kernel_oom_kill" if m.group(1) == "System" else "cgroup_oom"
            return self._message(kind, line_no, body, victim_name=m.group(2) or "",
                                 victim_pid=int(m.group(3)) if m.group(3) else None)
        if _CONTAINER_OOM.search(body):
            return self._message("container_oom_killed", line_no, body)
        m = _HOST_CPU_ALLOC.search(body)
        if m:
            return self._message("host_memory_error", line_no, body, requested_bytes=int(m.group(1)))
        if _HOST_PY.search(body) and not re.search(r"OutOfMemoryError|out of memory", body):
            return self._message("host_memory_error", line_no, body)
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
                return self._merge(p, line_no, " " + body)
            return False
        if p.kind == "vllm_startup":
            if (line_no - p.last_line <= 2 and not _VLLM_WRAPPED_START.search(body)
                    and not _vllm_startup_match(p.text)
                    and (re.match(r"^[a-z0-9(]", body) or "GiB" in body)):
                # A terminal wraps mid-word ("KV cach" / "e is needed"): join without a space
                # when only that makes the check's sentence whole.
                glued = p.text + body
                return self._merge(p, line_no, body if _vllm_startup_match(glued)
                                   and not _vllm_startup_match(p.text + " " + body) else " " + body)
            return False
        if p.kind == "nccl_oom":
            if line_no - p.last_line <= 3 and _NCCL.search(body):
                return body in p.text or self._merge(p, line_no, " | " + body)
            return False
        if p.kind == "ray_oom_kill":
            if line_no - p.last_line <= 2 and _RAY_NODE.search(body) and "Memory on the node" not in p.text:
                return self._merge(p, line_no, " " + body)
            return False
        return False

    @staticmethod
    def _merge(p: _Pending, line_no: int, addition: str) -> bool:
        p.text = (p.text + addition)[:MAX_PENDING_CHARS]
        p.lines += 1
        p.last_line = line_no
        return True

    def _done(self, p: _Pending) -> bool:
        if p.kind == "torch_cuda_oom":
            return _torch_finished(p.text)
        if p.kind == "vllm_startup":
            return _vllm_startup_match(p.text) is not None
        if p.kind == "ray_oom_kill":
            return "Memory on the node" in p.text and _RAY_USAGE.search(p.text) is not None
        return False

    def _finish(self) -> OomMessage | None:
        p, self._pending = self._pending, None
        if p is None:
            return None
        if p.kind == "torch_cuda_oom":
            n = parse_torch_message(p.text, p.pid)
            return self._message(
                "torch_cuda_oom", p.line, p.text, gpu=n.gpu, requested_bytes=n.requested,
                total_bytes=n.total, free_bytes=n.free, allocated_bytes=n.allocated,
                reserved_bytes=n.reserved, reserved_unallocated_bytes=n.reserved_unallocated,
                process_bytes=n.self_bytes, other_processes=tuple(n.processes),
                processes_listed=n.processes_listed, allowed_bytes=n.allowed,
                allocator_hint=n.allocator_hint)
        if p.kind == "vllm_startup":
            m = _VLLM_FREE.search(p.text)
            if m:
                return self._vllm_free(p.line, p.text, m)
            m = _VLLM_MAX_LEN_V1.search(p.text)
            if m:
                return self._vllm_kv_v1(p.line, p.text, m)
            m = _VLLM_CPU_STARTUP.search(p.text) or _VLLM_CPU_KV.search(p.text)
            if m:
                return self._vllm_cpu(p.line, p.text, m)
            if _VLLM_FREE_LOOSE.search(p.text):
                return self._vllm_free(p.line, p.text, None)
            return None  # "Free memory on device" in an informational line: not a failure
        if p.kind == "nccl_oom":
            calloc = _NCCL_CALLOC.search(p.text)
            device = _NCCL_DEVICE.search(p.text)
            return self._message("nccl_oom", p.line, p.text,
                                 gpu=device.group(1) if device else None,
                                 requested_bytes=int(calloc.group(1)) if calloc else None)
        if p.kind == "ray_oom_kill":
            return self._ray(p)
        return None

    def _vllm_free(self, line_no: int, body: str, m: re.Match[str] | None) -> OomMessage:
        if not m:
            return self._message("vllm_insufficient_memory", line_no, body)
        g = re.search(r"(\d+)$", m.group(1) or "")
        try:
            utilization: float | None = float(m.group(4))
        except ValueError:
            utilization = None
        return self._message(
            "vllm_insufficient_memory", line_no, body, gpu=g.group(1) if g else None,
            free_bytes=bytes_in_message(m.group(2), "GiB"),
            total_bytes=bytes_in_message(m.group(3), "GiB"),
            requested_bytes=bytes_in_message(m.group(5), "GiB"),
            gpu_memory_utilization=utilization)

    def _vllm_kv_v1(self, line_no: int, body: str, m: re.Match[str]) -> OomMessage:
        max_len = int(m.group(1))
        # vLLM prints GiB rounded to 2 decimals: "0.0" is any size below about 5 MiB, unknown.
        needed = _gib(m.group(2)) if not m.group(2).startswith("-") else None
        # A negative "available" (weights alone exceed the budget) means none.
        available = 0 if m.group(3).startswith("-") else _gib(m.group(3))
        explicit = self._settings.settings.kv_cache_memory_bytes
        if available is None and explicit is not None:
            available = explicit  # an explicit KV size is exactly the memory the KV cache gets
        est = _VLLM_ESTIMATED_LEN.search(body)
        if est:
            fits = int(est.group(1))
        elif needed and available is not None:
            fits = int(max_len * available / needed)
        else:
            fits = 0
        return self._message("vllm_kv_cache_too_small", line_no, body, requested_bytes=needed,
                             free_bytes=available, max_model_len=max_len, max_model_len_fits=fits)

    def _vllm_cpu(self, line_no: int, body: str, m: re.Match[str]) -> OomMessage:
        """The CPU backend's checks of its memory node: available/total, and what it wanted (the
        utilisation's share of the node, or the KV cache; with an automatic size also the
        worker's whole request, whose difference is what the worker itself already used)."""
        node, available, total = m.group(1), _gib(m.group(2)), _gib(m.group(3))
        if m.re is _VLLM_CPU_STARTUP:
            try:
                utilization: float | None = float(m.group(4))
            except ValueError:
                utilization = None
            return self._message("vllm_cpu_memory_check", line_no, body, memory_node=node,
                                 free_bytes=available, total_bytes=total, requested_bytes=_gib(m.group(5)),
                                 gpu_memory_utilization=utilization)
        kv = m.group(4)
        if m.group(5) is None:  # an explicit KV size
            return self._message("vllm_cpu_memory_check", line_no, body, memory_node=node,
                                 free_bytes=available, total_bytes=total, requested_bytes=_gib(kv))
        # Automatic: "(kv/requested GiB)", requested = utilisation x node, kv = requested less what
        # the worker already holds (<= 0 when the worker alone used all of it).
        requested = _gib(m.group(5))
        kv_magnitude = bytes_in_message(kv.lstrip("-"), "GiB") or 0
        kv_signed = -kv_magnitude if kv.startswith("-") else kv_magnitude
        consumed = requested - kv_signed if requested is not None else None
        return self._message("vllm_cpu_memory_check", line_no, body, memory_node=node,
                             free_bytes=available, total_bytes=total,
                             requested_bytes=kv_signed if kv_signed > 0 else None,
                             process_bytes=consumed if consumed is not None and consumed > 0 else None,
                             allowed_bytes=requested)

    def _ray(self, p: _Pending) -> OomMessage:
        usage, task = _RAY_USAGE.search(p.text), _RAY_TASK.search(p.text)
        threshold = _RAY_THRESHOLD.search(p.text)
        used, total = ((bytes_in_message(usage.group(1), "GB"), bytes_in_message(usage.group(2), "GB"))
                       if usage else (None, None))
        return self._message(
            "ray_oom_kill", p.line, p.text, total_bytes=total,
            free_bytes=total - used if total is not None and used is not None else None,
            victim_pid=int(task.group(2)) if task else None,
            victim_name=task.group(1) if task else "",
            process_bytes=bytes_in_message(task.group(3), "GB") if task else None,
            memory_limit=f"Ray's threshold {threshold.group(1)}" if threshold else "")

    # -- the kernel's report

    def _kernel_line(self, line_no: int, body: str) -> tuple[list[OomMessage], bool]:
        """Feed a line to the kernel report: the reports it finished, and whether the line
        belonged to one (else the other messages get to see it)."""
        k = self._kernel
        out: list[OomMessage] = []
        if k is not None and line_no - k.line > KERNEL_REPORT_LINES:
            out += self._emit(self._finish_kernel())
            k = None
        if k is not None and not k.killed and _MEMCG_TRACE.search(body):
            k.memcg = True
        invoked = _INVOKED.search(body)
        names_kill = bool(_OOM_KILL_LINE.search(body) or _OOM_HEAD.search(body)
                          or _KILLED.search(body))
        if invoked or names_kill:
            if k is not None and (k.killed or (invoked and k.kill_line is not None)):
                out += self._emit(self._finish_kernel())  # a new report begins
                k = None
            if k is None:
                k = self._kernel = _KernelReport(line=line_no, last_line=line_no)
            if names_kill and k.kill_line is None:
                k.kill_line = line_no
            k.killed = k.killed or bool(_KILLED.search(body))
            self._kernel_text(k, line_no, body)
        elif k is not None and line_no == k.last_line + 1 and k.kill_line is not None \
                and _KERNEL_CONTINUATION.match(body):
            self._kernel_text(k, line_no, body)  # a hard-wrapped part of the kill lines
        else:
            if k is not None and k.killed:
                out += self._emit(self._finish_kernel())
            return out, False
        kill = _KILLED.search(k.text)
        if kill and _KILL_COMPLETE.search(k.text, kill.start()):
            out += self._emit(self._finish_kernel())
        return out, True

    @staticmethod
    def _kernel_text(k: _KernelReport, line_no: int, body: str) -> None:
        if len(k.text) < MAX_PENDING_CHARS:
            k.text = (k.text + " | " + body if k.text else body)[:MAX_PENDING_CHARS]
        k.last_line = line_no

    def _finish_kernel(self) -> OomMessage | None:
        k, self._kernel = self._kernel, None
        if k is None:
            return None
        text = k.text
        head = _OOM_HEAD.search(text)
        constraint = _OOM_KILL_LINE.search(text)
        cgroup = k.memcg or bool(head and head.group(1).startswith("Memory cgroup")) or bool(
            constraint and constraint.group(1) == "CONSTRAINT_MEMCG")
        killed = _KILLED.search(text) or _CHOSEN.search(text)
        task = re.search(r"\btask=([^,\s|]{1,64})", text)
        pid = re.search(r"\boom-kill:[^|]*?\bpid=(\d+)", text)
        memcg = re.search(r"\boom_memcg=([^,\s|]{1,200})", text)
        rss = None
        if killed:
            parts = _RSS.findall(text[killed.start():])
            if parts:
                rss = sum(int(v.replace(",", "")) * 1024 for _, v in parts)
        victim_pid: int | None
        if killed:
            victim_pid, victim = int(killed.group(1)), killed.group(2)
        else:
            victim_pid = int(pid.group(1)) if pid else None
            victim = task.group(1) if task else ""
        return self._message(
            "cgroup_oom" if cgroup else "kernel_oom_kill", k.kill_line or k.line, text,
            process_bytes=rss, victim_pid=victim_pid, victim_name=victim,
            memory_limit=memcg.group(1) if memcg else "")


def parse_lines(lines: Iterable[str], source: str = "") -> list[OomMessage]:
    """Every OOM message in `lines` (line numbers 1-based)."""
    parser = OomParser(source)
    messages: list[OomMessage] = []
    for number, text in enumerate(lines, start=1):
        messages += parser.feed(number, text)
    messages += parser.flush()
    return messages
