"""A vLLM server's own settings, as its log states them: what `explain` and the daemon need so
that advice never suggests what is already set (a tensor-parallel size it has, a knob that
sizes nothing).

Read from, in order of trust (a later line of the same start replaces an earlier value):
- the command line, where the log shows it: `vllm serve MODEL --tensor-parallel-size 2 ...` or
  `python -m vllm.entrypoints.openai.api_server --model ...` (a launcher's echo, a shell trace);
- vLLM's `non-default args: {...}` line (entrypoints' api_utils, 0.6+), a Python dict repr;
- the engine's `Initializing a V1 LLM engine (...) with config: ..., tensor_parallel_size=2, ...`;
- the CPU backend's KV cache lines (v1/worker/cpu_worker.py): `Explicitly set (0.03/10.96) GiB
  for KV cache on node 0.` (an explicit size: `--kv-cache-memory-bytes` or the legacy
  `VLLM_CPU_KVCACHE_SPACE`, which vLLM turns into the former) or `Auto set (...)` (sized from
  `--gpu-memory-utilization` of the memory node), and `CPU KV cache size: N tokens`.

A new start's `non-default args` or command line replaces what an earlier start said; the
engine's config line states the sizes it really runs with (defaults included), so it wins.
Every outside value is bounded: lines are cut, numbers range-checked, and the dict repr is
parsed by `ast.literal_eval` only when short.
"""
from __future__ import annotations

import ast
import re
import shlex
from dataclasses import replace

from ..model import ServerSettings

MAX_ARGS_CHARS = 8192  # a non-default args line longer than this is not parsed
MAX_INT = 1 << 62

_NON_DEFAULT = re.compile(r"non-default args: (\{.*\})\s*$")
# At the start of a line (after log prefixes), a shell prompt or trace, or a path: never the
# same words inside a sentence ("Restart vllm serve with --enable-scale-out ...").
_COMMAND = re.compile(r"^(?:[$#+>]\s*)?(?:\S*/)?"
                      r"(?:vllm\s+serve|python[\d.]*\s+-m\s+vllm\.entrypoints\.openai\.api_server)(\s.*)?$")
_ENGINE_CONFIG = re.compile(r"Initializing a V1 LLM engine|Initializing an LLM engine")
_ENGINE_INT = re.compile(r"\b(tensor_parallel_size|pipeline_parallel_size|data_parallel_size|max_seq_len)=(\d{1,9})\b")
_CPU_KV = re.compile(r"\b(Explicitly|Auto) set \(([\d.]+)/([\d.]+)\) GiB for KV cache on node (\d+)")
_CPU_KV_TOKENS = re.compile(r"\bCPU KV cache size: [\d,]+ tokens")

# Option name (command line, with - or _) or non-default args key -> settings field.
_FIELDS = {
    "tensor_parallel_size": "tensor_parallel_size", "tp": "tensor_parallel_size",
    "pipeline_parallel_size": "pipeline_parallel_size", "pp": "pipeline_parallel_size",
    "data_parallel_size": "data_parallel_size", "dp": "data_parallel_size",
    "max_model_len": "max_model_len",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes", "kv_cache_memory": "kv_cache_memory_bytes",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "kv_cache_dtype": "kv_cache_dtype",
    "quantization": "quantization",
    "enable_sleep_mode": "sleep_mode",
}
_INTS = {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "max_model_len",
         "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens"}
_SIZE_SUFFIX = re.compile(r"^(\d{1,15})([kKmMgGtT]?)$")  # --kv-cache-memory-bytes 32G, --max-model-len 32k
_SUFFIX = {"": 1, "k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "t": 1000 ** 4,
           "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# The words a line must hold for any rule here to apply (most log lines hold none).
_KEYWORDS = ("non-default args", "vllm", "LLM engine", "KV cache")


class SettingsReader:
    """Fed one log line at a time, its log prefixes stripped (oom_messages.strip_prefixes: a
    command line counts only at the start of one); keeps the settings of the latest start."""

    def __init__(self) -> None:
        self.settings = ServerSettings()

    def feed(self, text: str) -> None:
        if not any(word in text for word in _KEYWORDS):
            return
        text = text[:MAX_ARGS_CHARS + 200]
        if match := _NON_DEFAULT.search(text):
            self.settings = _from_dict(match.group(1), ServerSettings(source="non-default args"))
            return
        if match := _COMMAND.search(text):
            self.settings = _from_command(match.group(1) or "", ServerSettings(source="command line"))
            return
        if _ENGINE_CONFIG.search(text):
            self.settings = _from_engine_config(text, self.settings)
            return
        if match := _CPU_KV.search(text):
            self.settings = replace(self.settings, backend="cpu", memory_node=match.group(4),
                                    kv_cache_explicit=match.group(1) == "Explicitly")
            return
        if _CPU_KV_TOKENS.search(text):
            self.settings = replace(self.settings, backend="cpu")


def _number(field: str, value: object) -> int | float | str | bool | None:
    """A settings value from the log, checked; None when it is not one."""
    if field == "gpu_memory_utilization":
        try:
            f = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
        return f if 0 < f <= 1 else None
    if field in _INTS:
        if isinstance(value, bool):
            return None
        if isinstance(value, str):
            m = _SIZE_SUFFIX.match(value.strip())
            if not m:
                return None
            value = int(m.group(1)) * _SUFFIX[m.group(2)]
        if not isinstance(value, int) or not 0 < value < MAX_INT:
            return None
        return value
    if field == "sleep_mode":
        return value is True or str(value).lower() in ("true", "1", "")
    if isinstance(value, str) and len(value) <= 64:
        return value
    return None


def _from_dict(text: str, base: ServerSettings) -> ServerSettings:
    if len(text) > MAX_ARGS_CHARS:
        return base
    try:
        args = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return base
    if not isinstance(args, dict):
        return base
    found: dict[str, object] = {}
    for key, value in args.items():
        field = _FIELDS.get(str(key))
        if field is not None and (checked := _number(field, value)) is not None:
            found[field] = checked
    return replace(base, **found)  # type: ignore[arg-type]


def _from_command(text: str, base: ServerSettings) -> ServerSettings:
    try:
        words = shlex.split(text[:MAX_ARGS_CHARS], posix=True)
    except ValueError:
        words = text[:MAX_ARGS_CHARS].split()
    found: dict[str, object] = {}
    for i, word in enumerate(words):
        if not word.startswith("-"):
            continue
        name, _, inline = word.lstrip("-").partition("=")
        field = _FIELDS.get(name.replace("-", "_"))
        if field is None:
            continue
        if field == "sleep_mode":
            found[field] = True
            continue
        value = inline if inline else (words[i + 1] if i + 1 < len(words) else "")
        if (checked := _number(field, value)) is not None:
            found[field] = checked
    return replace(base, **found)  # type: ignore[arg-type]


def _from_engine_config(text: str, base: ServerSettings) -> ServerSettings:
    """The engine's config line: the parallel sizes and max_seq_len it runs with (defaults and
    what it derived included)."""
    found: dict[str, object] = {}
    for key, value in _ENGINE_INT.findall(text):
        field = "max_model_len" if key == "max_seq_len" else key
        if (checked := _number(field, int(value))) is not None:
            found[field] = checked
    return replace(base, **found)  # type: ignore[arg-type]
