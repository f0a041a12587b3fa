"""The leak detector on the probed families of bench/leak_corpus.py (#22, item 3), replayed
through History and LeakDetector.detect tick by tick with the allocator probe's numbers, as the
daemon reads them: torch allocated and reserved, reserved read up to one sample before NVML's
figure, as a real probe's is. The probe's parts (torch allocated, and non-torch = NVML used -
reserved) are tested as series of their own.
"""
import sys
from pathlib import Path

import pytest

from helpers.leak_replay import episodes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from leak_corpus import T0, make_trace


# (seed, minutes after the onset the probe's numbers find it within; NVML's figure alone takes 48
# and 82 min on these seeds. With the probe's reserved clipped to NVML used, as the corpus had it,
# seed 0 took 48 min too: it is the one that guards round 12; seed 6 took 9.9 min either way)
@pytest.mark.parametrize("seed,within", [(0, 20), (6, 20)])
def test_a_slow_leak_outside_torch_under_the_cache_s_cycles_is_found_sooner_with_the_probe(seed, within):
    # 1 MiB/min outside torch (NCCL, CUDA graphs) under teeth of 256 MiB-2 GiB. The probe reads
    # reserved up to a sample before NVML reads used, so non-torch (used - reserved) jumps by a
    # 20 MiB segment where the cache grew in between, and has no figure where it shrank past it.
    trace = make_trace("probed_leak_under_sawtooth", seed)
    onset = (trace.leak_start - T0) / 60
    probed = episodes(trace.times, trace.values, allocated=trace.allocated, reserved=trace.reserved)
    alone = episodes(trace.times, trace.values)
    for found in (probed, alone):
        assert found and all(m >= onset for m in found), (trace.name, onset, found)
    assert probed[0] - onset <= within < alone[0] - onset, (trace.name, probed[0] - onset, alone[0] - onset)


@pytest.mark.parametrize("family,seed", [
    ("probed_sawtooth", 0), ("probed_sawtooth", 1), ("probed_mixed", 0), ("probed_mixed", 1),
    # Found in round 21 on seeds 11000-11015, raised by e3b8657 as well (at +15 s and +0 s), not fixed:
    pytest.param("probed_sawtooth", 11006, marks=pytest.mark.xfail(
        strict=True, reason="non-torch read as a staircase of four steps in five minutes at minute 126 "
                            "(the probe's reserved read a sample late puts segment-sized jumps in it)"))])
def test_leak_free_probed_traces_raise_nothing_with_the_probe_s_numbers(family, seed):
    # probed_sawtooth: the cache's cycles in reserved, read late, put segment-sized jumps in
    # non-torch, and no figure at all where a tooth's fall exceeds what is outside torch.
    # probed_mixed: a warm-up's steps in torch allocated, under smaller teeth.
    trace = make_trace(family, seed)
    assert episodes(trace.times, trace.values, allocated=trace.allocated, reserved=trace.reserved) == []


def test_growth_the_probe_puts_in_live_tensors_is_judged_by_their_own_series():
    """A young warm-up's steps in torch allocated under the cache's cycles (11 minutes, 80 MiB):
    NVML's figure alone reads them as a 17-minute line through the per-minute floor at z 13.4 (young
    bar 8.0). The probe puts that growth in torch allocated, whose own series, quieter and tested
    under the same budget, shows steps: its verdict decides, and no leak is raised."""
    trace = make_trace("probed_mixed", 11007)
    assert [round(m, 1) for m in episodes(trace.times, trace.values)] == [38.2]
    assert episodes(trace.times, trace.values, allocated=trace.allocated, reserved=trace.reserved) == []
