"""The fake vLLM server over real loopback HTTP, parsed back with prometheus_client's parser."""
from __future__ import annotations

import copy
import threading
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from exporter.clock import FixedClock
from exporter.sim import scenario as sc
from exporter.sim.fake_vllm import FakeVllmServer
from helpers.tools import HANG

START = 1_700_000_000.0
DOC = {
    "name": "vllm-test", "description": "fake vLLM test", "duration": 3600,
    "gpus": [{"memory": "80GiB"}],
    "host": {"memory": "256GiB"},
    "processes": [
        {"pid": 100, "name": "vllm", "start": 20, "stop": 3000},
        {"pid": 200, "name": "vllm"},
    ],
    "vllm": [
        {"port": 8000, "pid": 100, "model": "meta-llama/Llama-3.1-8B-Instruct",
         "kv_cache_usage": [{"constant": 0.25}, {"linear": {"from": 100, "rate": "0.01/min"}}],
         "running": 7, "waiting": {"step": {"at": 600, "by": 3}},
         "preemptions": {"linear": {"from": 120, "rate": "6/min"}},
         "prefix_cache_queries": {"linear": {"rate": "60/s"}}, "prefix_cache_hit_ratio": 0.5,
         "cache_config": {"gpu_memory_utilization": 0.9, "num_gpu_blocks": 26368,
                          "block_size": 16, "cache_dtype": "fp8"}},
        {"port": 8001, "pid": 200, "model": "other",
         "cache_config": {"gpu_memory_utilization": 0.5, "num_gpu_blocks": 100}},
    ],
    "faults": [
        {"kind": "vllm_http_error", "server": 0, "status": 500, "at": 1000, "until": 1100},
        {"kind": "vllm_garbage", "server": 0, "at": 1100, "until": 1200},
        # long enough that a client waiting 0.05 s cannot have its answer on a loaded machine
        {"kind": "vllm_slow", "server": 0, "delay": 3, "at": 1200, "until": 1300},
    ],
}


def parse(text: str) -> dict[str, list]:
    """{sample name: [(labels, value)]} of an exposition."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@pytest.fixture
def served():
    clock = FixedClock(START, 700)
    with FakeVllmServer(sc.from_dict(copy.deepcopy(DOC)), clock) as server:
        yield server, clock


def test_exposition_matches_the_scenario(served):
    server, _ = served
    r = requests.get(server.url, timeout=HANG)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    samples = parse(r.text)
    labels = {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "engine": "0"}
    expected = server.scenario.state_at(700).vllm[0]
    assert samples["vllm:kv_cache_usage_perc"] == [(labels, pytest.approx(0.25 + 0.1))]
    assert samples["vllm:num_requests_running"] == [(labels, 7)]
    assert samples["vllm:num_requests_waiting"] == [(labels, 3)]
    assert samples["vllm:num_preemptions_total"] == [(labels, 58)]  # (700 - 120) s at 6/min
    assert samples["vllm:num_preemptions_created"] == [(labels, START + 20)]
    assert samples["vllm:prefix_cache_queries_total"] == [(labels, expected.prefix_cache_queries_total)]
    assert samples["vllm:prefix_cache_hits_total"] == [(labels, 42000 / 2)]
    [(info, value)] = samples["vllm:cache_config_info"]
    assert value == 1
    keys = ("block_size", "cache_dtype", "gpu_memory_utilization", "num_gpu_blocks", "engine")
    assert {k: info[k] for k in keys} == {
        "block_size": "16", "cache_dtype": "fp8", "gpu_memory_utilization": "0.9",
        "num_gpu_blocks": "26368", "engine": "0"}


def test_metric_types_are_vllms(served):
    server, _ = served
    types = {f.name: f.type for f in text_string_to_metric_families(requests.get(server.url, timeout=HANG).text)}
    assert types["vllm:num_preemptions"] == "counter"
    assert types["vllm:prefix_cache_queries"] == "counter"
    assert types["vllm:kv_cache_usage_perc"] == "gauge"
    assert types["vllm:cache_config_info"] == "gauge"


def test_values_follow_the_clock(served):
    server, clock = served
    before = parse(requests.get(server.url, timeout=HANG).text)["vllm:num_preemptions_total"][0][1]
    clock.advance(600)
    after = parse(requests.get(server.url, timeout=HANG).text)["vllm:num_preemptions_total"][0][1]
    assert after - before == 60


def test_down_server_answers_503(served):
    server, clock = served
    clock.at = 10
    assert requests.get(server.url, timeout=HANG).status_code == 503
    clock.at = 3000
    assert requests.get(server.url, timeout=HANG).status_code == 503


def test_faults(served):
    server, clock = served
    clock.at = 1050
    assert requests.get(server.url, timeout=HANG).status_code == 500
    clock.at = 1150
    r = requests.get(server.url, timeout=HANG)
    assert r.status_code == 200
    with pytest.raises(ValueError):
        list(text_string_to_metric_families(r.text))
    clock.at = 1250
    t0 = time.monotonic()
    assert requests.get(server.url, timeout=HANG).status_code == 200
    assert time.monotonic() - t0 >= 3
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.get(server.url, timeout=0.05)


def test_faults_only_hit_their_server():
    clock = FixedClock(START, 1050)
    with FakeVllmServer(sc.from_dict(copy.deepcopy(DOC)), clock, server_index=1) as other:
        r = requests.get(other.url, timeout=HANG)
        assert r.status_code == 200
        assert parse(r.text)["vllm:num_requests_running"] == [({"model_name": "other", "engine": "0"}, 0)]


def test_other_paths(served):
    server, _ = served
    base = server.url.rsplit("/", 1)[0]
    assert requests.get(base + "/health", timeout=HANG).status_code == 200
    assert requests.get(base + "/v1/models", timeout=HANG).status_code == 404


def test_restart_on_the_same_port_serves_the_live_server():
    clock = FixedClock(START, 300)
    with FakeVllmServer(sc.load("stale-memory"), clock) as server:
        first = parse(requests.get(server.url, timeout=HANG).text)["vllm:cache_config_info"][0][0]
        clock.at = 700
        assert requests.get(server.url, timeout=HANG).status_code == 503
        clock.at = 1000
        second = parse(requests.get(server.url, timeout=HANG).text)["vllm:cache_config_info"][0][0]
    assert (first["gpu_memory_utilization"], second["gpu_memory_utilization"]) == ("0.9", "0.6")


def test_concurrent_scrapes(served):
    server, _ = served
    statuses = []

    def scrape():
        statuses.append(requests.get(server.url, timeout=HANG).status_code)

    threads = [threading.Thread(target=scrape) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [200] * 16


def test_stop_closes_the_port():
    server = FakeVllmServer(sc.from_dict(copy.deepcopy(DOC)), FixedClock(START, 700)).start()
    url = server.url
    assert requests.get(url, timeout=HANG).status_code == 200
    server.stop()
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(url, timeout=2)
    with pytest.raises(RuntimeError):
        server.url  # noqa: B018


def test_unknown_server_index():
    with pytest.raises(ValueError, match="no vLLM server 5"):
        FakeVllmServer(sc.from_dict(copy.deepcopy(DOC)), FixedClock(START), server_index=5)


def test_startup_log_gives_the_ramp_as_vllm_logs_it():
    from exporter.sim.fake_vllm import startup_log
    from exporter.sources.vllm_log import parse_profile

    scenario = sc.load("steady")
    profile = parse_profile(startup_log(scenario, 0).splitlines())
    ramp = next(c.startup for p in scenario.processes for c in p.memory.values() if c.startup)
    assert profile.weights_bytes == pytest.approx(ramp["weights"], rel=1e-3)
    assert profile.kv_cache_bytes == pytest.approx(ramp["kv_cache"], rel=1e-3)
    assert profile.cuda_graph_bytes == pytest.approx(ramp["cuda_graphs"], rel=1e-2)


def test_page_carries_what_a_real_vllm_page_carries(served):
    """vLLM's request histograms with its own buckets, the API server's http_* families and
    Python's collectors: the bulk a scraper must get through on a real server."""
    server, clock = served
    families = {f.name: f for f in text_string_to_metric_families(requests.get(server.url, timeout=HANG).text)}
    ttft = families["vllm:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    buckets = [s.labels["le"] for s in ttft.samples if s.name.endswith("_bucket")]
    assert buckets[:3] == ["0.001", "0.005", "0.01"] and buckets[-2:] == ["2560.0", "+Inf"]
    prompt = [s.labels["le"] for s in families["vllm:request_prompt_tokens"].samples if s.name.endswith("_bucket")]
    assert prompt[:4] == ["1.0", "2.0", "5.0", "10.0"] and prompt[-2:] == ["20000.0", "+Inf"]
    histograms = [name for name, f in families.items() if name.startswith("vllm:") and f.type == "histogram"]
    assert len(histograms) == 14
    assert {"http_requests", "http_request_duration_highr_seconds", "python_gc_objects_collected"} <= set(families)
    series: dict[tuple, list[float]] = {}
    for f in families.values():
        for s in f.samples:
            if s.name.endswith("_bucket"):
                key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")))
                series.setdefault(key, []).append(s.value)
    assert series and all(counts == sorted(counts) for counts in series.values())  # cumulative
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
               if s.name.endswith("_total")}
    clock.advance(60)
    later = {s.labels["finished_reason"]: s.value
             for s in next(f for f in text_string_to_metric_families(requests.get(server.url, timeout=HANG).text)
                           if f.name == "vllm:request_success").samples if s.name.endswith("_total")}
    assert set(success) == {"stop", "length", "abort"} and later["stop"] > success["stop"]


def test_keep_alive_like_uvicorn_and_stop_drops_open_connections():
    server = FakeVllmServer(sc.from_dict(copy.deepcopy(DOC)), FixedClock(START, 700)).start()
    url = server.url
    with requests.Session() as session:
        first = session.get(url, timeout=HANG)
        second = session.get(url, timeout=HANG)
        assert first.status_code == second.status_code == 200
        assert first.headers.get("Connection", "").lower() != "close"
        assert len(server._connections) == 1  # both answers came over one connection
        server.stop()
        # A stopped server answers nobody, not even a client holding a kept-alive connection.
        with pytest.raises(requests.exceptions.ConnectionError):
            session.get(url, timeout=2)


def test_sleep_mode_is_served_in_vllms_words_and_read_back():
    """`sleep_level` in a scenario: vLLM's engine_sleep_state series, one 0/1 per state, which
    the exporter's normaliser reads back as the engine's sleep state."""
    from exporter.sources.vllm_normalise import normalise

    doc = copy.deepcopy(DOC)
    doc["vllm"][0]["sleep_level"] = [{"step": {"at": 800, "by": 1}}, {"step": {"at": 900, "by": 1}}]
    clock = FixedClock(START, 700)
    with FakeVllmServer(sc.from_dict(doc), clock) as server:
        states = []
        for at in (700, 850, 950):
            clock.at = at
            text = requests.get(server.url, timeout=HANG).text
            flags = {s[0]["sleep_state"]: s[1] for s in parse(text)["vllm:engine_sleep_state"]}
            assert sorted(flags.values()) == [0, 0, 1]
            states.append([e.sleep_state for e in normalise(text).engines])
    assert states == [["awake"], ["weights_offloaded"], ["discard_all"]]


def test_no_sleep_metrics_without_sleep_mode(served):
    server, _ = served
    assert "vllm:engine_sleep_state" not in parse(requests.get(server.url, timeout=HANG).text)


def test_a_server_restarted_on_its_port_is_one_endpoint_whose_log_grows_with_each_start():
    """stale-memory restarts its server on port 8000 at 15 min with a smaller KV cache: one
    endpoint, whose start-up log gains the second start when it happens (the exporter then reads
    the latest start's figures), not two endpoints answering the same thing from the start."""
    from exporter.config import build as build_config
    from exporter.runtime import build as build_runtime
    runtime = build_runtime(build_config(), simulate="stale-memory", at=300)
    try:
        def kv_profile():
            [server] = runtime.sampler.sample().vllm
            return dict(server.memory_profile)["kv_cache"]
        assert kv_profile() == pytest.approx(51.5 * 2**30, rel=0.01)
        runtime.clock.advance(900)  # the replacement is up since 905 s
        assert kv_profile() == pytest.approx(27 * 2**30, rel=0.01)
    finally:
        runtime.close()


def test_families_by_name_at_metrics_slash_only_as_vllm_serves_them(served):
    """vLLM answers `/metrics` from its instrumentator's route, which ignores `name[]`, and
    `/metrics/` from prometheus_client's app, which serves only the samples named."""
    server, _ = served
    names = {"name[]": ["vllm:num_requests_running", "vllm:num_preemptions_total"]}
    only = parse(requests.get(server.url + "/", params=names, timeout=HANG).text)
    whole = parse(requests.get(server.url, timeout=HANG).text)
    assert set(only) == set(names["name[]"])
    assert all(only[name] == whole[name] for name in only)
    assert set(parse(requests.get(server.url, params=names, timeout=HANG).text)) == set(whole)
