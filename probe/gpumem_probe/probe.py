"""The probe: one daemon thread per process that, once the process itself has initialised
CUDA, writes PyTorch's allocator numbers to `GPUMEM_PROBE_DIR` every `GPUMEM_PROBE_INTERVAL`
seconds, and removes the file when the process exits.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import __version__, schema
from .files import ProbeFile
from .history import ENV_HISTORY, History, enabled_from
from .identity import Identity
from .identity import current as current_identity
from .stats import device_uuid, read_devices

ENV_DIR = "GPUMEM_PROBE_DIR"
ENV_INTERVAL = "GPUMEM_PROBE_INTERVAL"
DEFAULT_INTERVAL = 5.0
MAX_SETTING_CHARS = schema.MAX_TEXT  # allocator settings are short; an odd value must not bloat the file
THREAD_NAME = "gpumem-probe"

log = logging.getLogger("gpumem_probe")


def interval_from(text: str | None) -> float:
    try:
        value = float(text) if text is not None else DEFAULT_INTERVAL
    except ValueError:
        return DEFAULT_INTERVAL
    return min(max(value, schema.MIN_INTERVAL), schema.MAX_INTERVAL) if math.isfinite(value) else DEFAULT_INTERVAL


def allocator_settings(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: environ[name][:MAX_SETTING_CHARS] for name in schema.ALLOC_CONF_VARS if name in environ}


def initialised_cuda(modules: Mapping[str, Any] = sys.modules) -> Any:
    """`torch.cuda` if this process imported torch and initialised CUDA itself, else None.
    Never imports torch and never initialises CUDA: a process that does not use the GPU (vLLM's
    API server) stays exactly as it was. In a child forked after CUDA was initialised torch
    answers False (a "bad fork"), so such a child is left alone too."""
    cuda = getattr(modules.get("torch"), "cuda", None)
    try:
        return cuda if cuda is not None and cuda.is_initialized() else None
    except Exception:
        return None


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the kernel as well (Linux: /proc/<pid>/task/<tid>/comm,
    `top -H`, `ps -L`), so what the probe's thread costs can be seen apart from vLLM's threads.
    Best effort: nothing happens where it cannot be done."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME: the calling thread
    except Exception:
        pass


class Probe:
    def __init__(self, directory: str, interval: float, settings: dict[str, str] | None = None,
                 cuda: Callable[[], Any] = initialised_cuda, clock: Callable[[], float] = time.time,
                 modules: Mapping[str, Any] = sys.modules, proc: str = "/proc", history: bool = True):
        self.directory = directory
        self.interval = interval
        self.settings = dict(settings or {})
        self.pid = os.getpid()
        self.polls = 0  # looks taken, whether or not CUDA was up
        self.writes = 0
        self.errors = dict.fromkeys(schema.ERROR_KINDS, 0)  # written into the file, never raised
        self._cuda = cuda
        self._clock = clock
        self._modules = modules
        self._proc = proc
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a write and the removal at exit never interleave
        self._closed = False
        self._identity: Identity | None = None
        self._file: ProbeFile | None = None
        self._uuids: dict[int, str | None] = {}
        self._backend: str | None = None
        # Allocation history on request (history.py); `history` False refuses every request.
        self.history = History(history, clock, self.errors)

    def start(self) -> None:
        threading.Thread(target=self._run, name=THREAD_NAME, daemon=True).start()
        atexit.register(self.close)

    def _run(self) -> None:
        name_os_thread(THREAD_NAME)
        while True:
            try:
                self.poll()
            except Exception:
                self.errors["internal"] += 1
            if self._stop.wait(self.interval):
                return

    def poll(self) -> bool:
        """One look: if the process has initialised CUDA, read the allocator and write the file.
        Returns whether the file was written."""
        self.polls += 1
        cuda = self._cuda()
        if cuda is None:
            return False
        with self._lock:  # held through a history dump too: exit waits for it to finish
            if self._closed:
                return False
            me = self._me()
            try:
                if self._file is None:
                    self._file = ProbeFile(self.directory, me.file_name)
                    self._sweep(self._file, me)
            except OSError:
                self.errors["write"] += 1  # shows in the next file that does get written
                return False
            self.history.step(self._file, me.pid_ns, me.pid, cuda)  # one lstat unless asked
            data = schema.encode(self.document(cuda))
            try:
                self._file.write(data)
            except OSError:
                self.errors["write"] += 1
                return False
        self.writes += 1
        return True

    def _me(self) -> Identity:
        if self._identity is None:  # read once: it never changes
            self._identity = current_identity(self._proc)
        return self._identity

    def _sweep(self, file: ProbeFile, me: Identity) -> None:
        try:
            file.sweep(me.pid_ns, me.pid)
        except OSError:  # a directory we may write to but not list (mode 1733): not our business
            self.errors["sweep"] += 1

    def document(self, cuda: Any) -> dict[str, Any]:
        me = self._me()
        devices = read_devices(cuda, lambda index: self._uuid(cuda, index), self.errors, self._modules)
        return schema.document(
            probe_version=__version__, pid=me.pid, pid_ns=me.pid_ns, start_ticks=me.start_ticks,
            start_time=me.start_time, written_at=self._clock(), interval=self.interval, seq=self.writes + 1,
            torch_version=str(getattr(self._modules.get("torch"), "__version__", ""))[:schema.MAX_VERSION],
            backend=self._allocator_backend(cuda), alloc_conf=self.settings, errors=self.errors,
            devices=devices, history=self.history.state)

    def _uuid(self, cuda: Any, index: int) -> str | None:
        if index not in self._uuids:
            try:
                self._uuids[index] = device_uuid(cuda.get_device_properties(index))
            except Exception:
                self.errors["device_properties"] += 1
                return None
        return self._uuids[index]

    def _allocator_backend(self, cuda: Any) -> str:
        if self._backend is None:  # fixed once CUDA is initialised
            try:
                self._backend = str(cuda.get_allocator_backend())[:schema.MAX_BACKEND]
            except Exception:
                self._backend = ""
        return self._backend

    def close(self) -> None:
        """Stop and remove the file (at exit). Only the process that wrote the file removes it:
        a forked child inherits this exit handler along with its parent's probe."""
        self._stop.set()
        if os.getpid() != self.pid:
            return
        with self._lock:
            self._closed = True
            if self._file is not None:
                try:
                    self._file.remove()
                    self._file.close()
                except OSError:
                    pass
                self._file = None

    def forked(self) -> Probe:
        """A new probe for a forked child, with this one's settings."""
        return Probe(self.directory, self.interval, self.settings, self._cuda, self._clock,
                     self._modules, self._proc, self.history.enabled)


class _ThisProcess:
    """The process's one probe. vLLM calls the plugin function, possibly several times, instead
    of constructing anything, so the instance has to live at module level."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.probe: Probe | None = None
        self.fork_hook = False


_THIS_PROCESS = _ThisProcess()


def start(environ: Mapping[str, str] = os.environ) -> Probe | None:
    """The probe of this process, started on the first call; None when not opted in."""
    this = _THIS_PROCESS
    with this.lock:
        if this.probe is not None:
            return this.probe
        directory = environ.get(ENV_DIR, "")
        if not directory:
            return None
        if not os.path.isdir(directory):
            log.warning("gpumem_probe: %s=%r is not a directory; the probe stays off", ENV_DIR, directory)
            return None
        this.probe = Probe(directory, interval_from(environ.get(ENV_INTERVAL)), allocator_settings(environ),
                           history=enabled_from(environ.get(ENV_HISTORY)))
        this.probe.start()
        if not this.fork_hook:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            this.fork_hook = True
        return this.probe


def _after_fork_in_child() -> None:
    """A forked child has no probe thread, and inherits vLLM's own "plugins loaded" flag, so
    vLLM will not call the plugin in it again: start the child's own probe here."""
    this = _THIS_PROCESS
    this.lock = threading.Lock()  # another thread of the parent may have held it at fork
    parent, this.probe = this.probe, None
    if parent is None:
        return
    try:
        this.probe = parent.forked()
        this.probe.start()
        _remove_at_multiprocessing_exit(this.probe)
    except Exception:
        pass


def _remove_at_multiprocessing_exit(probe: Probe) -> None:
    """A multiprocessing child started by fork leaves through os._exit, so atexit never runs
    there. Its bootstrap clears the finalizers inherited from the parent and then runs the
    after-fork callbacks: register one that installs our removal as a finalizer."""
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        util.register_after_fork(probe, lambda p: util.Finalize(p, p.close, exitpriority=0))
