"""Who this process is, in terms the exporter can check from the host.

Inside a container the process sees its own PID namespace: the exporter, which sees host PIDs,
matches a file by the PID the process has in its innermost namespace (the last NSpid field
of /proc/<host pid>/status), its start time and, where both can read it, the namespace's inode.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .schema import file_name

_NS_LINK = re.compile(r"pid:\[(\d+)\]")


@dataclass(frozen=True)
class Identity:
    pid: int
    pid_ns: int  # inode of the PID namespace; 0 when unreadable
    start_ticks: int | None  # /proc/self/stat field 22: clock ticks after boot
    start_time: float | None  # Unix seconds, as the host computes it: btime + ticks / CLK_TCK

    @property
    def file_name(self) -> str:
        return file_name(self.pid_ns, self.pid)


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as fh:
        return fh.read(65536)


def start_ticks(stat_text: str) -> int:
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return int(stat_text[stat_text.rindex(")") + 2:].split()[19])


def boot_time(proc_stat_text: str) -> int:
    for line in proc_stat_text.splitlines():
        if line.startswith("btime "):
            return int(line.split()[1])
    raise ValueError("no btime line")


def pid_namespace(link: str) -> int:
    match = _NS_LINK.fullmatch(link)
    return int(match.group(1)) if match else 0


def current(proc: str = "/proc") -> Identity:
    """This process's identity; parts that cannot be read are 0/None, never an exception."""
    try:
        ns = pid_namespace(os.readlink(f"{proc}/self/ns/pid"))
    except OSError:
        ns = 0
    ticks = started = None
    try:
        ticks = start_ticks(_read(f"{proc}/self/stat"))
        started = boot_time(_read(f"{proc}/stat")) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    return Identity(pid=os.getpid(), pid_ns=ns, start_ticks=ticks, start_time=started)
