"""The exporter's daemon against a real vLLM server (#18 item 2a): every vLLM value it exports
equals the server's own /metrics page at rest, and lags it by at most one sample under load. At
rest it reads the page less often (#18 item 5), and at once when requests come.

Both pages are read over HTTP as Prometheus reads them: `gpu-memory-exporter run` (a real
process, real host mode: no GPU here, so NVML is down and only the vLLM part is compared) and
the server's own /metrics.
"""
from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import real_vllm
from helpers.daemon import Daemon
from helpers.tools import HANG

pytestmark = [pytest.mark.real_vllm, pytest.mark.integration, pytest.mark.slow]

INTERVAL = 0.5  # the exporter's sampling interval
ENDPOINT = "real"  # the endpoint's name in the exporter's labels
Page = dict[str, list[tuple[dict[str, str], float]]]


def parse(text: str) -> Page:
    page: Page = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            page.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return page


def one(page: Page, name: str, **labels: str) -> tuple[dict[str, str], float]:
    found = [(lb, v) for lb, v in page.get(name, []) if all(lb.get(k) == want for k, want in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {len(found)} series ({page.get(name)})"
    return found[0]


# -- what each exported vLLM value is on vLLM's own page ------------------------------------
def _direct(name: str) -> Callable[[Page], float]:
    return lambda page: one(page, name, engine="0")[1]


def _config(key: str) -> Callable[[Page], float]:
    return lambda page: float(one(page, "vllm:cache_config_info", engine="0")[0][key])


def _usage_times(key: str) -> Callable[[Page], float]:
    """KV cache in use, in whole tokens or bytes: usage x capacity."""
    return lambda page: round(_direct("vllm:kv_cache_usage_perc")(page) * _config(key)(page))


def _sleep_level(page: Page) -> float:
    levels = {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 2.0}
    on = [lb["sleep_state"] for lb, v in page["vllm:engine_sleep_state"] if lb.get("engine") == "0" and v == 1]
    assert len(on) == 1, page["vllm:engine_sleep_state"]
    return levels[on[0]]


# Exported family (labels endpoint, model, engine) -> its value read off vLLM's page.
FROM_THE_PAGE: dict[str, Callable[[Page], float]] = {
    "gpumem_vllm_kv_cache_usage_ratio": _direct("vllm:kv_cache_usage_perc"),
    "gpumem_vllm_requests_running": _direct("vllm:num_requests_running"),
    "gpumem_vllm_requests_waiting": _direct("vllm:num_requests_waiting"),
    "gpumem_vllm_preemptions_total": _direct("vllm:num_preemptions_total"),
    "gpumem_vllm_prefix_cache_queries_total": _direct("vllm:prefix_cache_queries_total"),
    "gpumem_vllm_prefix_cache_hits_total": _direct("vllm:prefix_cache_hits_total"),
    "gpumem_vllm_kv_cache_capacity_tokens": _config("kv_cache_size_tokens"),
    "gpumem_vllm_kv_cache_capacity_bytes": _config("kv_cache_memory_bytes"),
    "gpumem_vllm_kv_cache_max_concurrency": _config("kv_cache_max_concurrency"),
    "gpumem_vllm_kv_cache_used_tokens": _usage_times("kv_cache_size_tokens"),
    "gpumem_vllm_kv_cache_used_bytes": _usage_times("kv_cache_memory_bytes"),
    # The page has no max_model_len of its own: vLLM's capacity over its concurrency is it.
    "gpumem_vllm_max_model_len_tokens": lambda page: (_config("kv_cache_size_tokens")(page)
                                                      / _config("kv_cache_max_concurrency")(page)),
    "gpumem_vllm_engine_sleep_state": _sleep_level,
    # The preemption histogram's sum and count: preemptions per finished request.
    "gpumem_vllm_request_preemptions_total": _direct("vllm:request_num_preemptions_sum"),
    "gpumem_vllm_requests_finished_total": _direct("vllm:request_num_preemptions_count"),
}
# Exported family with a `reason` label -> vLLM's family, whose series carry the same `reason`
# (admission rejections are counted per model, without an engine).
BY_REASON = {
    "gpumem_vllm_requests_waiting_by_reason": "vllm:num_requests_waiting_by_reason",
    "gpumem_vllm_admission_rejections_total": "vllm:admission_rejections_total",
}
# vllm:cache_config_info's labels the exporter copies into gpumem_vllm_cache_config_info
# (vLLM's "None" is exported as empty).
CONFIG_LABELS = ("block_size", "cache_dtype", "gpu_memory_utilization", "num_gpu_blocks", "enable_prefix_caching",
                 "kv_offloading_backend", "kv_offloading_size")
# Exported vLLM families that are not values of the page: about the scrape, from the start-up
# log, or about GPU memory (none here).
NOT_FROM_THE_PAGE = {"gpumem_vllm_up", "gpumem_vllm_scrape_duration_seconds", "gpumem_vllm_scrape_errors_total",
                     "gpumem_vllm_page_age_seconds",
                     "gpumem_vllm_memory_profile_bytes", "gpumem_vllm_memory_budget_bytes",
                     "gpumem_vllm_memory_used_bytes", "gpumem_vllm_cache_config_info"}
# Values that only grow while every request of a batch decodes (none finishes, none waits).
GROWING = ("gpumem_vllm_kv_cache_usage_ratio", "gpumem_vllm_kv_cache_used_tokens", "gpumem_vllm_kv_cache_used_bytes",
           "gpumem_vllm_preemptions_total", "gpumem_vllm_prefix_cache_queries_total",
           "gpumem_vllm_prefix_cache_hits_total")


def exported(page: Page) -> dict[str, float]:
    """The exporter's vLLM values for the real server's engine 0, by family."""
    out: dict[str, float] = {}
    for name, series in page.items():
        if name.startswith("gpumem_vllm_") and name not in NOT_FROM_THE_PAGE and name not in BY_REASON:
            mine = [v for lb, v in series if lb.get("endpoint") == ENDPOINT and lb.get("engine", "0") == "0"]
            assert len(mine) <= 1, (name, series)
            if mine:
                out[name] = mine[0]
    return out


@pytest.fixture(scope="module")
def exporter(main_server: real_vllm.Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    config = tmp_path_factory.mktemp("exporter") / "exporter.yml"
    config.write_text(f"vllm:\n  endpoints:\n    - url: {main_server.metrics_url}\n      name: {ENDPOINT}\n"
                      f"      log_file: {main_server.log_path}\n")
    daemon = Daemon("--config", str(config), "--interval", str(INTERVAL))
    try:
        daemon.wait_healthy()
        yield daemon
    finally:
        daemon.stop()


class Exporter:
    def __init__(self, daemon: Daemon):
        self.daemon = daemon

    def page(self) -> Page:
        return parse(self.daemon.get("/metrics").text)

    def sampled_after(self, moment: float) -> Page:
        """The first page whose sample began after `moment` (Unix seconds): the sample's
        completion time less its duration, both exported, is later."""
        deadline = time.monotonic() + HANG
        while True:
            page = self.page()
            completed = one(page, "gpumem_exporter_last_sample_timestamp_seconds")[1]
            took = one(page, "gpumem_exporter_sample_duration_seconds")[1]
            if completed - took > moment:
                return page
            assert time.monotonic() < deadline, f"no sample began within {HANG:g}s"
            time.sleep(0.02)


def vllm_page(server: real_vllm.Server) -> Page:
    return parse(real_vllm.get_text(server.metrics_url))


def by_reason(page: Page, name: str, ours: bool) -> dict[str, float]:
    """reason -> value of a family with a `reason` label: the exporter's series of the real
    server (`ours`), or vLLM's own."""
    out = {}
    for labels, value in page.get(name, []):
        if ours and labels.get("endpoint") != ENDPOINT:
            continue
        if labels.get("engine", "0") == "0":
            assert labels["reason"] not in out, (name, page[name])
            out[labels["reason"]] = value
    return out


def test_every_exported_vllm_value_is_on_the_page_and_equals_it_at_rest(main_server, exporter):
    ex = Exporter(exporter)
    # At rest: nothing running or waiting (an earlier test's load has drained).
    real_vllm.wait_until(lambda: (one(p := vllm_page(main_server), "vllm:num_requests_running", engine="0")[1] == 0
                                  and one(p, "vllm:num_requests_waiting", engine="0")[1] == 0),
                         HANG, "the server to be at rest")
    before = vllm_page(main_server)
    page = ex.sampled_after(time.time())
    after = vllm_page(main_server)
    values = exported(page)
    assert one(page, "gpumem_vllm_up", endpoint=ENDPOINT)[1] == 1
    assert set(values) == set(FROM_THE_PAGE), "an exported vLLM family that this test does not know how to " \
        "read off vLLM's page, or a value of the page the exporter no longer exports"
    for name, read in FROM_THE_PAGE.items():
        assert read(before) == read(after), f"{name} moved at rest"
        assert values[name] == pytest.approx(read(before), rel=1e-12, abs=0), name
    served = {n for n, series in page.items() if any(lb.get("endpoint") == ENDPOINT for lb, _ in series)}
    assert set(BY_REASON) <= served, "a family by reason the exporter no longer exports"
    for name, theirs_name in BY_REASON.items():
        assert by_reason(before, theirs_name, ours=False) == by_reason(after, theirs_name, ours=False), name
        assert by_reason(page, name, ours=True) == by_reason(before, theirs_name, ours=False), name
        assert by_reason(page, name, ours=True), f"{name}: no series (vLLM's page has them)"
    labels = one(page, "gpumem_vllm_cache_config_info", endpoint=ENDPOINT)[0]
    theirs = one(before, "vllm:cache_config_info", engine="0")[0]
    assert {k: labels[k] for k in CONFIG_LABELS} == {k: "" if theirs[k] == "None" else theirs[k]
                                                     for k in CONFIG_LABELS}
    # The status page says the same to a person.
    capacity = int(FROM_THE_PAGE["gpumem_vllm_kv_cache_capacity_tokens"](before))
    row = (rf"<td>{ENDPOINT}</td><td>{main_server.served_model_name}</td><td><span class=\"ok\">up</span>"
           r"(?: \(idle: page read \d+ s ago\))?</td>"
           r"<td>host memory \(vLLM&#x27;s CPU backend\): its processes hold \d+\.\d\d [GM]iB</td>"
           rf"<td>0% \(0 of {capacity:,} tokens\), \d+\.\d\d [KMG]iB of host memory</td><td>0</td><td>0</td>")
    assert re.search(row, exporter.get("/").text), row


def _load(server: real_vllm.Server, requests: int, max_tokens: int,
          failures: list[object]) -> list[threading.Thread]:
    """`requests` completions at once, each decoding exactly `max_tokens` tokens; what a request
    did not get right goes in `failures`."""
    def one_request(i: int) -> None:
        try:
            status, answer = real_vllm.post_json(server.url + "/v1/completions", {
                "model": server.served_model_name, "prompt": f"request {i}: how much memory is free",
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
            if status != 200:
                failures.append(answer)
        except Exception as exc:
            failures.append(exc)

    threads = [threading.Thread(target=one_request, args=(i,), daemon=True) for i in range(requests)]
    for thread in threads:
        thread.start()
    return threads


def test_under_load_the_exported_values_lag_the_page_by_at_most_one_sample(main_server, exporter):
    """While a batch of requests decodes, none finishing, the page's counters and KV usage only
    grow and its running/waiting counts stand still. Reading vLLM's page (a), then the exporter's
    first page from a sample that began after that (e), then vLLM's page again (b): a <= e <= b
    for what grows and a == e == b for the rest. The exporter is never more than the one sample
    it has just taken behind."""
    ex = Exporter(exporter)
    # 48 requests of ~500 tokens hold 24,000 of the cache's 32,768 tokens: all decode at once and
    # none waits. While they decode, vLLM answers /metrics late, and a round needs a whole sample
    # of the exporter inside the phase: how many rounds a batch gives depends on the machine's
    # speed, so batches are run until three rounds are checked (bounded by time, not by count).
    batch = 48
    checked = 0
    failures: list[object] = []
    deadline = time.monotonic() + HANG * 3
    while checked < 3:
        assert time.monotonic() < deadline, f"only {checked} samples fell wholly inside a decode phase"
        threads = _load(main_server, batch, 480, failures)
        try:
            checked += _check_rounds(main_server, ex, threads, batch, 3 - checked, failures)
        finally:
            for thread in threads:
                thread.join(HANG * 5)
        assert not failures, failures[:3]


def _check_rounds(server: real_vllm.Server, ex: Exporter, threads: list[threading.Thread], batch: int,
                  wanted: int, failures: list[object]) -> int:
    """Up to `wanted` rounds of a <= e <= b while the batch decodes; how many were checked."""
    checked = 0

    def running() -> float:
        return one(vllm_page(server), "vllm:num_requests_running", engine="0")[1]
    # All of the batch running, or nothing more to wait for: a request failed, or the whole batch
    # ended between two looks (a fast machine: the caller runs another).
    try:
        real_vllm.wait_until(lambda: failures or not any(t.is_alive() for t in threads) or running() == batch,
                             HANG, f"{batch} requests running")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the server's log ends:\n{server.log_tail()}") from None
    assert not failures, (failures[:3], server.log_tail())
    while any(t.is_alive() for t in threads) and checked < wanted:
        a = vllm_page(server)
        page = ex.sampled_after(time.time())
        b = vllm_page(server)
        if [one(p, "vllm:num_requests_running", engine="0")[1] for p in (a, b)] != [batch, batch]:
            continue  # not wholly inside the decode phase
        e = exported(page)
        for name, read in FROM_THE_PAGE.items():
            if name in GROWING:
                assert read(a) <= e[name] <= read(b), (name, read(a), e[name], read(b))
            else:
                assert read(a) == e[name] == read(b), (name, read(a), e[name], read(b))
        assert e["gpumem_vllm_requests_running"] == batch
        checked += 1
    return checked


def test_at_rest_the_page_is_read_less_often_and_at_once_when_requests_come(main_server, exporter):
    """The real server's processes at rest use too little CPU to read its page at every tick (a
    page shown again is older than a tick); a batch of requests makes the next tick read it."""
    ex = Exporter(exporter)
    real_vllm.wait_until(lambda: one(vllm_page(main_server), "vllm:num_requests_running", engine="0")[1] == 0,
                         HANG, "the server to be at rest")
    try:
        real_vllm.wait_until(lambda: one(ex.page(), "gpumem_vllm_page_age_seconds", endpoint=ENDPOINT)[1]
                             >= 2 * INTERVAL, HANG, "a page shown again at rest")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: the server's processes at rest look busy to the exporter") from None
    batch, failures = 48, []
    threads = _load(main_server, batch, 480, failures)
    try:
        real_vllm.wait_until(lambda: failures or not any(t.is_alive() for t in threads)
                             or one(vllm_page(main_server), "vllm:num_requests_running", engine="0")[1] == batch,
                             HANG, f"{batch} requests running")
        assert not failures, (failures[:3], main_server.log_tail())
        # The server is working: the first sample that began after now reads its page.
        page = ex.sampled_after(time.time())
        assert one(page, "gpumem_vllm_page_age_seconds", endpoint=ENDPOINT)[1] == 0
    finally:
        for thread in threads:
            thread.join(HANG * 5)
    assert not failures, failures[:3]
