"""Real KV saturation (#18 item 2e): a real concurrency ramp on the real server raises
`kv_saturation` and its alert fires in real Prometheus in the same run; the same server held at
60-89 % KV usage raises nothing.

The daemon samples every half second with the shipped detector settings; the seconds from the
cache filling (vLLM's own page, read here every 0.25 s) to the finding are recorded in
real_vllm.TIMINGS (printed at the end of the run).
"""
from __future__ import annotations

import time

import pytest

from helpers import real_vllm
from helpers.real_monitoring import poll, watching
from helpers.tools import HANG

pytestmark = [pytest.mark.real_vllm, pytest.mark.integration, pytest.mark.slow]

HELD_SECONDS = 75.0  # past the detector's window (60 s) and the half of it it needs to judge
HELD_CLIENTS = 76  # at most 89 % of the cache (real_vllm.HELD)


def page(server: real_vllm.Server) -> dict[str, float]:
    return real_vllm.engine_values(real_vllm.get_text(server.metrics_url))


@pytest.fixture(scope="module")
def watch(main_server, tmp_path_factory):
    with watching(main_server, tmp_path_factory.mktemp("kv-saturation")) as w:
        yield w


def at_rest(server: real_vllm.Server) -> None:
    poll(lambda: (p := page(server))["running"] == 0 and p["waiting"] == 0, HANG, "the server at rest")


def test_a_server_held_at_60_to_89_percent_raises_nothing(main_server, watch):
    at_rest(main_server)
    seen: list[dict[str, float]] = []
    with real_vllm.Load(main_server, real_vllm.HELD, seed=3) as load:
        load.add(HELD_CLIENTS)
        end = time.monotonic() + HELD_SECONDS
        while time.monotonic() < end:
            seen.append(page(main_server))
            assert not [f for f in watch.findings() if f["kind"] == "kv_saturation"], seen[-1]
            assert not watch.firing("VllmKvCacheSaturated")
            time.sleep(0.25)
    assert not load.failures, load.failures
    busy = sorted(p["kv_cache_usage"] for p in seen if p["running"] > 0)
    # Busy for a good part of the time (a slower machine keeps more clients between requests, so
    # the share varies), and never full: the clients cannot fill it (real_vllm.HELD).
    assert busy[len(busy) * 3 // 4] >= 0.6 and busy[-1] < 0.95, f"the cache's usage, sorted: {busy}"


def test_a_real_ramp_raises_kv_saturation_and_its_alert_fires(main_server, watch):
    at_rest(main_server)
    poll(lambda: not [f for f in watch.findings() if f["kind"] == "kv_saturation"], HANG,
         "an earlier finding to clear")
    filled_at = None
    finding = None
    with real_vllm.Load(main_server, real_vllm.RAMP, seed=4) as load:
        deadline = time.monotonic() + HANG * 3
        next_step = time.monotonic()
        while finding is None or not watch.firing("VllmKvCacheSaturated"):
            assert time.monotonic() < deadline, f"no finding and alert; the page: {page(main_server)}"
            if load.clients < 160 and time.monotonic() >= next_step:
                load.add(16)  # 16 more clients every 8 s, as the captured ramp
                next_step += 8
            p = page(main_server)
            if filled_at is None and p["kv_cache_usage"] >= 0.95 and p["waiting"] > 0:
                filled_at = time.time()
            found = [f for f in watch.findings() if f["kind"] == "kv_saturation"]
            if found and finding is None:
                finding = found[0]
            time.sleep(0.25)
        alerts = watch.firing("VllmKvCacheSaturated")
    assert not load.failures, load.failures
    assert filled_at is not None
    ev = finding["evidence"]
    assert finding["endpoint"] == "real" and ev["full_share"] >= 0.3
    assert ev["kv_cache_capacity_tokens"] == 32_768
    assert [(a["labels"]["endpoint"], a["labels"]["severity"]) for a in alerts] == [("real", "ticket")]
    real_vllm.TIMINGS["kv_saturation after the cache filled"] = finding["first_detected_at"] - filled_at
