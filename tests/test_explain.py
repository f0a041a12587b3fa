"""`explain`: the JSON contract, the text form, and clear errors for unreadable input."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from exporter.postmortem.explain import ExplainError, explain
from exporter.units import bytes_in_message as parse_size

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
CONTRACT_KEYS = {"line", "kind", "class", "requested_bytes", "total_bytes", "free_bytes",
                 "reserved_unallocated_bytes", "other_processes", "advice", "file"}


def gib(text: str) -> int:
    number, unit = text.split()
    value = parse_size(number, unit)
    assert value is not None
    return value


def test_json_shape_and_numbers():
    path = str(FIXTURES / "torch_contention.log")
    doc = json.loads(explain([path], "json"))
    assert set(doc) >= {"events", "files"}
    [event] = doc["events"]
    assert set(event) >= CONTRACT_KEYS
    assert event["file"] == path and event["line"] == 6
    assert (event["kind"], event["class"]) == ("torch_cuda_oom", "contention")
    assert event["requested_bytes"] == gib("8.00 GiB")
    assert event["total_bytes"] == gib("79.15 GiB")
    assert event["free_bytes"] == gib("5.12 GiB")
    assert event["reserved_unallocated_bytes"] == gib("1.10 GiB")
    assert event["other_processes"] == [{"pid": 20211, "bytes": gib("30.50 GiB")},
                                        {"pid": 20388, "bytes": gib("12.25 GiB")}]
    assert event["advice"] and all(isinstance(a, str) and a for a in event["advice"])
    assert doc["files"] == [{"file": path, "lines": 7, "truncated": False}]
    # Beyond the contract: the counterfactual and its numbers.
    assert event["shortfall_bytes"] == gib("8.00 GiB") - gib("5.12 GiB")
    assert "freeing it would have made the allocation fit" in event["verdict"]
    assert event["causes"][0] == {"cause": "other_processes",
                                  "bytes": gib("30.50 GiB") + gib("12.25 GiB")}
    assert event["process_bytes"] == gib("31.26 GiB") and event["processes_listed"] is True


def test_json_over_many_files_keeps_each_events_file_and_null_for_missing_numbers():
    paths = [str(p) for p in sorted(FIXTURES.glob("*.log"))]
    doc = json.loads(explain(paths, "json"))
    files = {e["file"] for e in doc["events"]}
    assert files == {p for p in paths if not p.endswith("lookalikes.log")}
    classes = {e["class"] for e in doc["events"]}
    assert classes == {"shortage", "fragmentation", "contention", "configuration", "host"}
    runtime = next(e for e in doc["events"] if e["kind"] == "cuda_runtime_oom")
    assert runtime["total_bytes"] is None and runtime["other_processes"] == []
    assert len(doc["files"]) == len(paths)


def test_text_form_lists_location_class_numbers_and_advice():
    path = str(FIXTURES / "vllm_v1_worker_oom.log")
    text = explain([path], "text")
    assert f"{path}:10: torch_cuda_oom (shortage) on GPU 0" in text
    assert "requested 3.91 GiB" in text and "total 79.19 GiB" in text and "free 1.02 GiB" in text
    assert "shortfall 2.89 GiB" in text and "\n  why: Shortfall 2.89 GiB" in text
    assert "\n  - " in text  # advice bullets
    assert text.rstrip().endswith("1 out-of-memory event in 1 file.")


def test_text_form_with_no_events():
    text = explain([str(FIXTURES / "lookalikes.log")])
    assert text == "No out-of-memory events in 1 file.\n"


def test_missing_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.log"
    with pytest.raises(ExplainError, match=r"nope\.log: no such file"):
        explain([str(FIXTURES / "kernel_oom.log"), str(missing)])


def test_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ExplainError, match="is a directory"):
        explain([str(tmp_path)], "json")


def test_unreadable_file_is_a_clear_error(tmp_path):
    log = tmp_path / "secret.log"
    log.write_text("RuntimeError: CUDA error: out of memory\n")
    if os.geteuid() == 0:  # root reads mode-000 files: a directory is the real unreadable case
        log.unlink()
        log.mkdir()
        expected = "is a directory"
    else:
        log.chmod(0)
        expected = "permission denied"
    with pytest.raises(ExplainError, match=expected):
        explain([str(log)])


def test_unknown_format_and_no_files():
    with pytest.raises(ExplainError, match="unknown format"):
        explain([str(FIXTURES / "kernel_oom.log")], "yaml")
    with pytest.raises(ExplainError, match="no log file"):
        explain([], "text")


def test_reading_is_bounded_and_says_so(tmp_path):
    log = tmp_path / "big.log"
    shutil.copy(FIXTURES / "vllm_startup.log", log)
    with open(log, "a") as fh:
        fh.write("RuntimeError: CUDA error: out of memory\n" * 10)
    limit = 600  # only the first few lines
    doc = json.loads(explain([str(log)], "json", max_bytes_per_file=limit))
    assert doc["files"][0]["truncated"] is True
    assert all(e["kind"] != "cuda_runtime_oom" for e in doc["events"])
    text = explain([str(log)], "text", max_bytes_per_file=limit)
    assert "only the first 600 bytes were read" in text


def test_long_lines_are_cut(tmp_path):
    log = tmp_path / "long.log"
    log.write_text("x" * 100_000 + " RuntimeError: CUDA error: out of memory\n"
                   "RuntimeError: CUDA error: out of memory\n")
    doc = json.loads(explain([str(log)], "json", max_line_bytes=1024))
    assert [e["line"] for e in doc["events"]] == [2]
