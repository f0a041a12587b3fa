"""A real vLLM server (PyPI's CPU build, in `.venv-vllm`) on loopback, for the real_vllm tests,
tests/fixtures/vllm/capture_real.py and bench/probe_vllm_throughput.py: the environment, the
tiny model, the server configurations, and starting and stopping a server. How a server is
started (command line, environment, the tests' flags) is scripts/vllm_cpu.py's, which people
run to try the exporter against a real vLLM.

Only the standard library and psutil: it runs in the exporter's environment and drives vLLM's
Python (another environment) through subprocesses.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import vllm_cpu  # noqa: E402  (scripts/ is no package: people run its files)

REQUIREMENTS = REPO / "tests" / "real_vllm" / "requirements.txt"
FIXTURES = REPO / "tests" / "fixtures" / "vllm"
MiB = vllm_cpu.MiB
GiB = 1 << 30

# A start takes 25-120 s on two idle cores (imports, then the engine core and its worker are
# spawned and import again). These bound a hang, not the time a start should take.
START_TIMEOUT = 900.0
STOP_TIMEOUT = 60.0
LOG_TAIL_LINES = 150
# Seconds each step of the session took (model built, each server started): printed with the
# group's count at the end of the run (tests/conftest.py).
TIMINGS: dict[str, float] = {}

class Unavailable(RuntimeError):
    """No usable vLLM environment: the message says why and how to get one."""


class StartFailed(RuntimeError):
    """The server exited, or never answered, during start-up; the message carries its log."""


venv = vllm_cpu.venv


def pinned_version() -> str:
    """The vLLM version the tests and fixtures are for, from tests/real_vllm/requirements.txt."""
    for line in REQUIREMENTS.read_text().splitlines():
        match = re.fullmatch(r"\s*vllm(?:-cpu)?==([\w.]+)\s*", line)
        if match:
            return match.group(1)
    raise ValueError(f"{REQUIREMENTS} pins no vllm-cpu version")


def fixture_prefix(version: str | None = None) -> str:
    """This version's captured fixtures are named <prefix>_<name>: v0_32_cpu for 0.32.0."""
    major, minor = (version or pinned_version()).split(".")[:2]
    return f"v{major}_{minor}_cpu"


def python() -> str:
    """vLLM's Python interpreter; Unavailable, with the reason, when `make vllm-env` did not
    install it (pip's output is kept when the install failed)."""
    env = venv()
    interpreter = env / "bin" / "python"
    if (env / ".installed").exists() and interpreter.exists():
        return str(interpreter)
    failed = env / "install-failed.log"
    if failed.exists():
        tail = "\n".join(failed.read_text(errors="replace").splitlines()[-30:])
        raise Unavailable(f"vLLM could not be installed into {env} (`make vllm-env`); pip said:\n{tail}")
    raise Unavailable(f"no vLLM environment at {env}: run `make vllm-env` (about 3 min, 3.5 GiB), "
                      "or deselect these tests with -m 'not real_vllm'")


def installed_version(interpreter: str) -> str:
    out = subprocess.run([interpreter, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


def build_model(directory: Path, interpreter: str | None = None) -> str:
    """Build the tiny Llama (scripts/tiny_llama.py) into `directory`; its digest."""
    return vllm_cpu.build_model(interpreter or python(), directory)


@dataclass(frozen=True)
class Config:
    """One way of starting the server: its flags and environment beyond the model and port."""

    name: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    address_space_bytes: int | None = None  # RLIMIT_AS for every process of the server


# The tests' server, as scripts/vllm_cpu.py serves it: 512-token requests, a 32 MiB KV cache
# (32,768 tokens, 64 requests of max_model_len at once: small enough to saturate on purpose).
MAIN = Config("main", args=vllm_cpu.SERVE_ARGS)


# Starts that real vLLM code refuses, each with the failure an operator meets (the tiny model's
# KV cache takes 1 KiB per token: 2 layers x K and V x 2 KV heads x 64 x 2 bytes).
FAILING = (
    # The KV cache too small for one request of max_model_len, at GiB sizes (the CPU backend's
    # legacy VLLM_CPU_KVCACHE_SPACE, in GiB: 1 GiB for 2,000,000 tokens that need 1.91 GiB;
    # the model is told it allows that many positions).
    Config("kv_cache_too_small_gib", args=("--max-model-len", "2000000", "--enforce-eager",
                                           "--hf-overrides", '{"max_position_embeddings": 2097152}'),
           env={"VLLM_CPU_KVCACHE_SPACE": "1"}),
    # ... and at sub-GiB sizes, which vLLM prints as "0.00 GiB" (1 MiB for 2,048 tokens).
    Config("kv_cache_too_small_sub_gib", args=("--max-model-len", "2048", "--kv-cache-memory-bytes",
                                               str(1 * MiB), "--enforce-eager")),
    # The CPU backend's check at start-up: every byte of the node (utilisation 1.0) is more
    # than it has available, on any machine.
    Config("cpu_memory_utilization_check", args=("--max-model-len", "512", "--gpu-memory-utilization", "1.0",
                                                 "--enforce-eager")),
    # Its check before the KV cache is allocated: 1 TiB asked for.
    Config("cpu_kv_cache_space_check", args=("--max-model-len", "512", "--kv-cache-memory-bytes", str(1 << 40),
                                             "--enforce-eager")),
    # Not a memory failure: a max_model_len the model does not allow (it allows 2,048).
    Config("max_model_len_above_model", args=("--max-model-len", "4096", "--enforce-eager")),
)
# The worker's host allocation failing: a 2 GiB KV cache under an address-space limit that
# leaves every process room to start but not that much more (capture_real.py sets the limit
# from what a started server's processes map).
HOST_ALLOCATION = Config("worker_host_allocation_failure",
                         args=("--max-model-len", "512", "--kv-cache-memory-bytes", str(2 * GiB), "--enforce-eager"))


# What tests/fixtures/vllm/capture_real.py writes, after the prefix.
CAPTURED = ("main.log", "idle.prom", "served.prom",
            *(f"{c.name}.log" for c in (*FAILING, HOST_ALLOCATION)))


class Server:
    """vLLM's API server (scripts/vllm_cpu.py's command line) in a session of its own, so stop()
    ends the engine core and worker it spawns too. stdout and stderr go to `log_path`."""

    def __init__(self, config: Config, model_dir: Path, log_path: Path, port: int,
                 env: Mapping[str, str] | None = None, interpreter: str | None = None):
        self.config = config
        self.model_dir = model_dir
        self.log_path = log_path
        self.port = port
        self.served_model_name = vllm_cpu.SERVED_MODEL_NAME
        self._interpreter = interpreter
        self._extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.ready_after: float | None = None  # seconds from start to the first healthy answer

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return self.url + "/metrics"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        return vllm_cpu.command(self._interpreter or python(), self.model_dir, self.port, self.config.args)

    def start(self) -> Server:
        env = vllm_cpu.environment({**self.config.env, **self._extra_env})
        limit = self.config.address_space_bytes

        def limit_address_space() -> None:
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=limit_address_space if limit is not None else None)
        self.started_at = time.monotonic()
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        # The route table is forty lines of noise at the end of every start.
        kept = [x for x in self.log().splitlines() if "[launcher.py" not in x or "Route:" not in x]
        return "\n".join(kept[-lines:])

    def healthy(self) -> bool:
        return vllm_cpu.healthy(self.url)

    def wait_ready(self, timeout: float = START_TIMEOUT) -> Server:
        """Until /health answers 200. StartFailed with the log as soon as the server exits,
        or at `timeout` (after stopping it)."""
        assert self.proc is not None and self.started_at is not None
        deadline = time.monotonic() + timeout
        while not self.healthy():
            code = self.proc.poll()
            if code is not None:
                self.stop()
                raise StartFailed(f"vLLM ({self.config.name}) exited with {code} during start-up; "
                                  f"its log ({self.log_path}):\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise StartFailed(f"vLLM ({self.config.name}) did not answer /health within {timeout:g}s; "
                                  f"its log ({self.log_path}):\n{self.log_tail()}")
            time.sleep(0.5)
        self.ready_after = time.monotonic() - self.started_at
        return self

    def wait_exit(self, timeout: float = START_TIMEOUT) -> int:
        """For a start that must fail: its exit code (the server is stopped at `timeout`)."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise StartFailed(f"vLLM ({self.config.name}) was expected to fail but still ran after "
                              f"{timeout:g}s; its log:\n{self.log_tail()}") from None

    def processes(self) -> list[psutil.Process]:
        """The API server and every process under it but multiprocessing's resource tracker
        (a helper that is not vLLM's): the engine core and its worker."""
        root = psutil.Process(self.pid)
        found = [root]
        for child in root.children(recursive=True):
            try:
                if "resource_tracker" not in " ".join(child.cmdline()):
                    found.append(child)
            except psutil.Error:
                pass
        return found

    def stop(self) -> None:
        """SIGTERM to every process of the server's session, SIGKILL to what is left after
        STOP_TIMEOUT. Orphaned children keep the session, so none is missed."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT), (signal.SIGKILL, 10.0)):
            procs = _alive([self.proc.pid, *_session_members(self.proc.pid)])
            if not procs:
                break
            for proc in procs:
                try:
                    proc.send_signal(sig)
                except psutil.Error:
                    pass
            psutil.wait_procs(procs, timeout=wait)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _session_members(sid: int) -> list[int]:
    """Processes in the server's session (it leads one: start_new_session)."""
    members = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != sid and os.getsid(proc.pid) == sid:
                members.append(proc.pid)
        except (OSError, psutil.Error):
            pass
    return members


def _alive(pids: list[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE or pid == pids[0]:  # our own child is reaped by waiting
                out.append(proc)
        except psutil.Error:
            pass
    return out


def post_json(url: str, body: Mapping[str, object], timeout: float = 300,
              connection: http.client.HTTPConnection | None = None) -> tuple[int, dict[str, object]]:
    """POST a JSON body; (status, decoded answer), error statuses included (an answer that is
    not JSON as {"text": ...}). Over `connection` where given (to the url's host, the caller's
    to close: another thread may cut the request off by shutting its socket down)."""
    parts = urllib.parse.urlsplit(url)
    own = connection is None
    if connection is None:
        connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    try:
        connection.request("POST", parts.path or "/", json.dumps(body), {"Content-Type": "application/json"})
        answer = connection.getresponse()
        status, text = answer.status, answer.read()
    finally:
        if own:
            connection.close()
    try:
        return status, json.loads(text or b"{}")
    except ValueError:
        return status, {"text": text[:300].decode(errors="replace")}


def get_text(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return str(answer.read().decode())


def wait_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.2) -> object:
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g}s for {what}")
        time.sleep(interval)


# -- load ------------------------------------------------------------------------------------------
# The tiny model's vocabulary: token ids below this exist (scripts/tiny_llama.py VOCAB).
VOCAB = 1024
BLOCK_TOKENS = 128  # the CPU backend's KV cache block (cache_config_info block_size)


@dataclass(frozen=True)
class Shape:
    """One kind of request: `prompt_tokens` random token ids (random, so the prefix cache shares
    no block between requests), then exactly `max_tokens` generated, give or take `spread` (drawn
    per request, so that closed-loop clients started together drift out of step)."""

    prompt_tokens: int
    max_tokens: int
    spread: int = 0


# What the tests' leaking plugin keeps per request while it is switched on (tests/real_vllm/leak_plugin).
LEAK_BYTES_PER_REQUEST = 512 << 10
# Short requests, many a second: the leak's pace (LEAK_BYTES_PER_REQUEST each).
SHORT = Shape(prompt_tokens=16, max_tokens=24)
# Saturates MAIN's 256 blocks from about 80 clients: each request ends holding 4 blocks.
RAMP = Shape(prompt_tokens=60, max_tokens=440)
# Each request holds 2 blocks, then 3 (at most 384 tokens): 76 clients can hold no more than 228
# of MAIN's 256 blocks (89 %), however many of them run at once.
HELD = Shape(prompt_tokens=250, max_tokens=100, spread=34)


class Load:
    """Closed-loop clients: each sends a completion, waits for it, sends the next, until stop().
    `add(n)` starts n more; failures (a status other than 200, an exception) are kept in
    `failures` (bounded)."""

    def __init__(self, server: Server, shape: Shape, seed: int = 0):
        import threading

        self.server, self.shape, self.seed = server, shape, seed
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()  # the requests in flight
        self.failures: list[object] = []
        self.completed = 0

    @property
    def clients(self) -> int:
        return len(self._threads)

    def add(self, n: int) -> Load:
        import threading

        for _ in range(n):
            thread = threading.Thread(target=self._client, args=(self.seed * 100_000 + len(self._threads),),
                                      daemon=True, name="vllm-load")
            thread.start()
            self._threads.append(thread)
        return self

    def _client(self, seed: int) -> None:
        import random

        rng = random.Random(seed)
        address = urllib.parse.urlsplit(self.server.url)
        while not self._stop.is_set():
            prompt = [rng.randrange(10, VOCAB) for _ in range(self.shape.prompt_tokens)]
            body = {"model": self.server.served_model_name, "prompt": prompt,
                    "max_tokens": self.shape.max_tokens + rng.randint(-self.shape.spread, self.shape.spread),
                    "ignore_eos": True, "temperature": 0}
            connection = http.client.HTTPConnection(address.hostname or "", address.port, timeout=600)
            with self._lock:
                self._open.add(connection)
            try:
                status, answer = post_json(self.server.url + "/v1/completions", body, connection=connection)
            except Exception as exc:  # the server went away, or stop() cut the request off
                status, answer = 0, {"error": repr(exc)}
            finally:
                with self._lock:
                    self._open.discard(connection)
                connection.close()
            if status == 200:
                self.completed += 1
            elif not self._stop.is_set():
                if len(self.failures) < 20:
                    self.failures.append((status, str(answer)[:300]))
                self._stop.wait(1.0)  # say so, do not spin

    def stop(self, timeout: float = 600.0) -> None:
        """Stop sending and cut off the requests in flight: vLLM cancels a request whose client has
        gone, so the server is soon at rest (a ramp's 160 requests of 440 tokens took 50 s to finish)."""
        import socket

        self._stop.set()
        with self._lock:
            for connection in self._open:
                if connection.sock is not None:  # not yet connected: that request runs to its end
                    connection.sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> Load:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def engine_values(text: str) -> dict[str, float]:
    """Engine 0's values on a vLLM page that the KV saturation tests read."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"vllm:kv_cache_usage_perc": "kv_cache_usage", "vllm:num_requests_running": "running",
              "vllm:num_requests_waiting": "waiting", "vllm:num_preemptions_total": "preemptions"}
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and sample.labels.get("engine") == "0":
                out[wanted[sample.name]] = float(sample.value)
    return out
