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

Why scenarios are not validated with pydantic, as the configuration is (#20): we weighed it and
kept the hand-written reader, for three reasons.
- A scenario replays identically only if every curve gets the seed it has today, and that seed
  is derived from the key path where the curve is written (`processes[2].memory[0]`, per GPU
  and per replica). A pydantic validator is told its field's name, never its path
  (`ValidationInfo` has `field_name` and `data`, no location), so curves would have to be built
  in a second, hand-written pass that walks the document again to rebuild the paths: two
  passes where there is one now.
- Half of the rules relate sections to each other (a process's GPU must exist, a server's pid
  must be a process alive then, two live servers cannot share a port, a pid is not reused while
  alive, faults name existing GPUs and servers). Pydantic runs such model validators only once
  every field is valid, so "every error at once" would still come in two rounds, as with
  `check-config`.
- Estimated rule by rule, the port (models, cross-section validators, the curve language's
  three value kinds as generic component models, the second pass for seeds, UUIDs and
  replicas) comes to about 600 lines against the 675 of validate.py, schema.py and the curve
  reader: not enough smaller to pay for a second pass and new error wording in every test.
What the reader does keep from the configuration: the same YAML reader (config/yamlfile.py:
bounded, duplicate keys refused, file:line in errors), the same unit parser (units.py), and
errors that name the key path ("processes[2].memory[0].linear.rate: ...").
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
