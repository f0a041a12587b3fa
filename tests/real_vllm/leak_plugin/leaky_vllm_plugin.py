"""Test only: a vLLM general plugin that makes the engine core keep host memory for every request
it is given, for tests/real_vllm/test_real_leak.py (a real leak in a real vLLM, for the exporter
to find from /proc).

Inert unless the server's environment sets GPUMEM_TEST_LEAK_FILE (installed in the tests' vLLM
environment, it is loaded by every server there). With it set, vLLM's `EngineCore.add_request`
keeps GPUMEM_TEST_LEAK_BYTES (default 1 MiB, written so the pages are resident) for every
request while that file exists, and lets go of all of it once the file is gone: the test turns
the leak on and off without restarting the server.
"""
from __future__ import annotations

import os

_kept: list[bytes] = []


def register() -> None:
    control = os.environ.get("GPUMEM_TEST_LEAK_FILE", "")
    if not control:
        return
    size = int(os.environ.get("GPUMEM_TEST_LEAK_BYTES", str(1 << 20)))
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception:  # another vLLM layout: nothing to patch
        return
    original = EngineCore.add_request
    if getattr(original, "_leaky_vllm_plugin", False):  # vLLM may load plugins twice in a process
        return

    def add_request(self, request, request_wave=0):  # type: ignore[no-untyped-def]
        if os.path.exists(control):
            _kept.append(b"\x01" * size)
        elif _kept:
            _kept.clear()
        return original(self, request, request_wave)

    add_request._leaky_vllm_plugin = True  # type: ignore[attr-defined]
    EngineCore.add_request = add_request  # type: ignore[method-assign]
