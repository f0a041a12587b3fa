"""gpu-memory-probe: PyTorch's CUDA allocator, reported from inside vLLM's processes.

vLLM calls every `vllm.general_plugins` entry point in every process it starts (API server,
engine core, workers), before CUDA is initialised and possibly more than once. `register` is
that entry point: idempotent, cheap, and it never raises into vLLM.
"""
from __future__ import annotations

__version__ = "0.1.0"


def register() -> None:
    """Start this process's probe if `GPUMEM_PROBE_DIR` names a directory; else do nothing."""
    try:
        from .probe import start

        start()
    except Exception:
        pass
