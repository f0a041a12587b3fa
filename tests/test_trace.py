"""Trace files: CSV and Prometheus range-query JSON into Snapshots, and write_csv back."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.model import GpuSample, HostMemory, ProcessSample, Snapshot
from exporter.postmortem.trace import (
    CSV_COLUMNS,
    TraceError,
    read_csv_rows,
    read_prometheus_rows,
    read_trace,
    read_traces,
    snapshots_from_rows,
    write_csv,
)

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
GiB = 1 << 30
HEADER = "timestamp,gpu,pid,process,used_bytes"


def write(tmp_path, text, name="trace.csv") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ CSV reading

def test_minimal_csv_groups_rows_by_timestamp(tmp_path):
    path = write(tmp_path, f"""{HEADER}
100.0,0,10,python3,1000
100.0,1,11,python3,2000
100.0,0,12,worker,300
115.5,0,10,python3,1100
""")
    snaps = read_trace(path)
    assert [s.timestamp for s in snaps] == [100.0, 115.5]
    g0, g1 = snaps[0].gpus
    assert (g0.index, g1.index) == ("0", "1")
    assert [(p.pid, p.name, p.used_bytes, p.role) for p in g0.processes] == [
        (10, "python3", 1000, "other"), (12, "worker", 300, "other")]
    # No GPU-level row: the GPU's own used/total stay unknown, never made up.
    assert g0.used_bytes is None and g0.total_bytes is None and g0.free_bytes is None
    assert g0.uuid != g1.uuid


def test_gpu_level_rows_and_extra_columns(tmp_path):
    path = write(tmp_path, f"""{HEADER},total_bytes,host_rss_bytes,role,uuid,made_up_column
100,0,,,50000,80000,,,GPU-a,whatever
100,0,10,vllm-worker,40000,80000,7000,vllm,GPU-a,1
""")
    (s,) = read_trace(path)
    (g,) = s.gpus
    assert (g.uuid, g.used_bytes, g.total_bytes, g.free_bytes) == ("GPU-a", 50000, 80000, 30000)
    (p,) = g.processes
    assert (p.pid, p.role, p.host_rss_bytes, p.used_bytes) == (10, "vllm", 7000, 40000)


def test_columns_in_any_order_blank_lines_and_bom(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(b"\xef\xbb\xbfused_bytes,pid,gpu,process,timestamp\r\n"
                     b"5,7,0,a,1.5\r\n\r\n6,7,0,a,2.5\r\n")
    assert [s.gpus[0].processes[0].used_bytes for s in read_trace(str(path))] == [5, 6]


def test_unsorted_rows_become_time_ordered_snapshots(tmp_path):
    path = write(tmp_path, f"{HEADER}\n30,0,1,a,3\n10,0,1,a,1\n20,0,1,a,2\n")
    assert [s.timestamp for s in read_trace(path)] == [10, 20, 30]


BAD_ROWS = [
    (f"{HEADER}\nabc,0,1,a,5\n", 2, "timestamp is not a number"),
    (f"{HEADER}\n1,0,1,a,5\n2,0,1,a,-5\n", 3, "used_bytes is negative"),
    (f"{HEADER}\n1,0,1,a,5\n2,0,x,a,5\n", 3, "pid is not an integer"),
    (f"{HEADER}\n1,0,1,a,1.5\n", 2, "not a whole number"),
    (f"{HEADER}\n1,0,1,a\n", 2, "4 fields, the header has 5"),
    (f"{HEADER}\n1,,1,a,5\n", 2, "gpu is empty"),
    (f"{HEADER}\nnan,0,1,a,5\n", 2, "not finite"),
    (f"{HEADER}\n1,0,1,a,5\n1,0,1,b,6\n", 3, "already given at"),
    (f"{HEADER},total_bytes\n1,0,,,5,100\n1,0,1,a,5,200\n", 3, "contradicts"),
    (f"{HEADER},unified\n1,0,1,a,5,maybe\n", 2, "not a boolean"),
    ("timestamp,gpu,pid,used_bytes\n1,0,1,5\n", 1, "lacks column(s) process"),
    (f"{HEADER},pid\n", 1, "duplicate column"),
    ("", 1, "empty file"),
    (f'{HEADER}\n1,0,1,"unterminated,5\n', 2, "malformed CSV"),
]


@pytest.mark.parametrize("text,line,problem", BAD_ROWS)
def test_bad_rows_name_file_line_and_problem(tmp_path, text, line, problem):
    path = write(tmp_path, text)
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert str(err.value).startswith(f"{path}:{line}: ")
    assert problem in str(err.value)


def test_size_and_row_limits(tmp_path):
    path = write(tmp_path, HEADER + "\n" + "1,0,1,a,5\n" * 100)
    with pytest.raises(TraceError, match="byte limit"):
        list(read_csv_rows(path, max_bytes=500))
    with pytest.raises(TraceError, match="more than 10 rows"):
        list(read_csv_rows(path, max_rows=10))
    assert len(list(read_csv_rows(path))) == 100


def test_missing_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(str(tmp_path / "nope.csv"))


# ------------------------------------------------------------------ CSV round trip

# Control characters are taken out on writing (test_trace_safety.py); every other name round-trips.
names = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12)
byte_counts = st.integers(min_value=0, max_value=1 << 50)


@st.composite
def processes(draw):
    pids = sorted(draw(st.sets(st.integers(1, 4_000_000), max_size=4)))
    return tuple(ProcessSample(
        pid=pid, used_bytes=draw(st.none() | byte_counts), name=draw(names),
        host_rss_bytes=draw(st.none() | byte_counts),
        start_time=draw(st.none() | st.floats(0, 2e9, allow_nan=False)),
        role=draw(st.sampled_from(["vllm", "other"])), container=draw(names), pod=draw(names),
        namespace=draw(names), endpoint=draw(names)) for pid in pids)


@st.composite
def gpu_samples(draw, index):
    total = draw(st.none() | byte_counts)
    used = draw(st.none() | byte_counts)
    free = total - used if total is not None and used is not None and used <= total else None
    return GpuSample(index=index, uuid=f"GPU-{draw(st.uuids())}", total_bytes=total,
                     used_bytes=used, free_bytes=free, unified=draw(st.booleans()),
                     processes=draw(processes()))


@st.composite
def snapshot_lists(draw):
    times = sorted(draw(st.sets(st.floats(1e9, 2e9, allow_nan=False), min_size=1, max_size=4)))
    out = []
    for t in times:
        count = draw(st.integers(1, 3))
        host = draw(st.none() | st.builds(
            HostMemory, byte_counts, byte_counts,
            st.none() | st.floats(0, 100, allow_nan=False), st.none(), st.none() | byte_counts))
        out.append(Snapshot(timestamp=t, host=host,
                            gpus=tuple(draw(gpu_samples(str(i))) for i in range(count))))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(snapshot_lists())
def test_write_csv_then_read_gives_the_same_snapshots(tmp_path, snapshots):
    path = str(tmp_path / "round.csv")
    write_csv(snapshots, path)
    assert read_trace(path) == snapshots


def test_write_csv_header_and_never_a_command_line(tmp_path):
    p = ProcessSample(pid=5, used_bytes=1, name="vllm", cmdline="--api-key s3cret")
    path = str(tmp_path / "t.csv")
    write_csv([Snapshot(timestamp=1.0, gpus=(GpuSample("0", "GPU-a", processes=(p,)),))], path)
    text = Path(path).read_text()
    assert text.splitlines()[0] == ",".join(CSV_COLUMNS)
    assert "s3cret" not in text
    assert not list(tmp_path.glob("*.tmp.*"))  # written through a temporary file


# ------------------------------------------------------------------ Prometheus JSON

def test_prometheus_fixture_with_several_responses(tmp_path):
    snaps = read_trace(str(FIXTURES / "prometheus_range.json"))
    assert [s.timestamp for s in snaps] == [1732280400, 1732280415, 1732280430]
    first, second, third = (s.gpus[0] for s in snaps)
    assert first.uuid == "GPU-5f1c7e0a-93b2-4c1d-8e7f-0a1b2c3d4e5f"
    assert (first.total_bytes, first.used_bytes) == (80 * GiB, 64843939840)
    assert [p.pid for p in first.processes] == [4711]
    server = first.processes[0]
    assert (server.name, server.role, server.pod, server.namespace, server.host_rss_bytes) == (
        "VLLM::EngineCor", "vllm", "llama-70b-0", "serving", 7516192768)
    assert [p.pid for p in second.processes] == [4711, 9001]
    assert second.processes[0].host_rss_bytes is None  # no RSS point at that time
    assert [p.pid for p in third.processes] == [4711]  # NaN point skipped


def to_query_range(snapshots) -> list[dict]:
    """What Prometheus answers to range queries of the exporter's own metrics."""
    series: dict[tuple, list] = {}
    for s in snapshots:
        for g in s.gpus:
            base = {"gpu": g.index, "uuid": g.uuid, "instance": "node:9835"}
            for name, value in (("gpumem_gpu_memory_total_bytes", g.total_bytes),
                                ("gpumem_gpu_memory_used_bytes", g.used_bytes)):
                if value is not None:
                    key = tuple(sorted({"__name__": name, **base}.items()))
                    series.setdefault(key, []).append([s.timestamp, str(value)])
            for p in g.processes:
                labels = {"__name__": "gpumem_process_memory_used_bytes", **base,
                          "pid": str(p.pid), "process": p.name, "role": p.role,
                          "container": p.container, "pod": p.pod, "namespace": p.namespace}
                if p.used_bytes is not None:
                    series.setdefault(tuple(sorted(labels.items())), []).append(
                        [s.timestamp, str(p.used_bytes)])
    result = [{"metric": dict(k), "values": v} for k, v in series.items()]
    half = len(result) // 2
    return [{"status": "success", "data": {"resultType": "matrix", "result": part}}
            for part in (result[:half], result[half:])]


def test_prometheus_json_round_trip(tmp_path):
    procs = lambda t: (ProcessSample(pid=10, used_bytes=int(t) * 1000, name="VLLM::Worker",  # noqa
                                     role="vllm", pod="llm-0", namespace="serve"),
                       ProcessSample(pid=20, used_bytes=5 * GiB, name="python"))
    snaps = [Snapshot(timestamp=t, gpus=(
        GpuSample("0", "GPU-a", total_bytes=80 * GiB, used_bytes=40 * GiB, free_bytes=40 * GiB,
                  processes=procs(t)),
        GpuSample("1", "GPU-b", total_bytes=80 * GiB, used_bytes=GiB, free_bytes=79 * GiB)))
        for t in (1e9, 1e9 + 15, 1e9 + 30)]
    path = write(tmp_path, json.dumps(to_query_range(snaps)), "range.json")
    assert read_trace(path) == snaps


BAD_JSON = [
    ('{"status": "success",\n "data": {', ":2: invalid JSON"),
    ('{"status": "error", "error": "bad query"}', "status is 'error'"),
    ('{"status": "success", "data": {"resultType": "vector", "result": []}}', "'matrix'"),
    ('{"status":"success","data":{"resultType":"matrix","result":[{"metric":{}}]}}',
     "result 0 lacks"),
    ('{"status":"success","data":{"resultType":"matrix","result":[]}}', "no gpumem_"),
    ('{"status":"success","data":{"resultType":"matrix","result":[{"metric":{"__name__":'
     '"gpumem_process_memory_used_bytes","gpu":"0"},"values":[[1,"5"]]}]}}', "no pid label"),
    ('{"status":"success","data":{"resultType":"matrix","result":[{"metric":{"__name__":'
     '"gpumem_gpu_memory_used_bytes","gpu":"0"},"values":[[1,"-5"]]}]}}', "value 0: value -5"),
    ('{"status":"success","data":{"resultType":"matrix","result":[{"metric":{"__name__":'
     '"gpumem_gpu_memory_used_bytes","gpu":"0"},"values":[[1]]}]}}', "not a [timestamp"),
    ('[1]', "response 0: expected a query_range response object"),
]


@pytest.mark.parametrize("text,problem", BAD_JSON)
def test_bad_prometheus_json_is_a_clear_error(tmp_path, text, problem):
    path = write(tmp_path, text, "bad.json")
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert str(err.value).startswith(path) and problem in str(err.value)


def test_json_size_limit(tmp_path):
    path = write(tmp_path, json.dumps(to_query_range([])) + " " * 200, "big.json")
    with pytest.raises(TraceError, match="byte limit"):
        read_prometheus_rows(path, max_bytes=100)


def test_several_files_merge_process_and_gpu_series(tmp_path):
    procs = write(tmp_path, f"{HEADER},uuid\n100,0,10,vllm,30,GPU-a\n115,0,10,vllm,31,GPU-a\n", "p.csv")
    gpus = write(tmp_path, f"{HEADER},total_bytes,uuid\n100,0,,,40,100,GPU-a\n"
                 "115,0,,,41,100,GPU-a\n", "g.csv")
    snaps = read_traces([procs, gpus])
    assert [(s.gpus[0].used_bytes, s.gpus[0].processes[0].used_bytes) for s in snaps] == [
        (40, 30), (41, 31)]
    assert snaps == snapshots_from_rows(list(read_csv_rows(gpus)) + list(read_csv_rows(procs)))


def test_a_fifo_given_as_trace_is_refused_not_waited_on(tmp_path):
    import os

    from exporter.postmortem.trace import TraceError, read_rows

    fifo = tmp_path / "trace.csv"
    os.mkfifo(fifo)
    with pytest.raises(TraceError, match="not a regular file"):
        read_rows(str(fifo))
