"""LogTailer and LogSource against real files: appends, rotation, truncation, deletion,
unreadable paths, bounded reads, and OOM messages that span polls."""
from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.analysis.oom import classify
from exporter.model import Snapshot
from exporter.sources.logs import LogSource, LogTailer, iter_file_lines

FIXTURES = Path(__file__).parent / "fixtures" / "logs"


def append(path: Path, data: str | bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)


def make_unreadable(path: Path) -> None:
    """A real unreadable log: mode 000 for a normal user; root reads anything, so a directory
    stands in the file's place there."""
    if os.geteuid() == 0:
        if path.exists():
            path.unlink()
        path.mkdir()
    else:
        path.chmod(0)


def make_readable(path: Path) -> None:
    if path.is_dir():
        path.rmdir()
        path.write_bytes(b"")
    else:
        path.chmod(0o644)


# ------------------------------------------------------------------ LogTailer

def test_starts_at_end_and_returns_only_new_complete_lines(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("old 1\nold 2\n")
    t = LogTailer(str(log))
    assert t.poll() == []
    append(log, "new 1\nnew 2\npartial")
    assert t.poll() == [(1, "new 1"), (2, "new 2")]
    assert t.poll() == []
    append(log, " line\n")
    assert t.poll() == [(3, "partial line")]
    assert t.error == ""


def test_from_start_numbers_lines_from_one(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("one\r\ntwo\n")
    t = LogTailer(str(log), start_at_end=False)
    assert t.poll() == [(1, "one"), (2, "two")]


def test_rotation_reads_the_rest_of_the_old_file_then_the_new_one(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("")
    t = LogTailer(str(log))
    append(log, "a\n")
    assert t.poll() == [(1, "a")]
    append(log, "b\nunterminated")
    log.rename(tmp_path / "a.log.1")
    log.write_text("c\nd\n")
    assert t.poll() == [(2, "b"), (3, "unterminated"), (1, "c"), (2, "d")]
    append(log, "e\n")
    assert t.poll() == [(3, "e")]


def test_truncation_restarts_from_zero(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("")
    t = LogTailer(str(log))
    append(log, "first line that is long\n")
    assert t.poll() == [(1, "first line that is long")]
    with open(log, "wb") as fh:  # copytruncate
        fh.write(b"x\n")
    assert t.poll() == [(1, "x")]


def test_deletion_is_quiet_and_the_file_is_picked_up_again(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("")
    t = LogTailer(str(log))
    append(log, "before\n")
    log.unlink()
    assert t.poll() == [(1, "before")]  # what was written before deletion is not lost
    assert t.poll() == [] and t.error == ""
    log.write_text("again\n")
    assert t.poll() == [(1, "again")]  # a file that reappears is read from its start


def test_missing_at_start_then_created_is_read_from_start(tmp_path):
    log = tmp_path / "later.log"
    t = LogTailer(str(log))
    assert t.poll() == [] and t.error == ""
    log.write_text("hello\n")
    assert t.poll() == [(1, "hello")]


def test_unreadable_is_reported_not_raised_and_recovers(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("")
    make_unreadable(log)
    t = LogTailer(str(log), start_at_end=False)
    assert t.poll() == []
    assert t.error_kind in ("permission", "not_a_file")
    assert str(log) in t.error
    make_readable(log)
    append(log, "ok\n")
    assert t.poll() == [(1, "ok")]
    assert t.error == "" and t.error_kind == ""


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.log"
    os.mkfifo(fifo)
    t = LogTailer(str(fifo))
    assert t.poll() == []
    assert t.error_kind == "io" and "not a regular file" in t.error


def test_reads_are_bounded_per_poll(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("")
    t = LogTailer(str(log), max_read_bytes=64 * 1024)
    line = "y" * 99 + "\n"
    append(log, line * 3000)  # ~300 KB
    sizes = []
    got = []
    for _ in range(10):
        batch = t.poll()
        sizes.append(len(batch))
        got += batch
    # At most one budget of bytes per poll (+1: a line begun in the previous poll).
    assert all(n <= 64 * 1024 // 100 + 1 for n in sizes)
    assert sizes[0] > 0 and sizes.count(0) >= 1  # needed several polls, then drained
    assert [n for n, _ in got] == list(range(1, 3001))


def test_overlong_lines_are_cut_and_the_next_line_survives(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("")
    t = LogTailer(str(log), max_line_bytes=10)
    append(log, "0123456789ABCDEF")
    assert t.poll() == [(1, "0123456789")]  # emitted once the cap is reached
    append(log, "GHIJ\nnext\n")
    assert t.poll() == [(2, "next")]


def test_invalid_utf8_is_replaced(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("")
    t = LogTailer(str(log))
    append(log, b"bad \xff\xfe byte\n")
    assert t.poll() == [(1, "bad \ufffd\ufffd byte")]


def test_iter_file_lines_bounds_the_read(tmp_path):
    log = tmp_path / "a.log"
    log.write_bytes(b"aaaa\nbbbb\ncccc\n")
    with open(log, "rb") as fh:
        assert list(iter_file_lines(fh, max_bytes=7, max_line_bytes=3)) == [(1, "aaa"), (2, "bb")]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=st.lists(st.binary(max_size=200), max_size=25),
       max_line=st.integers(min_value=1, max_value=40))
def test_appends_come_back_exactly_in_order(tmp_path, chunks, max_line):
    log = tmp_path / "prop.log"
    log.write_bytes(b"")
    t = LogTailer(str(log), max_line_bytes=max_line, max_read_bytes=97)
    got = []
    for chunk in chunks:
        append(log, chunk)
        got += t.poll()
    for _ in range(50):  # drain what the read bound left behind
        got += t.poll()
    data = b"".join(chunks)
    complete = data.split(b"\n")[:-1]
    expected = [(i, raw[:max_line].decode("utf-8", "replace").rstrip("\r"))
                for i, raw in enumerate(complete, start=1)]
    tail = data.split(b"\n")[-1]
    if len(tail) >= max_line:  # an unterminated over-long line is emitted once cut
        expected.append((len(expected) + 1, tail[:max_line].decode("utf-8", "replace").rstrip("\r")))
    assert got == expected
    log.unlink()


_OPS = st.lists(st.tuples(st.sampled_from(["append", "truncate", "rotate", "delete", "dir",
                                           "undir", "poll"]),
                          st.binary(max_size=120)), max_size=30)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_no_file_operation_makes_the_tailer_raise(tmp_path, ops):
    log = tmp_path / "chaos.log"
    if log.is_dir():
        log.rmdir()
    log.write_bytes(b"")
    t = LogTailer(str(log), max_line_bytes=16, max_read_bytes=50)
    rotations = 0
    for op, data in ops:
        if op == "append" and log.is_file():
            append(log, data)
        elif op == "truncate" and log.is_file():
            log.write_bytes(data)
        elif op == "rotate" and log.is_file():
            rotations += 1
            log.rename(tmp_path / f"chaos.log.{rotations}")
            log.write_bytes(data)
        elif op == "delete" and log.is_file():
            log.unlink()
        elif op == "dir" and not log.exists():
            log.mkdir()
        elif op == "undir" and log.is_dir():
            log.rmdir()
        for number, text in t.poll():
            assert number >= 1 and len(text) <= 16
        assert t.error_kind in ("", "not_a_file")  # "io" here would be a tailer bug
    t.close()
    if log.is_dir():
        log.rmdir()
    elif log.exists():
        log.unlink()
    for old in tmp_path.glob("chaos.log.*"):
        old.unlink()


# ------------------------------------------------------------------ LogSource

def test_source_finds_a_message_split_across_ticks(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("INFO old history with CUDA error: out of memory\n")  # before start: skipped
    src = LogSource([str(log)])
    assert src.sample() == ((), ())
    lines = (FIXTURES / "vllm_v1_worker_oom.log").read_text().splitlines(keepends=True)
    append(log, "".join(lines[:10]))  # ends in the middle of the OOM message
    events, errors = src.sample(now=1234.5)
    assert events == () and errors == ()
    append(log, "".join(lines[10:]))
    events, errors = src.sample(now=1240.0)
    assert len(events) == 1 and errors == ()
    e = events[0]
    # The source reports what the message says; its class is the analysis's call.
    assert (e.kind, classify(e).klass, e.line, e.source) == ("torch_cuda_oom", "shortage", 10, str(log))
    assert e.timestamp == 1240.0
    assert e.reserved_unallocated_bytes is not None


def test_source_flushes_an_open_message_when_the_log_goes_quiet(tmp_path):
    log = tmp_path / "app.log"
    log.write_text("")
    src = LogSource([str(log)])
    append(log, "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB "
                "total capacity; 12.90 GiB already allocated; 1.20 GiB free; 13.05 GiB reserved in"
                " total by PyTorch)\n")
    first, _ = src.sample()
    second, _ = src.sample()  # no new lines: the message is complete as it is
    assert first == ()
    assert [e.kind for e in second] == ["torch_cuda_oom"]
    assert src.sample() == ((), ())  # reported once


def test_source_reports_each_files_faults_and_keeps_the_others(tmp_path):
    good = tmp_path / "good.log"
    good.write_text("")
    bad = tmp_path / "bad.log"
    bad.write_text("")
    make_unreadable(bad)
    src = LogSource([str(good), str(bad), str(tmp_path / "missing.log"), str(good)])
    assert src.paths == (str(good), str(bad), str(tmp_path / "missing.log"))
    append(good, "(EngineCore_0 pid=1) ERROR 11-22 09:58:21 [core.py:700] ValueError: No "
                 "available memory for the cache blocks. Try increasing `gpu_memory_utilization`\n")
    events, errors = src.sample()
    assert [e.kind for e in events] == ["vllm_kv_cache_too_small"]
    assert len(errors) == 1
    assert errors[0].source == "logs" and errors[0].kind in ("permission", "not_a_file")
    assert str(bad) in errors[0].message
    make_readable(bad)
    src.close()


def test_source_handles_rotation_between_ticks(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("")
    src = LogSource([str(log)])
    kernel = (FIXTURES / "kernel_oom.log").read_text().splitlines(keepends=True)
    append(log, kernel[2])  # the oom-kill: line; its "Killed process" partner is in the new file
    assert src.sample()[0] == ()
    log.rename(tmp_path / "kern.log.1")
    log.write_text(kernel[3])
    events, _ = src.sample()
    # The rotation ends the old file's context: the lone oom-kill line is its own event,
    # and the new file's Killed line another.
    assert [(e.kind, e.line) for e in events] == [("kernel_oom_kill", 1), ("kernel_oom_kill", 1)]


# ------------------------------------------------------------------ a 100 MiB line (#21 L6)

OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
       "79.15 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.00 GiB memory in "
       "use. Of the allocated memory 70.00 GiB is allocated by PyTorch, and 2.00 GiB is reserved by PyTorch but "
       "unallocated. See documentation for Memory Management  "
       "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)\n")


def append_long_line_then_oom(log: Path, line_bytes: int = 100 << 20) -> None:
    """A 100 MiB line without a newline (a hole in a sparse file: NUL bytes, no disk), ended
    only by the OOM line that follows it."""
    with open(log, "r+b") as fh:
        fh.seek(0, os.SEEK_END)
        fh.seek(fh.tell() + line_bytes)
        fh.write(b"\n" + OOM.encode())


def test_an_oom_after_a_100_mib_line_is_found_at_the_next_tick(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("")
    src = LogSource([str(log)])
    append_long_line_then_oom(log)
    events, errors = src.sample(now=1.0)
    assert [e.kind for e in events] == ["torch_cuda_oom"] and errors == ()
    assert src.collect(Snapshot(2.0)).dropped == ()  # the cut line was counted at the tick that cut it


def test_an_oom_after_a_long_line_survives_a_copytruncate_at_the_next_tick(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("")
    src = LogSource([str(log)])
    append_long_line_then_oom(log)
    first = src.collect(Snapshot(1.0))
    assert [e.kind for e in first.snapshot.log_events] == ["torch_cuda_oom"]
    assert dict(first.dropped) == {"log_lines": 1}  # the 100 MiB line, cut and counted
    with open(log, "r+b") as fh:  # logrotate's copytruncate, after the tick
        fh.truncate(0)
    assert src.sample(now=2.0) == ((), ())
