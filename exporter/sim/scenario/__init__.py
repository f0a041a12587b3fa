"""Simulation scenarios: a YAML description of a host whose whole state is a pure function of time.

A scenario lists GPUs, host memory, processes (with a memory curve per GPU and a host RSS curve),
stale memory, vLLM servers and faults. `Scenario.state_at(t)` (t = seconds since the scenario
started) returns everything the fake NVML module, the simulated host and the fake vLLM server
report at that moment, so any run (live, `snapshot --at`, tests) sees the same numbers for the
same t.

One job per module, in the order data flows:

    validate   reading a parsed document: typed values whose errors name their key path
    curves     the curve language (constant, step, ramp, linear, sawtooth, staircase, noise)
    specs      what the file says, validated (GpuSpec, ProcessSpec, VllmSpec, FaultSpec, ...)
    schema     the document's keys, checked into specs (`from_dict`; the key reference is there)
    state      what the host looks like at one moment (State and its parts)
    evaluate   Scenario: specs -> State at time t, memoised per t
    load       built-ins by name, files by path, YAML text (`load`, `loads`, `builtin`)
"""
from .curves import Curve, parse_curve
from .evaluate import Scenario, ScenarioClock
from .load import MAX_SCENARIO_BYTES, SCENARIO_DIR, builtin, load, loads
from .schema import from_dict
from .validate import ScenarioError, parse_duration, parse_rate, parse_size

__all__ = [
    "MAX_SCENARIO_BYTES",
    "SCENARIO_DIR",
    "Curve",
    "Scenario",
    "ScenarioClock",
    "ScenarioError",
    "builtin",
    "from_dict",
    "load",
    "loads",
    "parse_curve",
    "parse_duration",
    "parse_rate",
    "parse_size",
]
