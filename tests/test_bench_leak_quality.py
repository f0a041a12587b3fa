"""bench/leak_quality.py runs as its README says, on one trace of a probed leak and one of a
leak-free probed family: the bench is the yardstick of #22, so a change that breaks it must fail
here, not in the next round's measurement. Never how fast it runs."""
import json
import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_leak_bench_reports_the_probed_families_with_and_without_the_probe(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "bench/leak_quality.py", "--seeds", "1", "--workers", "1",
                          "--families", "probed_leak_under_sawtooth,probed_mixed", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    traces = {t["name"]: t for t in json.loads(out.read_text())}
    assert set(traces) == {"probed_leak_under_sawtooth#0", "probed_mixed#0"}
    leak, free = traces["probed_leak_under_sawtooth#0"], traces["probed_mixed#0"]
    # A leak outside torch under the cache's cycles: found after its onset on NVML's figure alone
    # (48 min), sooner with the probe's numbers (14 min), so a replay that dropped them would fail.
    assert leak["this tree"] and leak["this tree with probe"], leak
    alone, probed = leak["this tree"][0], leak["this tree with probe"][0]
    assert leak["leak_start"] <= probed < alone
    assert free["this tree"] == free["this tree with probe"] == []
    assert "| probed_leak_under_sawtooth | this tree |" in run.stdout
    assert "1/1 / 1/1 | 0/1 / 0/1 |" in run.stdout
    assert "1 MiB/min leaks found within 30 min on NVML's figure, this tree: 0/1." in run.stdout
    assert "1 MiB/min leaks found within 30 min with the probe's numbers (the probed families), " \
           "this tree: 1/1." in run.stdout
    # The leak-free trace, replayed at every phase, is replayed there with the probe's numbers too.
    assert "| probed_mixed | this tree | 0/1 | 0/1 | 0/1 |" in run.stdout
    # The false-alarm rate the budget bounds: no false alert in the leak-free six hours and the
    # leak's hours before its onset, and the exact Poisson bound on what none allows.
    (days, bound), = re.findall(r"this tree: .*\n  False alerts per process-day: 0 in ([0-9.]+) days before any "
                                r"leak, 0\.000 \(95 % upper bound ([0-9.]+); the default budget 0\.01\)", run.stdout)
    assert 0.25 < float(days) < 0.5
    assert math.isclose(float(bound), -math.log(0.05) / float(days), rel_tol=0.03)  # days printed to 0.01


def test_the_poisson_bound_is_exact():
    sys.path.insert(0, str(ROOT / "bench"))
    from leak_quality import poisson_upper
    # None seen: the mean at which none has probability 5 %; one seen: P(0) + P(1) = 5 %.
    assert math.isclose(poisson_upper(0), -math.log(0.05), rel_tol=1e-9)
    mean = poisson_upper(1)
    assert math.isclose(math.exp(-mean) * (1 + mean), 0.05, rel_tol=1e-9)
