"""How a finding names a process to a human: by its name, and, where that name says nothing of
what the process is (an interpreter: a notebook's kernel is a "python3"), by what started it."""
from __future__ import annotations

import re

from ..model import ProcessSample

# Names that say which program runs the code, not whose code it is.
_INTERPRETER = re.compile(r"(python[0-9.]*|ipython[0-9.]*|node|java|ruby|perl|julia|R|Rscript|sh|bash|dash|zsh)")


def started_by(p: ProcessSample) -> str:
    """The parent's name where the process's own says nothing (`jupyter-notebook` for a
    notebook kernel's `python3`), else ""."""
    if p.parent_name and p.parent_name != p.name and _INTERPRETER.fullmatch(p.name):
        return p.parent_name
    return ""


def process_name(p: ProcessSample) -> str:
    """`VLLM::EngineCore`; `python3, started by jupyter-notebook`; `?` when the name is not known."""
    parent = started_by(p)
    return f"{p.name}, started by {parent}" if parent else p.name or "?"


def named_evidence(i: int, p: ProcessSample) -> list[tuple[str, int | str]]:
    """The evidence that names the i-th process a finding concerns: its pid, name and, where
    process_name() says it, what started it (the status page shows them)."""
    out: list[tuple[str, int | str]] = [(f"process_{i}_pid", p.pid), (f"process_{i}_name", p.name)]
    parent = started_by(p)
    if parent:
        out.append((f"process_{i}_started_by", parent))
    return out
