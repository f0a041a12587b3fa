"""The probe files' one schema (probe/gpumem_probe/schema.py): what its writers build, its reader
accepts; it names every number the exporter keeps; and it stays importable without torch or any
package outside the standard library, since the exporter imports it and the probe runs inside vLLM.
Hostile files are tested through the exporter's source (test_allocator_source.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpumem_probe import schema

from exporter.model import AllocatorStats
from exporter.sources.allocator import parse

ROOT = Path(__file__).resolve().parent.parent


def written(**counts):
    return schema.document(
        probe_version="0.1.0", pid=57, pid_ns=4026532451, start_ticks=1234567, start_time=1_700_000_000.42,
        written_at=1_700_003_600.1, interval=5.0, seq=720, torch_version="2.6.0+cu124", backend="native",
        alloc_conf={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        errors=dict.fromkeys(schema.ERROR_KINDS, 0) | {"memory_stats": 2},
        devices=[schema.device(0, "58d0f7a7-03a8-b0b4-8b3f-1c2d3e4f5a6b", counts)],
        history={"request_id": "1700000000-57", "state": "done", "file": "gpumem-4026532451-57-1700000000-57.pickle",
                 "bytes": 4096})


def test_what_the_schema_writes_the_schema_reads_back():
    counts = {key: 1000 + i for i, key in enumerate(schema.COUNT_KEYS)}
    report = schema.parse(schema.encode(written(**counts)))
    assert (report.pid, report.pid_ns, report.start_time, report.written_at, report.interval) == (
        57, 4026532451, 1_700_000_000.42, 1_700_003_600.1, 5.0)
    assert report.alloc_conf == (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),)
    assert report.errors_total == 2 and report.backend == "native"
    assert report.history == schema.History("1700000000-57", "done", "gpumem-4026532451-57-1700000000-57.pickle",
                                            4096)
    [device] = report.devices
    assert device.uuid == "58d0f7a7-03a8-b0b4-8b3f-1c2d3e4f5a6b" and device.counts == counts


def test_the_exporter_keeps_every_number_of_a_device():
    """Each count of the file is a field of AllocatorStats of the same name, filled from it."""
    counts = {key: 1000 + i for i, key in enumerate(schema.COUNT_KEYS)}
    assert set(schema.COUNT_KEYS) <= {f.name for f in dataclasses.fields(AllocatorStats)}
    [(uuid, stats)] = parse(schema.encode(written(**counts))).devices
    assert uuid == "58d0f7a7-03a8-b0b4-8b3f-1c2d3e4f5a6b"
    assert {key: getattr(stats, key) for key in schema.COUNT_KEYS} == counts
    assert (stats.probe_pid, stats.probe_pid_ns, stats.probe_errors, stats.history_state, stats.history_bytes) == (
        57, 4026532451, 2, "done", 4096)


def test_a_count_a_torch_does_not_report_is_written_null():
    entry = schema.device(3, None, {"reserved_bytes": 5})
    assert list(entry) == ["index", "uuid", *schema.COUNT_KEYS]
    assert entry["reserved_bytes"] == 5 and entry["allocated_bytes"] is None
    assert schema.parse(schema.encode(written(reserved_bytes=5))).devices[0].counts["allocated_bytes"] is None


def test_a_writer_cannot_invent_a_count():
    with pytest.raises(KeyError, match="reserved_byte"):
        schema.device(0, None, {"reserved_byte": 5})


def test_names_in_the_probe_directory():
    assert schema.FILE_NAME.fullmatch(schema.file_name(4026532451, 57)).groups() == ("4026532451", "57")
    assert schema.LEFTOVER_NAME.fullmatch(schema.temp_name(schema.file_name(1, 2)))
    assert schema.DUMP_NAME.fullmatch(schema.dump_name(1, 2, "1700000000-57"))
    assert not schema.DUMP_NAME.fullmatch(schema.dump_name(1, 2, "../etc/passwd"))
    assert not schema.FILE_NAME.fullmatch(schema.control_name(1, 2))  # never read as a probe file


def test_a_request_the_exporter_writes_is_one_the_probe_accepts():
    body = schema.request("1700000000-57", 120.0, 100_000, "leak")
    assert schema.parse_request(json.dumps(body).encode()) == schema.Request("1700000000-57", 120.0, 100_000)
    with pytest.raises(schema.Refused):
        schema.parse_request(json.dumps(schema.request("x", schema.MAX_RECORD_SECONDS + 1, 1, "leak")).encode())


def test_the_schema_imports_nothing_outside_the_standard_library():
    """Run without site-packages (-S), with only the probe's source on the path."""
    code = ("import sys, json; import gpumem_probe.schema; "
            "print(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT / "probe")}
    done = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    outside = set(json.loads(done.stdout)) - set(sys.stdlib_module_names) - {"gpumem_probe", "__main__"}
    assert outside == set()
