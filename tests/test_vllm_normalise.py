"""Normalising vLLM /metrics pages from every release shape into one set of numbers."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.model import CacheConfig, VllmEngineStats
from exporter.sources.vllm_normalise import MAX_ENGINES, ParseError, normalise

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"


def load(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_every_fixture_names_the_vllm_source_it_follows():
    # Not the scripts that render or capture them; load/ holds captured series with their own
    # provenance line (tests/test_kv_saturation_real.py checks it).
    for path in (p for p in FIXTURES.glob("*") if p.is_file() and p.suffix != ".py"):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# Fixture: vLLM"), path.name


def test_v0_6_engine_metrics():
    result = normalise(load("v0_6_engine_metrics.prom"))
    assert result.engines == (
        VllmEngineStats(model="meta-llama/Llama-3.1-8B-Instruct", engine="0",
                        kv_cache_usage_ratio=0.4215, requests_running=7.0, requests_waiting=3.0,
                        preemptions_total=12.0, prefix_cache_queries_total=None,
                        prefix_cache_hits_total=None),
    )
    assert result.cache_config == CacheConfig(gpu_memory_utilization=0.9, num_gpu_blocks=27910,
                                              block_size=16, cache_dtype="auto",
                                              kv_cache_memory_bytes=None, enable_prefix_caching="False")


def test_v0_8_early_v1_uses_old_names():
    result = normalise(load("v0_8_v1_early.prom"))
    assert result.engines == (
        VllmEngineStats(model="Qwen/Qwen2.5-7B-Instruct", engine="0", kv_cache_usage_ratio=0.1875,
                        requests_running=5.0, requests_waiting=0.0, preemptions_total=4.0,
                        prefix_cache_queries_total=96000.0, prefix_cache_hits_total=40960.0),
    )
    assert result.cache_config.gpu_memory_utilization == 0.85
    assert result.cache_config.num_gpu_blocks == 30615


def test_v0_10_with_deprecated_names_alongside():
    result = normalise(load("v0_10_deprecated_alongside.prom"))
    assert result.engines == (
        VllmEngineStats(model="mistralai/Mistral-7B-Instruct-v0.3", engine="0",
                        kv_cache_usage_ratio=0.6630859375, requests_running=12.0,
                        requests_waiting=2.0, preemptions_total=9.0,
                        prefix_cache_queries_total=1048576.0, prefix_cache_hits_total=524288.0),
    )
    assert result.cache_config == CacheConfig(gpu_memory_utilization=0.9, num_gpu_blocks=28672,
                                              block_size=16, cache_dtype="auto", enable_prefix_caching="True")


def test_current_v1_two_engines_created_series_ignored():
    result = normalise(load("current_v1_engines.prom"))
    model = "deepseek-ai/DeepSeek-R1-Distill-Llama-70B"
    assert result.engines == (
        VllmEngineStats(model=model, engine="0", kv_cache_usage_ratio=0.9134, requests_running=31.0,
                        requests_waiting=6.0, preemptions_total=118.0,
                        prefix_cache_queries_total=88_000_000.0, prefix_cache_hits_total=61_000_000.0),
        VllmEngineStats(model=model, engine="1", kv_cache_usage_ratio=0.8871, requests_running=29.0,
                        requests_waiting=4.0, preemptions_total=97.0,
                        prefix_cache_queries_total=86_500_000.0, prefix_cache_hits_total=59_250_000.0),
    )
    assert result.cache_config == CacheConfig(gpu_memory_utilization=0.92, num_gpu_blocks=21846,
                                              block_size=16, cache_dtype="fp8_e4m3",
                                              kv_cache_memory_bytes=None, enable_prefix_caching="True")


def test_new_name_wins_over_deprecated_one_when_they_differ():
    text = (
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.10\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.55\n'
        'vllm:prefix_cache_hits_total{model_name="m"} 7\n'
        'vllm:gpu_prefix_cache_hits_total{model_name="m"} 99\n'
    )
    (engine,) = normalise(text).engines
    assert engine.kv_cache_usage_ratio == 0.55
    assert engine.prefix_cache_hits_total == 7.0


def test_untyped_counter_without_total_suffix_and_unknown_labels():
    text = 'vllm:num_preemptions{model_name="m",replica="a",zone="x"} 5\nvllm:brand_new_metric 3\n'
    (engine,) = normalise(text).engines
    assert engine.preemptions_total == 5.0
    assert engine.kv_cache_usage_ratio is None


def test_duplicate_series_keep_the_largest_value():
    # prometheus multiprocess mode adds a pid label per process
    text = ('vllm:num_requests_running{model_name="m",pid="10"} 0\n'
            'vllm:num_requests_running{model_name="m",pid="11"} 4\n')
    assert normalise(text).engines[0].requests_running == 4.0


def test_non_finite_values_are_unknown_not_numbers():
    text = 'vllm:kv_cache_usage_perc{model_name="m"} NaN\nvllm:num_requests_running{model_name="m"} +Inf\n'
    assert normalise(text).engines == ()


def test_cache_config_strings_like_none_and_bad_numbers():
    text = ('vllm:cache_config_info{block_size="None",gpu_memory_utilization="1.7",'
            'num_gpu_blocks="-3",cache_dtype="None",kv_cache_memory_bytes="8589934592"} 1\n')
    config = normalise(text).cache_config
    assert config == CacheConfig(gpu_memory_utilization=None, num_gpu_blocks=None, block_size=None,
                                 cache_dtype="", kv_cache_memory_bytes=8589934592)


def test_cache_config_only_page_is_still_vllm():
    result = normalise('vllm:cache_config_info{gpu_memory_utilization="0.5"} 1.0\n')
    assert result.engines == ()
    assert result.cache_config.gpu_memory_utilization == 0.5


def test_engine_count_is_bounded():
    text = "".join(f'vllm:num_requests_running{{engine="{i}"}} 1\n' for i in range(MAX_ENGINES + 20))
    assert len(normalise(text).engines) == MAX_ENGINES


@pytest.mark.parametrize("text", [
    "<html><body>Not Found</body></html>",
    '{"detail": "Not Found"}',
    "hello world",
    'vllm:x{a="b} 1',
])
def test_not_exposition_format(text):
    with pytest.raises(ParseError, match="not Prometheus text format"):
        normalise(text)


@pytest.mark.parametrize("text", ["", "node_load1 0.5\n# HELP x y\n"])
def test_valid_text_without_vllm_metrics(text):
    with pytest.raises(ParseError, match="no vllm: metrics"):
        normalise(text)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_only_ever_raises_parse_error(text):
    try:
        result = normalise(text)
    except ParseError:
        return
    assert all(isinstance(e, VllmEngineStats) for e in result.engines)


def _real_sized_page() -> str:
    from exporter.clock import FixedClock
    from exporter.sim import scenario as sc
    from exporter.sim.fake_vllm import FakeVllmServer

    return FakeVllmServer(sc.load("steady"), FixedClock(1_700_000_000.0, 3600)).render().decode()


def test_a_real_sized_page_gives_what_its_vllm_gauges_and_counters_say():
    page = _real_sized_page()
    assert page.count("\n") > 400 and "_bucket{" in page and "http_requests_total" in page
    wanted = "".join(line + "\n" for line in page.splitlines()
                     if line.startswith(("vllm:kv_cache", "vllm:num_", "vllm:prefix_cache", "vllm:cache_config")))
    assert normalise(page) == normalise(wanted)
    engine = normalise(page).engines[0]
    assert 0 < engine.kv_cache_usage_ratio < 1 and engine.prefix_cache_queries_total > 0


def test_a_broken_line_in_a_family_we_never_read_does_not_lose_the_page():
    page = _real_sized_page()
    broken = page.replace('http_requests_total{handler="/health"', 'http_requests_total{handler="/health', 1)
    assert broken != page
    assert normalise(broken) == normalise(page)
    broken_bucket = page.replace('vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3"',
                                 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3', 1)
    assert broken_bucket != page and normalise(broken_bucket) == normalise(page)


def test_a_broken_line_in_a_family_we_read_fails_the_page():
    running = 'vllm:num_requests_running{engine="0"'
    broken = _real_sized_page().replace(running, running[:-1], 1)
    with pytest.raises(ParseError, match="not Prometheus text format"):
        normalise(broken)


# -- impossible values: dropped and named, never passed on --------------------------------------
def test_out_of_range_values_are_rejected_and_named():
    text = ('vllm:kv_cache_usage_perc{model_name="m",engine="0"} -5\n'
            'vllm:kv_cache_usage_perc{model_name="m",engine="1"} 1.5\n'
            'vllm:kv_cache_usage_perc{model_name="m",engine="2"} 1.0000000001\n'
            'vllm:num_preemptions_total{model_name="m",engine="0"} -1e308\n'
            'vllm:num_requests_running{model_name="m",engine="0"} NaN\n'
            'vllm:num_requests_waiting{model_name="m",engine="0"} 2\n'
            'vllm:engine_sleep_state{model_name="m",engine="0",sleep_state="awake"} 7\n'
            'vllm:cache_config_info{engine="0",gpu_memory_utilization="1.7",num_gpu_blocks="-3",'
            'block_size="16",kv_cache_max_concurrency="-2"} 1\n')
    result = normalise(text)
    by_engine = {e.engine: e for e in result.engines}
    assert by_engine["0"] == VllmEngineStats(model="m", engine="0", requests_waiting=2.0)
    assert "1" not in by_engine  # its one value was impossible: nothing to report
    assert by_engine["2"].kv_cache_usage_ratio == 1.0  # float noise over 1 is clamped
    assert result.rejected == (
        "vllm:cache_config_info.gpu_memory_utilization", "vllm:cache_config_info.kv_cache_max_concurrency",
        "vllm:cache_config_info.num_gpu_blocks", "vllm:engine_sleep_state", "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions", "vllm:num_requests_running")
    assert result.cache_config == CacheConfig(block_size=16)


def test_a_sane_page_rejects_nothing():
    for name in ("current_v1_engines.prom", "v0_6_engine_metrics.prom", "v0_33_tp1_dp2.prom"):
        assert normalise(load(name)).rejected == (), name


# -- vLLM 0.33, rendered by its own PrometheusStatLogger (tests/fixtures/vllm/render_fixtures.py) --
def test_v0_33_cache_config_carries_kv_capacity_and_default_utilisation():
    result = normalise(load("v0_33_tp1_dp2.prom"))
    config = result.cache_config
    assert config.gpu_memory_utilization == 0.92  # 0.33's default: never assume 0.9
    assert (config.num_gpu_blocks, config.block_size) == (27_584, 16)
    assert config.kv_cache_size_tokens == 441_344 and config.kv_capacity_tokens == 441_344
    assert config.kv_cache_max_concurrency == pytest.approx(13.47)
    assert config.kv_cache_memory_bytes is None
    assert [e.engine for e in result.engines] == ["0", "1"]
    assert all(e.sleep_state == "awake" for e in result.engines)


def test_v0_33_kv_cache_memory_flag():
    config = normalise(load("v0_33_kv_cache_memory.prom")).cache_config
    assert config.kv_cache_memory_bytes == 32 * 2**30
    assert config.gpu_memory_utilization == 0.92  # still exported, but vLLM ignores it


@pytest.mark.parametrize("fixture, state", [("v0_33_sleep_level1.prom", "weights_offloaded"),
                                            ("v0_33_sleep_level2.prom", "discard_all")])
def test_v0_33_engine_sleep_state(fixture, state):
    (engine,) = normalise(load(fixture)).engines
    assert engine.sleep_state == state


def test_sleep_state_without_a_level_and_when_not_reported():
    asleep = ('vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 0\n'
              'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 0\n'
              'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="discard_all"} 0\n')
    assert normalise(asleep).engines[0].sleep_state == "asleep"
    assert normalise(load("v0_6_engine_metrics.prom")).engines[0].sleep_state == ""


def test_capacity_falls_back_to_blocks_times_block_size():
    assert CacheConfig(num_gpu_blocks=1000, block_size=16).kv_capacity_tokens == 16_000
    assert CacheConfig(num_gpu_blocks=1000).kv_capacity_tokens is None


def test_absurd_sizes_and_counts_are_dropped_not_exported():
    """#21 L11: 1e308 is finite and whole, but no server's number: out of range, never a size."""
    text = ('vllm:cache_config_info{block_size="16",num_gpu_blocks="1e308",kv_cache_memory_bytes="1e308",'
            'kv_cache_size_tokens="9e18",kv_cache_max_concurrency="1e300"} 1\n'
            'vllm:num_requests_running{model_name="m"} 1e308\nvllm:num_preemptions_total{model_name="m"} 7\n')
    result = normalise(text)
    config = result.cache_config
    assert (config.num_gpu_blocks, config.kv_cache_memory_bytes, config.kv_cache_size_tokens,
            config.kv_cache_max_concurrency, config.block_size) == (None, None, None, None, 16)
    (engine,) = result.engines
    assert engine.requests_running is None and engine.preemptions_total == 7.0
    assert "vllm:cache_config_info.kv_cache_memory_bytes" in result.rejected
    assert "vllm:num_requests_running" in result.rejected


def test_a_page_switching_between_v0_and_v1_names_keeps_its_engine_label():
    """#21 L12: V0 names carry no engine label; V1 labels its one engine "0". The same server's
    series must not flip between engine="" and engine="0" as its page switches."""
    v1 = 'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.5\n'
    v0 = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.6\n'
    assert [(e.model, e.engine) for e in normalise(v1).engines] == [("m", "0")]
    assert [(e.model, e.engine) for e in normalise(v0).engines] == [("m", "0")]
    # Both on one page (a release exposing both names): one engine, the current name's value.
    (both,) = normalise(v1 + v0).engines
    assert (both.engine, both.kv_cache_usage_ratio) == ("0", 0.5)


# -- a series' labels parsed once and remembered (#18): the same numbers, the same strictness ----
@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.prom")))
def test_remembered_labels_give_what_a_fresh_parse_gives(name, monkeypatch):
    """Every fixture page, the real vLLM 0.32 page among them: normalised with the label sets
    remembered (twice: the second reads them from memory) and with every line parsed afresh,
    the same engines, cache config, admission rejections and rejected names."""
    from exporter.sources import vllm_normalise

    page = load(name)
    remembered = [normalise(page), normalise(page)]
    monkeypatch.setattr(vllm_normalise, "_sample", vllm_normalise._parse_sample)
    fresh = normalise(page)
    assert remembered[0] == remembered[1] == fresh
    assert fresh.engines or fresh.cache_config is not None


@pytest.mark.parametrize("line, labels", [
    ('vllm:num_requests_running{model_name="a}b",engine="0"} 3\n', ("a}b", "0")),
    ('vllm:num_requests_running{model_name="a\\"}",engine="1"} 3\n', ('a"}', "1")),
    ('vllm:num_requests_running{model_name="m",engine="0",} 3 1700000000\n', ("m", "0")),
])
def test_a_brace_or_quote_in_a_label_value_reads_right(line, labels):
    for _ in range(2):  # parsed, then remembered
        (engine,) = normalise(line).engines
        assert (engine.model, engine.engine, engine.requests_running) == (*labels, 3.0)


@pytest.mark.parametrize("tail", [" 3}", " three", "", ' 3 x"}'])
def test_a_remembered_label_set_does_not_excuse_a_bad_value(tail):
    good = 'vllm:num_requests_running{model_name="m",engine="0"} 3\n'
    normalise(good)  # its label set is now remembered
    with pytest.raises(ParseError, match="not Prometheus text format"):
        normalise(good + f'vllm:num_requests_waiting{{model_name="m",engine="0"}}{tail}\n')


def test_label_sets_remembered_are_bounded():
    from exporter.sources import vllm_normalise

    for i in range(vllm_normalise.MAX_CACHED_LABEL_SETS + 50):
        normalise(f'vllm:num_requests_running{{model_name="m{i}",engine="0"}} 1\n')
    info = vllm_normalise._cached_labels.cache_info()
    assert info.currsize <= vllm_normalise.MAX_CACHED_LABEL_SETS
    long_labels = "x" * (vllm_normalise.MAX_CACHED_LABELS_CHARS + 1)
    (engine,) = normalise(f'vllm:num_requests_running{{model_name="{long_labels}",engine="0"}} 1\n').engines
    assert engine.requests_running == 1.0  # parsed, not remembered
    assert vllm_normalise._cached_labels.cache_info().currsize <= vllm_normalise.MAX_CACHED_LABEL_SETS
