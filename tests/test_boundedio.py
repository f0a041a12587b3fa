import os

import pytest

from exporter.boundedio import open_regular, read_head


def test_read_head_is_bounded_and_says_when_there_is_more(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert read_head(str(path), 100) == (b"x" * 100, False)
    assert read_head(str(path), 10) == (b"x" * 10, True)


def test_a_fifo_is_refused_instead_of_hanging(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        read_head(str(fifo), 10)


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(IsADirectoryError):
        open_regular(str(tmp_path))


def test_proc_files_read_whole():
    data, more = read_head("/proc/self/status", 64 << 10)
    assert b"NSpid" in data or (b"Pid" in data and not more)
