"""OOM message parsing (sources/oom_messages) and classification (analysis/oom) against real
message shapes (tests/fixtures/logs; the wider corpus is in test_oom_corpus.py)."""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.analysis.oom import CLASSES, classify
from exporter.model import OOM_KINDS as KINDS
from exporter.postmortem.explain import event_to_dict
from exporter.postmortem.explain import events_in_lines as parse_lines
from exporter.sources.oom_messages import (
    DEDUPE_WINDOW_LINES,
    MAX_MESSAGE_CHARS,
    OomParser,
    parse_torch_message,
    strip_prefixes,
)
from exporter.sources.oom_messages import parse_lines as parse_messages
from exporter.units import bytes_in_message as parse_size
from exporter.units import format_bytes, format_duration

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
GiB, MiB = 1024**3, 1024**2


def fixture_events(name: str):
    path = FIXTURES / name
    return parse_lines(path.read_text().splitlines(), source=str(path))


def size(text: str) -> int:
    number, unit = text.split()
    result = parse_size(number, unit)
    assert result is not None
    return result


# ------------------------------------------------------------------ sizes and prefixes

@pytest.mark.parametrize("number,unit,expected", [
    ("0", "bytes", 0), ("512", "bytes", 512), ("3", "B", 3), ("1.50", "KiB", 1536),
    ("20.00", "MiB", 20 * MiB), ("2.00", "GiB", 2 * GiB), ("1.00", "TiB", 1024 * GiB),
])
def test_parse_size_units(number, unit, expected):
    assert parse_size(number, unit) == expected


@pytest.mark.parametrize("number,unit", [("1", "parsecs"), ("nan", "GiB"), ("1e400", "GiB"),
                                         ("-1", "GiB"), ("99999999999999", "TiB")])
def test_parse_size_rejects_nonsense(number, unit):
    assert parse_size(number, unit) is None


def test_format_bytes_matches_pytorch_style():
    assert format_bytes(2 * GiB) == "2.00 GiB"
    assert format_bytes(612 * MiB) == "612.00 MiB"
    assert format_bytes(100) == "100 bytes"
    assert format_bytes(None) == "?"


def test_format_duration_is_the_one_for_findings_status_and_trace_gaps():
    """One duration formatter (post-mortem's gap between runs had its own): minutes, then hours,
    thousands separated as a gap between traces months apart needs."""
    assert [format_duration(s) for s in (59, 600, 3599, 3600, 5400)] == ["1 min", "10 min", "60 min", "1.0 h",
                                                                         "1.5 h"]
    assert format_duration(5399, hours_from=5400) == "90 min"
    assert format_duration(6_479_640) == "1,799.9 h" and format_duration(3_600_000) == "1,000.0 h"


@pytest.mark.parametrize("line", [
    "(VllmWorker rank=0 pid=4711) ERROR 11-22 10:05:14 [multiproc_executor.py:527] MSG",
    "(EngineCore_0 pid=263) ERROR 11-22 09:58:21 [core.py:700] MSG",
    "ERROR 11-22 10:05:40 engine.py:160] MSG",
    "2025-11-22T10:15:07.881Z ERROR MSG",
    "Nov 22 10:30:01 gpu-node-7 kernel: [812345.100642] MSG",
    "[91234.567890] MSG",
    "vllm-embed-1  | MSG",
    "2025-11-22 10:20:00,100 - vllm.worker - ERROR - MSG",
    "(RayWorkerWrapper pid=123, ip=10.0.0.1) MSG",
])
def test_strip_prefixes_leaves_the_message(line):
    assert strip_prefixes(line) == "MSG"


def test_strip_prefixes_keeps_message_parentheses():
    text = "(GPU 0; 15.78 GiB total capacity; 14.56 GiB already allocated)"
    assert strip_prefixes(text) == text


# ------------------------------------------------------------------ PyTorch 2.x

def test_vllm_worker_oom_split_over_prefixed_lines():
    events = fixture_events("vllm_v1_worker_oom.log")
    assert len(events) == 1
    e = events[0]
    assert (e.kind, e.line, e.gpu) == ("torch_cuda_oom", 10, "0")
    assert e.requested_bytes == size("3.91 GiB")
    assert e.total_bytes == size("79.19 GiB")
    assert e.free_bytes == size("1.02 GiB")
    assert e.allocated_bytes == size("74.88 GiB")
    assert e.reserved_unallocated_bytes == size("612.04 MiB")
    assert e.reserved_bytes == e.allocated_bytes + e.reserved_unallocated_bytes
    # Inside its container PyTorch lists itself as "Process 4711": not another process.
    assert e.process_bytes == size("78.16 GiB")
    assert e.other_processes == ()
    assert e.klass == "shortage"
    assert e.source.endswith("vllm_v1_worker_oom.log")
    assert "(VllmWorker" not in e.message and "Tried to allocate 3.91 GiB" in e.message


def test_shortage_advice_carries_the_numbers():
    e = fixture_events("vllm_v1_worker_oom.log")[0]
    short = size("3.91 GiB") - size("1.02 GiB")
    delta = -(-(short / size("79.19 GiB") + 0.01) * 100 // 1) / 100  # ceil to 2 decimals
    assert any(f"by at least {delta:.2f}" in a and format_bytes(short) in a for a in e.advice)
    assert any("--max-num-seqs" in a for a in e.advice)
    assert any("--tensor-parallel-size" in a for a in e.advice)


def test_contention_names_the_other_processes():
    [e] = fixture_events("torch_contention.log")
    assert (e.kind, e.klass, e.gpu, e.line) == ("torch_cuda_oom", "contention", "1", 6)
    assert e.other_processes == ((20211, size("30.50 GiB")), (20388, size("12.25 GiB")))
    assert e.process_bytes == size("31.26 GiB")
    text = " ".join(e.advice)
    assert "pid 20211 (30.50 GiB)" in text and "pid 20388 (12.25 GiB)" in text
    others = size("30.50 GiB") + size("12.25 GiB")
    share = int(((size("79.15 GiB") - others) / size("79.15 GiB") - 0.02) * 100) / 100
    assert f"--gpu-memory-utilization to {share:.2f}" in text


def test_fragmentation_when_the_unused_cache_would_have_held_the_request():
    [e] = fixture_events("torch_fragmentation.log")
    assert e.klass == "fragmentation"
    assert e.reserved_unallocated_bytes == size("19.80 GiB") >= e.requested_bytes
    assert any("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in a for a in e.advice)


def test_the_brief_example_message():
    line = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
            "total capacity of 79.15 GiB of which 1.06 GiB is free. Process 12345 has 40.00 GiB "
            "memory in use. Including non-PyTorch memory, this process has 77.98 GiB memory in "
            "use. Of the allocated memory 70.01 GiB is allocated by PyTorch, and 6.50 GiB is "
            "reserved by PyTorch but unallocated.")
    [e] = parse_lines([line])
    assert e.other_processes == ((12345, 40 * GiB),)
    assert e.process_bytes == size("77.98 GiB")
    assert e.reserved_unallocated_bytes == size("6.50 GiB")
    # Counterfactual: shortfall = 2.00 - 1.06 = 0.94 GiB; the other process's 40.00 GiB covers
    # it, so contention (it was "fragmentation" before the counterfactual rule, because the
    # 6.50 GiB unused cache also covers it: that stays in the advice as a second fix).
    assert e.klass == "contention"
    assert e.shortfall_bytes == size("2.00 GiB") - size("1.06 GiB")
    assert any("40.00 GiB" in a and "pid 12345" in a for a in e.advice)
    assert any("6.50 GiB" in a and "expandable_segments" in a for a in e.advice)


def test_pytorch_2_1_capacty_typo_gets_max_split_size_advice():
    line = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 "
            "has a total capacty of 14.75 GiB of which 3.06 MiB is free. Process 9 has 14.74 GiB "
            "memory in use. Of the allocated memory 13.60 GiB is allocated by PyTorch, and 1.01 GiB"
            " is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
            "try setting max_split_size_mb to avoid fragmentation.")
    [e] = parse_lines([line])
    assert e.total_bytes == size("14.75 GiB") and e.free_bytes == size("3.06 MiB")
    assert e.klass == "fragmentation"
    assert any("max_split_size_mb" in a for a in e.advice)


def test_set_memory_fraction_cap_is_configuration():
    line = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a "
            "total capacity of 79.15 GiB of which 40.00 GiB is free. 30.00 GiB allowed; Of the "
            "allocated memory 28.00 GiB is allocated by PyTorch, and 10.00 MiB is reserved by "
            "PyTorch but unallocated.")
    [e] = parse_lines([line])
    assert e.klass == "configuration"
    assert any("30.00 GiB" in a and "set_per_process_memory_fraction" in a for a in e.advice)


def test_free_memory_at_least_requested_is_fragmentation():
    line = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a "
            "total capacity of 79.15 GiB of which 2.00 GiB is free. Including non-PyTorch memory, "
            "this process has 77.00 GiB memory in use. Of the allocated memory 76.00 GiB is "
            "allocated by PyTorch, and 100.00 MiB is reserved by PyTorch but unallocated.")
    [e] = parse_lines([line])
    assert e.klass == "fragmentation"
    assert any("2.00 GiB was free yet 1.00 GiB" in a for a in e.advice)


def test_request_bigger_than_the_gpu():
    line = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 130206.04 GiB. GPU 0 "
            "has a total capacity of 23.56 GiB of which 16.57 GiB is free. Including non-PyTorch "
            "memory, this process has 6.97 GiB memory in use. Of the allocated memory 5.45 GiB is "
            "allocated by PyTorch, and 1.17 GiB is reserved by PyTorch but unallocated.")
    [e] = parse_lines([line])
    assert e.klass == "shortage"
    assert "larger than all of GPU 0" in e.advice[0]


def test_unaccounted_memory_without_process_list_is_contention():
    # No NVML inside the container: PyTorch could not list processes.
    line = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a "
            "total capacity of 80.00 GiB of which 1.00 GiB is free. Of the allocated memory "
            "40.00 GiB is allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but "
            "unallocated.")
    [e] = parse_lines([line])
    assert e.klass == "contention"
    assert "38.00 GiB" in e.advice[0]


def test_bare_torch_message_without_numbers_is_still_an_event():
    [e] = parse_lines(["torch.cuda.OutOfMemoryError: CUDA out of memory.", "next line"])
    assert (e.kind, e.klass, e.line, e.requested_bytes) == ("torch_cuda_oom", "shortage", 1, None)


# ------------------------------------------------------------------ which process is this one

_TWO_LISTED = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a"
               " total capacity of 79.15 GiB of which 1.00 GiB is free. Process 900 has 30.00 GiB"
               " memory in use. Process 901 has 48.00 GiB memory in use. Of the allocated memory"
               " 45.00 GiB is allocated by PyTorch, and 500.00 MiB is reserved by PyTorch but"
               " unallocated.")


def test_in_a_container_this_process_is_the_listed_one_holding_its_pool():
    # No "this process" line: PyTorch could not match its own PID. Process 901 holds more than
    # the 45.49 GiB pool, Process 900 less: 901 is this process, 900 another.
    [e] = parse_lines([_TWO_LISTED])
    assert e.process_bytes == 48 * GiB and e.other_processes == ((900, 30 * GiB),)
    assert e.klass == "contention"  # 30 GiB >= the 1 GiB shortfall


def test_the_log_prefix_pid_names_this_process_when_it_is_listed():
    line = "(VllmWorker rank=0 pid=900) ERROR 11-22 10:05:14 [multiproc_executor.py:527] " + _TWO_LISTED
    [e] = parse_lines([line])
    assert e.process_bytes == 30 * GiB and e.other_processes == ((901, 48 * GiB),)


def test_a_container_listing_only_itself_is_not_contention():
    [e] = fixture_events("vllm_v1_worker_oom.log")
    assert e.other_processes == () and e.klass == "shortage"
    assert "Held by other processes: none listed" in e.verdict


# ------------------------------------------------------------------ the counterfactual, edge cases

def test_free_within_the_drivers_slack_is_a_full_gpu():
    # 20.38 MiB free for 20.00 MiB: the driver's pages and bookkeeping take that, so the GPU was
    # full and the process next door (21.69 GiB) is why.
    [e] = parse_lines([
        '{"error":{"message":"CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total'
        ' capacity of 23.53 GiB of which 20.38 MiB is free. Including non-PyTorch memory, this'
        ' process has 1.81 GiB memory in use. Process 5403 has 21.69 GiB memory in use. Of the'
        ' allocated memory 1.34 GiB is allocated by PyTorch, and 94.59 MiB is reserved by PyTorch'
        ' but unallocated."}}'])
    assert e.klass == "contention" and 0 < e.shortfall_bytes < 4 * MiB
    assert "within the driver's 4.00 MiB slack" in e.verdict


def test_memory_outside_the_pool_counts_as_others_only_beyond_this_process_context():
    legacy = ("RuntimeError: CUDA out of memory. Tried to allocate 264.00 MiB (GPU 0; {total} total"
              " capacity; 788.51 MiB already allocated; 145.93 MiB free; 1.02 GiB reserved in total"
              " by PyTorch)")
    # 2 GiB card: 857 MiB outside the pool is within the 1.5 GiB allowance -> the 256 MiB unused
    # cache decides: fragmentation.
    [small] = parse_lines([legacy.format(total="2.00 GiB")])
    assert small.klass == "fragmentation" and dict(small.causes).get("other_processes") is None
    # 24 GiB card: 22.85 GiB outside the pool -> other processes: contention.
    [big] = parse_lines([legacy.format(total="24.00 GiB")])
    assert big.klass == "contention"
    assert dict(big.causes)["other_processes"] == pytest.approx(
        size("24.00 GiB") - size("145.93 MiB") - size("1.02 GiB") - 3 * GiB // 2, abs=2)


def test_each_verdict_states_its_counterfactual():
    verdicts = {e.klass: e.verdict for name in ("torch_contention.log", "torch_fragmentation.log",
                                                "vllm_v1_worker_oom.log")
                for e in fixture_events(name)}
    assert "freeing it would have made the allocation fit" in verdicts["contention"]
    assert "would have fit, so this is fragmentation" in verdicts["fragmentation"]
    assert "Neither covers the shortfall" in verdicts["shortage"]
    for verdict in verdicts.values():
        assert verdict.startswith("Shortfall ")


def test_causes_carry_bytes_largest_first():
    [e] = fixture_events("torch_contention.log")
    assert [name for name, _ in e.causes] == ["other_processes", "allocated_by_pytorch",
                                              "reserved_unallocated"]
    assert dict(e.causes)["other_processes"] == size("30.50 GiB") + size("12.25 GiB")


# ------------------------------------------------------------------ how messages arrive

def test_escaped_newlines_and_ansi_colours():
    line = ('\x1b[31m{"level":"error","msg":"Traceback (most recent call last):\\n  File \\"x.py\\",'
            ' line 1\\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 2'
            ' has a total capacity of 80.00 GiB of which 10.00 MiB is free.\\nIncluding non-PyTorch'
            ' memory, this process has 79.00 GiB memory in use. Of the allocated memory 70.00 GiB is'
            ' allocated by PyTorch, and 8.00 GiB is reserved by PyTorch but unallocated."}\x1b[0m')
    [e] = parse_lines([line.encode().decode("unicode_escape")])
    assert (e.gpu, e.requested_bytes, e.klass) == ("2", GiB, "fragmentation")
    assert e.process_bytes == 79 * GiB


def test_the_same_message_from_two_workers_is_two_events():
    msg = ("ERROR 03-16 06:12:38 [multiproc_executor.py:375] RuntimeError: CUDA out of memory"
           " occurred when warming up sampler with 1024 dummy requests.")
    events = parse_lines([f"(VllmWorker rank=7 pid=10948) {msg}", f"(VllmWorker rank=0 pid=10672) {msg}",
                          f"(VllmWorker rank=0 pid=10672) {msg}"])
    assert [e.line for e in events] == [1, 2]  # the third is rank 0 repeating itself


def test_traceback_source_lines_are_not_messages():
    events = parse_lines([
        'ERROR 11-18 18:07:28 engine.py:366]     raise ValueError("No available memory for the '
        'cache blocks. "',
        'ERROR 11-18 18:07:28 engine.py:366]                      "Try increasing '
        '`gpu_memory_utilization` when "',
        "ERROR 11-18 18:07:28 engine.py:366] ValueError: No available memory for the cache blocks."])
    assert [(e.line, e.kind) for e in events] == [(3, "vllm_kv_cache_too_small")]


def test_kernel_report_spans_its_task_dump_and_wrapped_kill_lines():
    dump = [f"[812345.{i:06d}] [ {1000 + i}]  1000  {1000 + i}  12345  678  90112  0  0 worker"
            for i in range(300)]
    lines = (["[812345.100231] python3 invoked oom-killer: gfp_mask=0x140cca, order=0, "
              "oom_score_adj=0", "[812345.100298] Mem-Info:"] + dump
             + ["kernel: oom-kill:constraint=CONSTRAINT_MEMCG,",
                "  oom_memcg=/kubepods.slice/pod42,",
                "  task=python3,pid=4711,uid=0",
                "kernel: Memory cgroup out of memory:",
                "  Killed process 4711 (python3) total-vm:98765432kB, anon-rss:1024kB,",
                "  file-rss:1024kB, shmem-rss:0kB, oom_score_adj:0",
                "INFO something else"])
    [e] = parse_lines(lines)
    assert (e.kind, e.klass, e.line, e.victim_pid, e.victim_name) == (
        "cgroup_oom", "host", 303, 4711, "python3")
    assert e.process_bytes == 2048 * 1024 and e.memory_limit == "/kubepods.slice/pod42"


def test_kubernetes_docker_and_ray_reports():
    events = parse_lines([
        "      Reason:       OOMKilled",
        '        "OOMKilled": false,',
        "  Warning  CgroupOOM  28s  kubelet  Cgroup OOM encountered, victim process: stress, pid: 470521",
        "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.",
        "Memory on the node (IP: 10.0.0.1, ID: ab12) where the task (task ID: cd34, name=f, pid=548,"
        " memory used=12.18GB) was running was 21.91GB / 33.28GB (0.658192), which exceeds the"
        " memory usage threshold of 0.65. Ray killed this worker."])
    assert [(e.kind, e.klass) for e in events] == [
        ("container_oom_killed", "host"), ("cgroup_oom", "host"), ("ray_oom_kill", "host")]
    ray = events[2]
    assert ray.victim_pid == 548 and ray.total_bytes == size("33.28 GB")
    assert "at 21.91 GiB of 33.28 GiB (Ray's threshold 0.65)" in ray.advice[0]


# ------------------------------------------------------------------ PyTorch 1.x

def test_legacy_messages():
    first, second = fixture_events("torch_legacy_1x.log")
    assert (first.line, first.gpu) == (5, "0")
    assert first.requested_bytes == 20 * MiB
    assert first.total_bytes == size("15.78 GiB")
    assert first.allocated_bytes == size("14.56 GiB")
    assert first.free_bytes == size("3.44 MiB")
    assert first.reserved_bytes == size("14.71 GiB")
    assert first.reserved_unallocated_bytes == size("14.71 GiB") - size("14.56 GiB")
    assert first.klass == "fragmentation"
    assert any("max_split_size_mb" in a for a in first.advice)
    assert second.line == 7 and second.klass == "shortage"
    assert second.requested_bytes == 2 * GiB


@pytest.mark.parametrize("cached,expected_unallocated", [
    ("2.41 MiB cached", "2.41 MiB"),  # smaller than allocated: the unused part
    ("10.76 GiB cached", "0.23 GiB"),  # larger: the whole cache
])
def test_oldest_cached_wording(cached, expected_unallocated):
    n = parse_torch_message(
        "RuntimeError: CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0; 11.17 GiB total "
        f"capacity; 10.53 GiB already allocated; 17.81 MiB free; {cached})")
    assert n.allocated == size("10.53 GiB")
    assert n.reserved_unallocated == pytest.approx(size(expected_unallocated), abs=1)


def test_classify_priority_contention_over_fragmentation():
    # Shortfall = 1.00 GiB - 100.00 MiB = 924 MiB. Both the other process's 30.00 GiB and the
    # 3.00 GiB unused cache cover it; the counterfactual rule checks other processes first, so
    # contention (it was "fragmentation" before that rule), with the cache named as well.
    [e] = parse_lines([
        "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 80.00 GiB"
        " of which 100.00 MiB is free. Process 7 has 30.00 GiB memory in use. Including "
        "non-PyTorch memory, this process has 49.00 GiB memory in use. Of the allocated memory "
        "45.00 GiB is allocated by PyTorch, and 3.00 GiB is reserved by PyTorch but unallocated."])
    assert e.klass == "contention"
    assert dict(e.causes)["other_processes"] == 30 * GiB
    assert dict(e.causes)["reserved_unallocated"] == 3 * GiB
    assert any("30.00 GiB" in a and "pid 7" in a for a in e.advice)
    assert any("3.00 GiB of unallocated cache" in a for a in e.advice)
    assert "freeing it would have made the allocation fit" in e.verdict


# ------------------------------------------------------------------ vLLM start-up

def test_vllm_startup_messages():
    events = fixture_events("vllm_startup.log")
    assert [(e.line, e.kind) for e in events] == [
        (3, "vllm_insufficient_memory"), (5, "vllm_kv_cache_too_small"),
        (7, "vllm_kv_cache_too_small"), (9, "vllm_kv_cache_too_small"),
        (10, "vllm_insufficient_memory")]
    free, v1, old, no_blocks, warmup = events
    # vLLM wanted 12.39 GiB with 7.34 GiB free: 5.05 GiB short, while 8.15 GiB was in use by
    # others. Freeing it would have let vLLM start: contention under the counterfactual rule
    # (it was "configuration" before). The refused configurations stay "configuration".
    assert free.klass == "contention"
    assert free.shortfall_bytes == size("12.39 GiB") - size("7.34 GiB")
    assert all(e.klass == "configuration" for e in (v1, old, no_blocks, warmup))
    assert (free.gpu, free.free_bytes, free.total_bytes) == ("0", size("7.34 GiB"), size("15.49 GiB"))
    assert free.requested_bytes == size("12.39 GiB")
    suggested = int((7.34 / 15.49 - 0.01) * 100) / 100
    assert f"to {suggested:.2f} or below" in free.advice[0] and "from 0.8" in free.advice[0]
    assert "8.15 GiB" in free.advice[1]
    assert v1.requested_bytes == 16 * GiB and v1.free_bytes == size("5.86 GiB")
    assert "--max-model-len 47984" in v1.advice[0]
    assert "--max-model-len 10272" in old.advice[0]
    assert "--gpu-memory-utilization" in no_blocks.advice[0]
    assert "--max-num-seqs to 128" in warmup.advice[0]


def test_vllm_messages_wrapped_by_a_log_shipper():
    free, kv = fixture_events("vllm_startup_wrapped.log")
    assert (free.line, free.kind, free.free_bytes) == (1, "vllm_insufficient_memory",
                                                       size("2.6 GiB"))
    assert free.advice[0].startswith("Stop")  # 2 % free: lowering the fraction is no answer
    assert free.klass == "contention"  # 119.03 GiB in use >= 7.13 GiB short (was configuration)
    assert (kv.line, kv.kind) == (4, "vllm_kv_cache_too_small")
    fit = int(16384 * size("0.18 GiB") / size("0.19 GiB"))
    assert f"--max-model-len {fit}" in kv.advice[0]


def test_model_s_spelling_variants_of_the_v1_kv_message():
    for spelling in ("model's", "models's"):
        [e] = parse_lines([f"ValueError: To serve at least one request with the {spelling} max seq"
                           " len (8192), 1.00 GiB KV cache is needed, which is larger than the "
                           "available KV cache memory (0.81 GiB)."])
        assert e.kind == "vllm_kv_cache_too_small" and e.requested_bytes == GiB


def test_informational_free_memory_line_is_not_an_event():
    assert parse_lines(["INFO Free memory on device (78.1/79.19 GiB) on startup. Desired GPU "
                        "memory utilization is (0.9, 71.27 GiB)."]) == []


# ------------------------------------------------------------------ CUDA runtime, NCCL, host

def test_nccl_pair_is_one_event_with_the_calloc_size():
    events = fixture_events("nccl_oom.log")
    nccl = [e for e in events if e.kind == "nccl_oom"]
    assert len(nccl) == 1
    assert (nccl[0].line, nccl[0].requested_bytes) == (2, 10485760)
    assert any("NCCL_CUMEM_ENABLE=0" in a for a in nccl[0].advice)
    runtime = [e for e in events if e.kind == "cuda_runtime_oom"]
    assert [e.line for e in runtime] == [6, 8]
    assert all(e.klass == "shortage" for e in runtime)
    assert "cuBLAS" in runtime[1].advice[0]


@pytest.mark.parametrize("line", [
    "ncclUnhandledCudaError: Call to CUDA function failed. Last error: Cuda failure 'out of memory'",
    "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device"
    " error. Last error: out of memory",
    "NCCL WARN Failed to CUDA calloc async 2432 bytes",
])
def test_other_nccl_shapes(line):
    [e] = parse_lines([line])
    assert e.kind == "nccl_oom"


def test_kernel_and_cgroup_oom_kills():
    events = fixture_events("kernel_oom.log")
    assert [(e.line, e.kind) for e in events] == [
        (3, "kernel_oom_kill"), (6, "cgroup_oom"), (7, "cgroup_oom")]
    assert all(e.klass == "host" for e in events)
    kernel, cg_alone, cg_pair = events
    assert kernel.process_bytes == (52428800 + 1048576) * 1024
    assert "pid 4711 (python3)" in kernel.advice[0]
    assert cg_alone.process_bytes == (31457280 + 204800 + 2048) * 1024
    assert "pid 8120 (pt_main_thread)" in cg_alone.advice[0]
    assert "pod42" in cg_pair.advice[0] and "raise the container memory limit" in cg_pair.advice[0]


def test_lone_oom_kill_line_is_flushed_as_an_event():
    [e] = parse_lines(["oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),task=python3,"
                       "pid=77,uid=0"])
    assert (e.kind, e.klass) == ("cgroup_oom", "host")
    assert "pid 77 (python3)" in e.advice[0]


def test_python_memory_error_is_host_not_gpu():
    events = fixture_events("host_memory_error.log")
    assert [(e.line, e.kind, e.klass) for e in events] == [
        (5, "host_memory_error", "host"), (6, "host_memory_error", "host")]
    assert events[1].requested_bytes == 34359738368


# ------------------------------------------------------------------ look-alikes

def test_look_alikes_are_not_oom():
    assert fixture_events("lookalikes.log") == []


@pytest.mark.parametrize("line", [
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python3, GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:3b:00): 31, pid=1, MMU Fault: ENGINE GRAPHICS",
    "NVRM: Xid (PCI:0000:3b:00): 13, Graphics SM Warp Exception: Out Of Range Address",
    "layout of memory banks", "checkout of memory-map branch",
    "    raise MemoryError('tokenizer')",
    "torch.cuda.OutOfMemoryError is caught and retried",
    "oom_reaper: reaped process 4711 (python3), now anon-rss:0kB",
])
def test_single_look_alike_lines(line):
    assert parse_lines([line]) == []


# ------------------------------------------------------------------ parser mechanics

def test_same_message_reprinted_in_a_traceback_is_one_event():
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
           "total capacity of 79.15 GiB of which 1.06 GiB is free. Of the allocated memory 70.01 "
           "GiB is allocated by PyTorch, and 6.50 GiB is reserved by PyTorch but unallocated.")
    filler = ["  File \"x.py\", line 1, in f"] * 10
    assert len(parse_lines([msg] + filler + [msg])) == 1
    far = [msg] + ["noise"] * (DEDUPE_WINDOW_LINES + 1) + [msg]
    assert [e.line for e in parse_lines(far)] == [1, DEDUPE_WINDOW_LINES + 3]


def test_two_different_messages_back_to_back():
    a = ("CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 80.00 GiB"
         " of which 10.00 MiB is free. Of the allocated memory 79.00 GiB is allocated by PyTorch,"
         " and 0 bytes is reserved by PyTorch but unallocated.")
    b = a.replace("GPU 0", "GPU 1")
    events = parse_lines([a, b])
    assert [(e.gpu, e.line) for e in events] == [("0", 1), ("1", 2)]
    assert events[0].reserved_unallocated_bytes == 0


def test_incremental_feeding_matches_one_shot():
    lines = (FIXTURES / "vllm_v1_worker_oom.log").read_text().splitlines()
    parser = OomParser("x")
    events = []
    for i, text in enumerate(lines, start=1):
        events += parser.feed(i, text)
    events += parser.flush()
    assert events == parse_messages(lines, source="x")


def test_line_numbers_going_back_start_over():
    parser = OomParser()
    msg = "RuntimeError: CUDA error: out of memory"
    assert len(parser.feed(5, msg)) == 1
    assert len(parser.feed(1, msg)) == 1  # file rotated: the same text is a new event


def test_message_is_bounded_and_secrets_masked():
    line = ("RuntimeError: CUDA error: out of memory Authorization: Bearer abc.def.ghi token=s3cr3t"
            + " x" * 2000)
    [e] = parse_lines([line])
    assert len(e.message) <= MAX_MESSAGE_CHARS
    assert "abc.def.ghi" not in e.message and "s3cr3t" not in e.message


def test_event_to_dict_shape():
    [e] = fixture_events("torch_contention.log")
    d = event_to_dict(e)
    assert d["class"] == "contention" and d["line"] == 6
    assert d["other_processes"] == [{"pid": 20211, "bytes": size("30.50 GiB")},
                                    {"pid": 20388, "bytes": size("12.25 GiB")}]
    for key in ("requested_bytes", "total_bytes", "free_bytes", "reserved_unallocated_bytes"):
        assert isinstance(d[key], int)


# ------------------------------------------------------------------ properties

def _parse_strictly(lines):
    """parse_lines, failing on any internal fault instead of counting it."""
    parser = OomParser()
    events = []
    for number, text in enumerate(lines, start=1):
        events += parser.feed(number, text)
    events += parser.flush()
    assert parser.faults == 0
    return [classify(m) for m in events]


def _check(events, n_lines):
    for e in events:
        assert e.kind in KINDS and e.klass in CLASSES
        assert 1 <= e.line <= n_lines
        assert len(e.message) <= MAX_MESSAGE_CHARS
        for value in (e.requested_bytes, e.total_bytes, e.free_bytes, e.reserved_bytes):
            assert value is None or value >= 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(max_size=300), max_size=30))
def test_random_text_never_crashes(lines):
    _check(_parse_strictly(lines), len(lines))


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=3000))
def test_random_bytes_never_crash(data):
    lines = data.decode("utf-8", errors="replace").splitlines()
    _check(_parse_strictly(lines), len(lines))


_REAL_LINES = [line for f in sorted(FIXTURES.glob("*.log")) for line in f.read_text().splitlines()]
_REAL_LINES += [line for f in sorted((FIXTURES.parent / "oom_corpus").glob("*.log"))
                for line in f.read_text().split("---\n", 2)[2].splitlines()]


@settings(max_examples=200, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(min_value=1, max_value=12))
def test_mutated_real_messages_never_crash(rnd: random.Random, n_mutations: int):
    lines = list(rnd.sample(_REAL_LINES, k=min(len(_REAL_LINES), rnd.randint(1, 20))))
    for _ in range(n_mutations):
        i = rnd.randrange(len(lines))
        s = lines[i]
        op = rnd.randrange(5)
        pos = rnd.randint(0, len(s))
        if op == 0:  # cut
            lines[i] = s[:pos]
        elif op == 1:  # garble digits / units
            lines[i] = re.sub(r"\d", lambda _: rnd.choice("0123456789.-e"), s)
        elif op == 2:  # splice in noise
            lines[i] = s[:pos] + rnd.choice(["GiB", "(", ")", ";", " of which ", "\x00", "é", "9" * 40]) + s[pos:]
        elif op == 3:  # split the line in two
            lines[i:i + 1] = [s[:pos], s[pos:]]
        else:  # repeat a clause
            lines[i] = s + " " + s[pos:]
    _check(_parse_strictly(lines), len(lines))


def test_hostile_long_lines_stay_fast():
    # Quadratic regex backtracking took over a minute on these; linear matching takes well
    # under a second. Counted in this thread's CPU seconds: busy neighbours do not add to them.
    import time
    hostile = ["CUDA out of memory. Tried to allocate " + "1" * 20000,
               "ncclSystemError " * 2000, "CUDA out of memory. " + "1 " * 10000]
    start = time.thread_time()
    _parse_strictly(hostile * 10)
    assert time.thread_time() - start < 5.0
