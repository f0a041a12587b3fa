"""vLLM as it is today (0.33): the budget with --kv-cache-memory, KV capacity, sleep mode,
and a saturated KV cache that vLLM's preemption counter does not show yet.

Pages and logs are the fixtures rendered by vLLM 0.33's own code (tests/fixtures/vllm/).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from exporter.analysis.budget import memory_budgets
from exporter.analysis.engine import Analyzer
from exporter.analysis.kv_cache import kv_caches
from exporter.model import State, VllmEngineStats, VllmSample
from exporter.serve.exposition import StateCollector
from exporter.sources.vllm_log import read_profile
from exporter.sources.vllm_normalise import normalise
from helpers.timeline import T0, GiB, gpu, snap, vllm_proc

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
EP = "http://127.0.0.1:8000"


def server(page: str, log: str | None = None, **engine) -> VllmSample:
    """A VllmSample from a fixture page (and log), its engine 0's numbers overridden by `engine`."""
    parsed = normalise((FIXTURES / page).read_text())
    engines = tuple(dataclasses.replace(e, **engine) for e in parsed.engines)
    startup = read_profile(str(FIXTURES / log)) if log else None
    return VllmSample(endpoint=EP, up=True, engines=engines, cache_config=parsed.cache_config,
                      startup=startup)


def render(state: State) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value of everything the collector renders."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(lambda: state, lambda: state.snapshot.timestamp))
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# ------------------------------------------------------------------ budget
def test_kv_cache_memory_budget_is_kv_bytes_plus_non_kv_memory_not_a_fraction_of_the_total():
    s = server("v0_33_kv_cache_memory.prom", "v0_33_kv_cache_memory.log")
    assert s.cache_config.kv_cache_memory_bytes == 32 * GiB
    assert s.cache_config.gpu_memory_utilization == 0.92  # still on the page, but vLLM ignores it
    (budget,) = memory_budgets(snap(T0, [gpu([vllm_proc(10, 50 * GiB)])], vllm=[s]))
    p = s.startup
    assert budget.budget_bytes == 32 * GiB + p.weights_bytes + p.cuda_graph_bytes
    assert budget.budget_bytes != int(0.92 * 80 * GiB)
    assert budget.basis == "kv_cache_memory"


def test_kv_cache_memory_budget_is_unknown_without_the_start_up_profile():
    s = server("v0_33_kv_cache_memory.prom")
    (budget,) = memory_budgets(snap(T0, [gpu([vllm_proc(10, 50 * GiB)])], vllm=[s]))
    assert budget.budget_bytes is None  # never gpu_memory_utilization x total


def test_utilisation_budget_still_applies_without_kv_cache_memory():
    s = server("v0_33_tp1_dp2.prom")
    (budget,) = memory_budgets(snap(T0, [gpu([vllm_proc(10, 50 * GiB)])], vllm=[s]))
    assert budget.budget_bytes == int(0.92 * 80 * GiB) and budget.basis == "gpu_memory_utilization"


def test_pressure_admission_and_beyond_budget_follow_the_kv_cache_memory_budget():
    """A --kv-cache-memory server (~48 GiB planned) using 75 GiB of an 80 GiB GPU: 27 GiB
    beyond its budget. Read as 0.92 x total (73.6 GiB) only 1.4 GiB (< 2 %) would be."""
    s = server("v0_33_kv_cache_memory.prom", "v0_33_kv_cache_memory.log")
    analyzer = Analyzer(log_findings=False)
    result = analyzer.update(snap(T0, [gpu([vllm_proc(10, 75 * GiB)], extra=0)], vllm=[s]))
    budget = result.budgets[0].budget_bytes
    (g,) = result.gpus
    assert g.beyond_budget_bytes == 75 * GiB - budget > 25 * GiB
    assert not g.admission_open  # 94 % used, much of it unplanned
    assert [f.kind for f in result.findings] == ["pressure"]


# ------------------------------------------------------------------ KV capacity
def test_kv_capacity_bytes_in_use_and_requests_that_fit():
    s = server("v0_33_kv_cache_memory.prom", "v0_33_kv_cache_memory.log", kv_cache_usage_ratio=0.25)
    (kv,) = kv_caches(snap(T0, vllm=[s]))
    assert (kv.capacity_tokens, kv.capacity_bytes) == (262_144, 32 * GiB)
    assert (kv.used_tokens, kv.used_bytes) == (65_536, 8 * GiB)
    assert (kv.max_model_len, kv.max_concurrency) == (32_768, 8.0)


def test_kv_capacity_without_the_log_uses_the_page_alone():
    s = server("v0_33_tp1_dp2.prom")
    caches = kv_caches(snap(T0, vllm=[s]))
    assert {k.engine for k in caches} == {"0", "1"}
    k = caches[0]
    assert k.capacity_tokens == 441_344 and k.max_concurrency == 13.47
    assert k.capacity_bytes is None and k.used_bytes is None  # no bytes figure: absent, not guessed
    assert k.max_model_len == round(441_344 / 13.47)


def test_kv_capacity_from_blocks_and_the_log_for_older_servers():
    from exporter.model import CacheConfig, MemoryProfile
    s = VllmSample(endpoint=EP, up=True, engines=(VllmEngineStats(kv_cache_usage_ratio=0.5),),
                   cache_config=CacheConfig(gpu_memory_utilization=0.9, num_gpu_blocks=1000, block_size=16),
                   startup=MemoryProfile(kv_cache_bytes=4 * GiB, max_model_len=4000))
    (k,) = kv_caches(snap(T0, vllm=[s]))
    assert (k.capacity_tokens, k.used_tokens, k.used_bytes) == (16_000, 8_000, 2 * GiB)
    assert k.max_concurrency == 4.0


def test_kv_capacity_and_sleep_state_are_exported():
    s = server("v0_33_kv_cache_memory.prom", "v0_33_kv_cache_memory.log", kv_cache_usage_ratio=0.25)
    snapshot = snap(T0, [gpu([vllm_proc(10, 50 * GiB)])], vllm=[s])
    values = render(State(snapshot=snapshot, analysis=Analyzer(log_findings=False).update(snapshot)))
    labels = frozenset({"endpoint": EP, "engine": "0", "model": "meta-llama/Llama-3.1-8B-Instruct"}.items())
    assert values[("gpumem_vllm_kv_cache_used_bytes", labels)] == 8 * GiB
    assert values[("gpumem_vllm_kv_cache_capacity_bytes", labels)] == 32 * GiB
    assert values[("gpumem_vllm_kv_cache_used_tokens", labels)] == 65_536
    assert values[("gpumem_vllm_kv_cache_capacity_tokens", labels)] == 262_144
    assert values[("gpumem_vllm_kv_cache_max_concurrency", labels)] == 8.0
    assert values[("gpumem_vllm_max_model_len_tokens", labels)] == 32_768
    assert values[("gpumem_vllm_engine_sleep_state", frozenset({"endpoint": EP, "engine": "0"}.items()))] == 0


def test_sleep_levels_are_exported_as_numbers():
    for page, level in (("v0_33_sleep_level1.prom", 1.0), ("v0_33_sleep_level2.prom", 2.0)):
        values = render(State(snapshot=snap(T0, vllm=[server(page)])))
        assert values[("gpumem_vllm_engine_sleep_state", frozenset({"endpoint": EP, "engine": "0"}.items()))] == level


# ------------------------------------------------------------------ sleep mode
AWAKE, LEVEL1 = "awake", "weights_offloaded"


def sleeping_server(state: str) -> VllmSample:
    return server("v0_33_tp1_dp2.prom", "v0_33_failed_then_restarted.log", sleep_state=state)


def cycle(before, asleep, after, level=LEVEL1, step=10, sleep_at=600, wake_at=900, end=1500,
          used_gpu=None):
    """One server: `before` bytes awake, `asleep` bytes from sleep_at, `after` bytes from wake_at."""
    out = []
    for e in range(0, end + 1, step):
        state = AWAKE if e < sleep_at or e >= wake_at else level
        used = before if e < sleep_at else asleep if e < wake_at else after
        g = gpu([vllm_proc(10, used, endpoint=EP, start=T0)],
                used=None if used_gpu is None else used_gpu(e, used))
        out.append(snap(T0 + e, [g], vllm=[sleeping_server(state)]))
    return out


def replay(snapshots):
    analyzer = Analyzer(log_findings=False)
    return analyzer, [analyzer.update(s) for s in snapshots]


def test_a_cycle_that_gives_memory_back_raises_nothing():
    analyzer, _ = replay(cycle(70 * GiB, 1 * GiB, 70 * GiB))
    assert [f.kind for f in analyzer.all_findings] == []


def test_a_cycle_that_keeps_memory_is_a_sleep_leak_with_the_numbers():
    analyzer, _ = replay(cycle(70 * GiB, 1 * GiB, 72 * GiB))
    (f,) = [f for f in analyzer.all_findings if f.kind == "sleep_leak"]
    ev = dict(f.evidence)
    assert ev["signal"] == "not_given_back" and f.endpoint == EP and f.gpu == "0"
    assert (ev["before_sleep_bytes"], ev["asleep_bytes"], ev["after_wake_bytes"], ev["kept_bytes"]) == (
        70 * GiB, 1 * GiB, 72 * GiB, 2 * GiB)
    assert f.first_detected_at >= T0 + 900 + 60  # judged once settled after wake
    assert "did not give memory back" in f.summary


def test_a_sleep_that_frees_much_less_than_expected_is_a_sleep_leak():
    analyzer, _ = replay(cycle(70 * GiB, 40 * GiB, 70 * GiB, end=800))
    (f,) = [f for f in analyzer.all_findings if f.kind == "sleep_leak"]
    ev = dict(f.evidence)
    assert ev["signal"] == "freed_too_little" and ev["freed_bytes"] == 30 * GiB
    p = sleeping_server(LEVEL1).startup
    assert ev["expected_freed_bytes"] == p.kv_cache_bytes + p.weights_bytes


def test_the_log_shows_still_in_use_memory_growing_from_one_sleep_to_the_next():
    """v0_33_failed_then_restarted.log: 1.21 GiB still in use after the first sleep, 3.05 after
    the second (vLLM 0.33's own log lines)."""
    first = read_profile(str(FIXTURES / "v0_33_failed_then_restarted.log"))
    one_sleep = dataclasses.replace(first, sleeps=1, sleep_still_in_use_bytes=int(1.21 * GiB),
                                    sleep_freed_bytes=int(70.25 * GiB))
    base = server("v0_33_tp1_dp2.prom")
    snaps = [snap(T0 + e, vllm=[dataclasses.replace(base, startup=one_sleep if e < 300 else first)])
             for e in range(0, 600, 10)]
    analyzer, _ = replay(snaps)
    (f,) = [f for f in analyzer.all_findings if f.kind == "sleep_leak"]
    ev = dict(f.evidence)
    assert ev["signal"] == "log_still_in_use_grew" and ev["sleeps"] == 2
    assert ev["kept_bytes"] == first.sleep_still_in_use_bytes - int(1.21 * GiB)


def test_stale_memory_is_not_raised_while_a_server_sleeps():
    """The device's figure lags the process's around a sleep: 60 GiB unowned for 5 minutes."""
    def lagging(e, used):
        return used + (60 * GiB if 600 <= e < 900 else 0)
    analyzer, _ = replay(cycle(70 * GiB, 1 * GiB, 70 * GiB, used_gpu=lagging))
    assert "stale_memory" not in {f.kind for f in analyzer.all_findings}
    # the same numbers with the server awake throughout are stale memory
    awake = [dataclasses.replace(s, vllm=(sleeping_server(AWAKE),))
             for s in cycle(70 * GiB, 1 * GiB, 70 * GiB, used_gpu=lagging)]
    analyzer, _ = replay(awake)
    assert "stale_memory" in {f.kind for f in analyzer.all_findings}


def test_a_sleeping_server_is_not_judged_by_the_leak_detector():
    from helpers.timeline import leaking_server
    leaking = leaking_server(3600, 8 * 1024 * 1024)
    analyzer, _ = replay(leaking)
    assert "leak" in {f.kind for f in analyzer.all_findings}  # awake: a leak
    endpoint = leaking[0].vllm[0].endpoint
    asleep = [dataclasses.replace(s, vllm=(dataclasses.replace(
        s.vllm[0], endpoint=endpoint,
        engines=(VllmEngineStats(engine="0", sleep_state=LEVEL1),)),)) for s in leaking]
    analyzer, _ = replay(asleep)
    assert "leak" not in {f.kind for f in analyzer.all_findings}


# ------------------------------------------------------------------ KV saturation
def saturated(seconds, usage=0.99, waiting=lambda e: 2 + e // 30, preemptions=lambda e: 3.0, step=10):
    return [snap(T0 + e, [gpu([vllm_proc(10, 70 * GiB, endpoint=EP)])],
                 vllm=[server("v0_33_kv_cache_memory.prom", "v0_33_kv_cache_memory.log",
                              kv_cache_usage_ratio=usage, requests_waiting=float(waiting(e)),
                              requests_running=31.0, preemptions_total=preemptions(e))])
            for e in range(0, seconds + 1, step)]


def test_a_full_kv_cache_with_a_queue_and_no_preemption_is_seen():
    analyzer, _ = replay(saturated(300))
    (f,) = [f for f in analyzer.all_findings if f.kind == "kv_saturation"]
    ev = dict(f.evidence)
    # The window (60 s) must be half covered before it is judged: 4 samples 10 s apart.
    assert f.first_detected_at == T0 + 30 and f.endpoint == EP
    assert ev["preemptions_in_window"] == 0 and ev["full_share"] == 1.0 and ev["queued_share"] == 1.0
    assert (ev["kv_cache_capacity_tokens"], ev["max_model_len"], ev["max_concurrency"]) == (262_144, 32_768, 8.0)
    assert "no preemption counted" in f.summary
    advice = " ".join(f.advice)
    assert "--max-num-seqs" in advice and "--max-model-len 32,768" in advice
    assert "--kv-cache-memory-bytes (now 32.00 GiB)" in advice  # the knob this server uses


def test_no_kv_saturation_when_the_cache_has_room_or_nobody_waits():
    for snaps in (saturated(300, usage=0.9), saturated(300, waiting=lambda e: 0)):
        analyzer, _ = replay(snaps)
        assert "kv_saturation" not in {f.kind for f in analyzer.all_findings}


def test_a_saw_tooth_is_one_episode_and_a_dip_does_not_clear_it():
    """Full in two samples of three, a dip to half in the third, requests waiting throughout:
    one finding from the first judged window to the end (the old rule, full in every sample
    for 120 s, never fired on this)."""
    usage = {0: 0.99, 1: 0.99, 2: 0.5}
    snaps = [dataclasses.replace(s, vllm=(dataclasses.replace(s.vllm[0], engines=(dataclasses.replace(
        s.vllm[0].engines[0], kv_cache_usage_ratio=usage[i % 3]),)),))
        for i, s in enumerate(saturated(600, step=5))]
    analyzer, _ = replay(snaps)
    episodes = [(f, cleared) for f, cleared in analyzer.episodes() if f.kind == "kv_saturation"]
    assert len(episodes) == 1 and episodes[0][1] is None
    # The load stops: the cache empties, nobody waits; the finding clears within two windows.
    idle = [dataclasses.replace(s, timestamp=s.timestamp + 605, vllm=(dataclasses.replace(
        s.vllm[0], engines=(dataclasses.replace(s.vllm[0].engines[0], kv_cache_usage_ratio=0.0,
                                                requests_waiting=0.0),)),)) for s in saturated(120, step=5)]
    for s in idle:
        analyzer.update(s)
    ((_, cleared),) = [(f, c) for f, c in analyzer.episodes() if f.kind == "kv_saturation"]
    assert cleared is not None and cleared <= T0 + 605 + 120
