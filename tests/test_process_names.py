"""How findings name a process: by what started it only where its own name says nothing."""
import pytest

from exporter.analysis.process_names import named_evidence, process_name
from exporter.model import ProcessSample


@pytest.mark.parametrize(("name", "parent", "said"), [
    ("python3", "jupyter-noteboo", "python3, started by jupyter-noteboo"),  # a notebook's kernel
    ("python3.11", "jupyter-lab", "python3.11, started by jupyter-lab"),
    ("node", "code", "node, started by code"),
    ("VLLM::EngineCore", "python3", "VLLM::EngineCore"),  # its own name says what it is
    ("chrome", "chrome", "chrome"),
    ("python3", "python3", "python3"),  # a multiprocessing worker: the parent adds nothing
    ("python3", "", "python3"),  # the parent is gone or unknown
    ("", "bash", "?"),  # the process itself vanished before we looked
    ("pythonista", "launchd", "pythonista"),  # the whole name must be an interpreter's
])
def test_a_process_is_named_by_what_started_it_only_where_its_name_says_nothing(name, parent, said):
    p = ProcessSample(pid=5230, used_bytes=1, name=name, parent_name=parent)
    assert process_name(p) == said
    evidence = dict(named_evidence(1, p))
    assert evidence["process_1_pid"] == 5230 and evidence["process_1_name"] == name
    assert evidence.get("process_1_started_by", "") == (parent if said.endswith(f"started by {parent}") else "")
