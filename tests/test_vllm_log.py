"""vLLM start-up memory profile from its log, across V0 and V1 wordings."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from exporter.sources.vllm_log import MemoryProfile, parse_profile, read_profile

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
GiB = 2**30


def gib(x):
    return round(x * GiB)


def test_v0_6_4_profiling_results_line():
    profile = read_profile(str(FIXTURES / "v0_6_4_startup.log"))
    assert profile == MemoryProfile(
        weights_bytes=gib(2.6419), kv_cache_bytes=gib(3.54), non_torch_bytes=gib(0.47),
        # peak_torch_memory (3.12) includes the weights
        activation_peak_bytes=gib(3.12) - gib(2.6419),
        cuda_graph_bytes=None,  # 0.6.4 logged the capture time only
        total_gpu_bytes=gib(7.92), gpu_memory_utilization=0.90, num_gpu_blocks=1207,
        kv_cache_max_concurrency=9.43,  # "Maximum concurrency for 2048 tokens per request: 9.43x"
        max_model_len=2048,
    )


def test_v0_7_split_summary_lines():
    profile = read_profile(str(FIXTURES / "v0_7_startup.log"))
    assert profile == MemoryProfile(
        weights_bytes=gib(2.89), kv_cache_bytes=gib(2.36), activation_peak_bytes=gib(2.02),
        non_torch_bytes=gib(0.01), cuda_graph_bytes=gib(0.19), total_gpu_bytes=gib(14.56),
        gpu_memory_utilization=0.50, num_gpu_blocks=5517,
        kv_cache_max_concurrency=2.69,  # "Maximum concurrency for 32768 tokens per request: 2.69x"
        max_model_len=32768,
    )


def test_v1_0_10():
    profile = read_profile(str(FIXTURES / "v1_0_10_startup.log"))
    assert profile.components() == {
        "weights": gib(14.99), "kv_cache": gib(54.09), "activation_peak": gib(1.87),
        "non_torch": gib(0.25), "cuda_graph": gib(0.96),
    }
    assert profile.non_kv_cache_bytes == gib(17.11)
    assert profile.kv_cache_tokens == 443_104


def test_current_v1_tensor_parallel_takes_first_worker_and_measured_graphs():
    profile = read_profile(str(FIXTURES / "v1_current_tp2_startup.log"))
    assert profile.weights_bytes == gib(33.88)
    assert profile.kv_cache_bytes == gib(32.00)
    assert profile.cuda_graph_bytes == gib(1.29)  # measured beats "Estimated ... 1.58"
    assert profile.activation_peak_bytes is None and profile.non_torch_bytes is None
    assert profile.kv_cache_tokens == 209_664


def test_estimate_used_when_capture_not_logged_yet():
    profile = parse_profile(["INFO Estimated CUDA graph memory: 0.45 GiB total"])
    assert profile.cuda_graph_bytes == gib(0.45)


def test_single_line_v0_summary_and_negative_kv_cache():
    line = ("INFO 12-22 10:55:34 worker.py:241] Memory profiling takes 257.11 seconds the current vLLM "
            "instance can use total_gpu_memory (23.57GiB) x gpu_memory_utilization (0.90) = 21.21GiB "
            "model weights take 6.59GiB; non_torch_memory takes 8.29GiB; PyTorch activation peak "
            "memory takes 4.93GiB; the rest of the memory reserved for KV Cache is -7.83GiB.")
    profile = parse_profile([line])
    assert profile.kv_cache_bytes == -gib(7.83)  # why the server then failed to start
    assert profile.non_torch_bytes == gib(8.29) and profile.total_gpu_bytes == gib(23.57)


def test_lines_without_a_profile():
    profile = parse_profile(["INFO:     Application startup complete.", "", "garbage \x00\xff"])
    assert profile.empty and profile.components() == {}


def test_missing_and_unreadable_files_never_raise(tmp_path):
    missing = read_profile(str(tmp_path / "nope.log"))
    assert missing.empty and "cannot read" in missing.error
    directory = read_profile(str(tmp_path))
    assert directory.empty and directory.error


def test_reads_only_the_head(tmp_path):
    log = tmp_path / "vllm.log"
    with open(log, "wb") as handle:
        handle.write(b"x" * 2000 + b"\n")
        handle.write(b"INFO Available KV cache memory: 10.00 GiB\n")
    assert read_profile(str(log), max_bytes=1000).kv_cache_bytes is None
    assert read_profile(str(log), max_bytes=4000).kv_cache_bytes == gib(10)


def test_binary_and_huge_lines_are_harmless(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_bytes(os.urandom(4096) + b"A" * 100_000 + b"\nINFO Model loading took 1.50 GiB and 2 s\n")
    assert read_profile(str(log)).weights_bytes == gib(1.5)


def test_profile_cache_attaches_and_follows_file_changes(tmp_path):
    from exporter.model import VllmSample
    from exporter.sources.vllm_log import ProfileCache

    log = tmp_path / "vllm.log"
    log.write_text("INFO Model loading took 14.9888 GiB and 13.2 seconds\n")
    cache = ProfileCache({"a": str(log), "gone": str(tmp_path / "missing.log")})
    a, other, gone = cache.attach((VllmSample("a", True), VllmSample("b", True), VllmSample("gone", True)))
    assert dict(a.memory_profile)["weights"] == pytest.approx(14.9888 * 2**30, abs=1)
    assert other.memory_profile == () and gone.memory_profile == ()
    with log.open("a") as fh:
        fh.write("INFO Available KV cache memory: 55.05 GiB\n")
    (a,) = cache.attach((VllmSample("a", True),))
    assert dict(a.memory_profile)["kv_cache"] == pytest.approx(55.05 * 2**30, abs=1)


# -- vLLM 0.33, rendered by its own logger and statements (fixtures/vllm/render_fixtures.py) ----
RESTART_LOG = FIXTURES / "v0_33_failed_then_restarted.log"


def split_at_restart() -> tuple[list[str], list[str]]:
    """The failed start's lines and the good start's (from its API server banner on)."""
    lines = RESTART_LOG.read_text().splitlines(keepends=True)
    second = [i for i, line in enumerate(lines) if "version 0.33.0" in line][1]
    return lines[:second], lines[second:]


def test_v0_33_a_failed_start_then_a_good_one_reports_the_last_start_only():
    profile = read_profile(str(RESTART_LOG))
    assert profile.kv_cache_bytes == gib(54.91)  # the failed start's -2.1 GiB is gone
    assert profile.weights_bytes == gib(14.99)
    # the INFO summary: free/total at start, the requested utilisation and its bytes, consumed
    # (weights + non-torch), peak activation (less the CUDA graph estimate vLLM budgets in it)
    assert (profile.free_at_start_bytes, profile.total_gpu_bytes) == (gib(78.68), gib(79.19))
    assert (profile.gpu_memory_utilization, profile.requested_bytes) == (0.92, gib(72.85))
    assert profile.consumed_bytes == gib(15.62)
    assert profile.non_torch_bytes == gib(15.62) - gib(14.99)
    assert profile.activation_peak_bytes == gib(2.32) - gib(0.45)
    # "CUDA graph pool memory: 0.93 GiB (actual), 0.45 GiB (estimated)"
    assert (profile.cuda_graph_bytes, profile.cuda_graph_estimate_bytes) == (gib(0.93), gib(0.45))
    assert (profile.kv_cache_tokens, profile.kv_cache_max_concurrency) == (449_856, 13.73)
    # the components vLLM budgeted add up to what it requested, as its own arithmetic says
    parts = profile.consumed_bytes + profile.activation_peak_bytes + profile.cuda_graph_estimate_bytes
    assert parts + profile.kv_cache_bytes == pytest.approx(profile.requested_bytes, abs=gib(0.02))


def test_v0_33_the_failed_start_alone_shows_why_it_failed():
    failed, _ = split_at_restart()
    profile = parse_profile(failed)
    assert profile.kv_cache_bytes == -gib(2.1) and profile.weights_bytes == gib(14.99)


def test_v0_33_sleep_mode_freed_lines():
    profile = read_profile(str(RESTART_LOG))
    assert profile.sleeps == 2
    # the latest cycle: it gave back less than the first (70.25 GiB), 3.05 GiB stayed in use
    assert (profile.sleep_freed_bytes, profile.sleep_still_in_use_bytes) == (gib(68.41), gib(3.05))


def test_v0_33_kv_cache_memory_flag():
    profile = read_profile(str(FIXTURES / "v0_33_kv_cache_memory.log"))
    assert profile.kv_cache_bytes == profile.kv_cache_memory_flag_bytes == 32 * GiB
    assert profile.free_at_start_bytes == gib(78.68)
    assert profile.gpu_memory_utilization is None  # vLLM ignores it with --kv-cache-memory
    assert (profile.kv_cache_tokens, profile.kv_cache_max_concurrency) == (262_144, 8.0)


def test_summary_peak_is_kept_whole_when_graphs_are_not_budgeted():
    summary = next(x for x in RESTART_LOG.read_text().splitlines() if "Desired GPU memory" in x)
    estimate = "Estimated CUDA graph memory: 0.45 GiB total"
    off = ("WARNING CUDA graph memory profiling is disabled (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0). "
           "Without it, CUDA graph memory is not accounted for during KV cache allocation")
    assert parse_profile([estimate, summary]).activation_peak_bytes == gib(2.32) - gib(0.45)
    assert parse_profile([estimate, off, summary]).activation_peak_bytes == gib(2.32)


def test_a_followed_log_sees_a_restart_after_many_megabytes(tmp_path):
    from exporter.sources.vllm_log import LogFollower

    log = tmp_path / "vllm.log"
    failed, good = split_at_restart()
    filler = '(APIServer pid=1) INFO:     10.0.0.9:51234 - "POST /v1/chat/completions HTTP/1.1" 200 OK\n'
    log.write_text("".join(failed) + filler * 60_000 + "".join(good))
    assert log.stat().st_size > 5 << 20
    follower = LogFollower(str(log), budget_bytes=1 << 20)
    first = follower.profile()
    assert first.kv_cache_bytes == -gib(2.1)  # a tick reads a bounded piece: the failed start so far
    for _ in range(10):
        latest = follower.profile()
    assert latest.kv_cache_bytes == gib(54.91) and latest.sleeps == 2
    # rotated: a new file under the same name starts over
    log.unlink()
    log.write_text("INFO Model loading took 1.50 GiB and 2 s\n")
    assert follower.profile() == MemoryProfile(weights_bytes=gib(1.5))


def test_a_followed_log_survives_a_line_longer_than_any_read(tmp_path):
    from exporter.sources.vllm_log import LogFollower

    log = tmp_path / "vllm.log"
    log.write_bytes(b"A" * (1 << 20) + b" Available KV cache memory: 9.00 GiB\nINFO Model loading took 1.50 GiB\n")
    follower = LogFollower(str(log), budget_bytes=64 << 10)
    for _ in range(20):
        profile = follower.profile()
    assert profile == MemoryProfile(weights_bytes=gib(1.5))  # the giant line is skipped whole


def test_profile_cache_carries_the_whole_profile(tmp_path):
    from exporter.model import VllmSample
    from exporter.sources.vllm_log import ProfileCache

    (sample,) = ProfileCache({"a": str(RESTART_LOG)}).attach((VllmSample("a", True),))
    assert sample.startup == read_profile(str(RESTART_LOG))
    assert dict(sample.memory_profile) == sample.startup.components()
