"""What `snapshot --simulate NAME --at T` prints for every built-in scenario, against a committed
golden file (tests/golden/snapshot/NAME.metrics). A change to the exposition shows up here as a
reviewable diff; regenerate with the command in tests/golden/README.md."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from exporter.cli import main
from exporter.sim.scenario import builtin, load

GOLDEN_DIR = Path(__file__).parent / "golden" / "snapshot"

# The moment of a scenario where what it is about shows in a single sample, where it is not half
# way through (moment()).
AT = {
    "contention": 5000,  # the notebook holds ~9 GiB beside vLLM: the card is over 95 % used
    "fleet-8x64": 600,  # 8 GPUs x 64 processes
    "fragmentation": 3000,  # KV cache full, preemptions climbing, 40 % of the card free
    "gpu-lost": 900,  # GPU 1 is lost: gpumem_gpu_up 0 and no memory series for it
    "leak": 18000,  # 5 h in: the EngineCore has grown ~1.1 GiB on the GPU, ~5.7 GiB of RSS
    "mig": 600,  # two MIG instances, one vLLM server on each
    "pressure": 1500,  # the embedder's second model: over 90 % used, admission closed
    "stale-memory": 1500,  # 20 GiB held by no process; the restarted server at 0.6
    "steady": 3600,  # TP=2 vLLM at its plateau
    "unified-memory": 10300,  # GB10 after the OOM kill: no NVML memory info, PSI high, 1 kill
}

# What must vary between runs, and nothing else:
# - the exporter's own process (process_*, python_*): this test process's CPU, memory and fds;
_OWN_PROCESS = re.compile(r"^(# (HELP|TYPE) )?(process|python)_\w+")
# - wall-clock measurements: how long sampling and each scrape took;
_TIMINGS = ("gpumem_exporter_sample_duration_seconds", "gpumem_exporter_source_duration_seconds",
            "gpumem_vllm_scrape_duration_seconds")
# - the simulated clock's start, a whole minute of the real time the snapshot ran at;
_STARTED = ("gpumem_exporter_last_sample_timestamp_seconds",)
# - the Python and package versions in the build info.
_VERSIONS = re.compile(r'\b(python|version)="[^"]*"')


def normalise(text: str) -> str:
    out = []
    for line in text.splitlines():
        if _OWN_PROCESS.match(line):
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        if name in _TIMINGS or name in _STARTED:
            line = line.rsplit(" ", 1)[0] + " <varies>"
        elif name == "gpumem_exporter_build_info":
            line = _VERSIONS.sub(r'\1="X"', line)
        out.append(line)
    return "\n".join(out) + "\n"


def snapshot(name: str) -> str:
    unset = {key: None for key in os.environ if key.startswith("GPUMEM_")}  # no outside settings
    result = CliRunner(env=unset).invoke(main, ["--log-level", "warning", "snapshot", "--simulate", name,
                                                "--at", str(moment(name))])
    assert result.exit_code == 0, result.output
    return normalise(result.stdout)


def moment(name: str) -> float:
    return AT.get(name, load(name).duration / 2)


def test_every_moment_names_a_builtin_scenario():
    assert set(AT) <= {listed.name for listed in builtin()}


@pytest.mark.parametrize("name", sorted(listed.name for listed in builtin()))
def test_snapshot_matches_golden(name):
    text = snapshot(name)
    golden = GOLDEN_DIR / f"{name}.metrics"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"no golden file for {name}; see tests/golden/README.md"
    assert text == golden.read_text(), (
        f"`snapshot --simulate {name} --at {moment(name)}` changed; if that is intended, regenerate "
        "(tests/golden/README.md) and review the diff")


def test_normalise_masks_only_what_varies():
    text = ('gpumem_exporter_build_info{driver_version="570.172.08",python="3.11.7",version="0.1.0"} 1.0\n'
            "# TYPE process_open_fds gauge\nprocess_open_fds 6.0\n"
            'gpumem_exporter_sample_duration_seconds{source="nvml"} 0.0007\n'
            'gpumem_gpu_memory_used_bytes{gpu="0",uuid="GPU-1"} 7.2e+10\n')
    assert normalise(text) == (
        'gpumem_exporter_build_info{driver_version="570.172.08",python="X",version="X"} 1.0\n'
        'gpumem_exporter_sample_duration_seconds{source="nvml"} <varies>\n'
        'gpumem_gpu_memory_used_bytes{gpu="0",uuid="GPU-1"} 7.2e+10\n')
