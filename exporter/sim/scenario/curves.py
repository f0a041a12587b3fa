"""The curve language: a value over time as a sum of components.

    constant: 1GiB                        (a bare scalar is shorthand for this)
    step:     {at: 600, to: 20GiB}        (`from` before `at`, default 0; or {at, by})
    ramp:     {weights: 15GiB, kv_cache: 50GiB, ...}   a vLLM start-up (see `_ramp`)
    linear:   {from: 300, rate: 4MiB/min, until: 7200} grows from time `from` to `until`
    sawtooth: {period: 120, amplitude: 1GiB}           rises over each period, then drops
    staircase: {every: 600, step: 256MiB}              jumps by `step` every `every` seconds
    noise:    {stddev: 32MiB, seed: 7}                 hash-based: a pure function of (seed, t)

Every component is a pure function of t, so a curve gives the same value for the same t in any
run, in any order of evaluation.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .validate import (
    Node,
    ScenarioError,
    integer,
    nonneg,
    number,
    parse_duration,
    parse_rate,
    parse_size,
    plain_number,
    positive,
    size_nonneg,
    type_name,
)

Component = Callable[[float], float]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def hash_normal(seed: int, bucket: int) -> float:
    """A standard normal deviate that depends only on (seed, bucket): no hidden RNG state."""
    h1 = _splitmix64((seed * 1_000_003) ^ (bucket & 0xFFFFFFFFFFFFFFFF))
    h2 = _splitmix64(h1)
    u1 = ((h1 >> 11) + 1) / 9007199254740993.0  # (0, 1]
    u2 = (h2 >> 11) / 9007199254740992.0
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def constant(v: float) -> Component:
    return lambda t: v


def _step(at: float, before: float, after: float) -> Component:
    return lambda t: after if t >= at else before


def _linear(start: float, rate: float, until: float | None) -> Component:
    if until is None:
        return lambda t: rate * (t - start) if t > start else 0.0
    return lambda t: rate * (min(t, until) - start) if t > start else 0.0


def _sawtooth(period: float, amplitude: float, phase: float) -> Component:
    return lambda t: amplitude * (((t + phase) % period) / period)


def _staircase(every: float, step: float, start: float, until: float | None) -> Component:
    def f(t: float) -> float:
        if t < start:
            return 0.0
        if until is not None:
            t = min(t, until)
        return step * math.floor((t - start) / every)
    return f


def _noise(stddev: float, seed: int, every: float) -> Component:
    return lambda t: stddev * hash_normal(seed, math.floor(t / every))


def _ramp(at: float, non_torch: float, weights: float, load_seconds: float, profile_peak: float,
          profile_seconds: float, kv_cache: float, cuda_graphs: float, graph_seconds: float) -> Component:
    """vLLM start-up: load weights, profile (activation spike), preallocate KV, capture graphs."""
    t1, t2 = load_seconds, load_seconds + profile_seconds
    t3 = t2 + graph_seconds
    plateau = non_torch + weights + kv_cache + cuda_graphs

    def f(t: float) -> float:
        t -= at
        if t < 0:
            return 0.0
        if t >= t3:
            return plateau
        if t < t1:
            return non_torch + weights * (t / t1)
        if t < t2:
            return non_torch + weights + profile_peak
        return non_torch + weights + kv_cache + cuda_graphs * ((t - t2) / graph_seconds)
    return f


@dataclass(frozen=True)
class Curve:
    """A sum of components."""

    components: tuple[Component, ...] = ()
    startup: Mapping[str, float] | None = None  # the ramp's figures, for the simulated vLLM log

    def __call__(self, t: float) -> float:
        return sum(c(t) for c in self.components) if self.components else 0.0

    @staticmethod
    def zero() -> Curve:
        return Curve(())


COMPONENTS = ("constant", "step", "ramp", "linear", "sawtooth", "staircase", "noise")


class _Reading:
    """What one curve's components share while they are read."""

    def __init__(self, bytes_: bool, seed_base: int):
        self.bytes_ = bytes_
        self.value = parse_size if bytes_ else plain_number  # "1GiB" only where values are bytes
        self.seed_base = seed_base
        self.monotonic = True  # stays True while no component can decrease
        self.startup: dict[str, float] | None = None

    def component(self, kind: str, params: Any, item_path: str) -> Component:
        """One component; `item_path` is where it is written (the seed of its noise)."""
        if kind == "constant":
            return constant(self.value(params, f"{item_path}.{kind}"))
        n = Node(params, f"{item_path}.{kind}")
        made: Component = getattr(self, "_" + kind)(n, item_path)
        n.done()
        return made

    def _step(self, n: Node, item_path: str) -> Component:
        at = n.get("at", parse_duration)
        if n.has("by") == n.has("to"):
            raise ScenarioError(f"{n.path}: give exactly one of 'to' or 'by'")
        if n.has("by"):
            before, after = 0.0, n.get("by", self.value)
        else:
            before, after = n.get("from", self.value, 0.0), n.get("to", self.value)
        self.monotonic &= after >= before
        return _step(at, before, after)

    def _ramp(self, n: Node, item_path: str) -> Component:
        if not self.bytes_:
            raise ScenarioError(f"{n.path}: a ramp is a memory start-up; use it in memory curves only")
        self.startup = {
            "at": n.get("at", parse_duration, 0.0),
            "non_torch": n.get("non_torch", size_nonneg, 0.0),
            "weights": n.get("weights", size_nonneg),
            "load_seconds": n.get("load_seconds", positive, 60.0),
            "profile_peak": n.get("profile_peak", size_nonneg, 0.0),
            "profile_seconds": n.get("profile_seconds", positive, 15.0),
            "kv_cache": n.get("kv_cache", size_nonneg),
            "cuda_graphs": n.get("cuda_graphs", size_nonneg, 0.0),
            "graph_seconds": n.get("graph_seconds", positive, 20.0),
        }
        self.monotonic = False
        return _ramp(**self.startup)

    def _linear(self, n: Node, item_path: str) -> Component:
        start = n.get("from", parse_duration, 0.0)
        rate = n.get("rate", parse_rate)  # "2MiB/min" for bytes, "12/min" for counts
        until = n.get("until", parse_duration, None)
        if until is not None and until < start:
            raise ScenarioError(f"{n.sub('until')}: must not be before 'from'")
        self.monotonic &= rate >= 0
        return _linear(start, rate, until)

    def _sawtooth(self, n: Node, item_path: str) -> Component:
        self.monotonic = False
        return _sawtooth(n.get("period", positive), n.get("amplitude", self.value), n.get("phase", number, 0.0))

    def _staircase(self, n: Node, item_path: str) -> Component:
        every = n.get("every", positive)
        step = n.get("step", self.value)
        start = n.get("from", parse_duration, 0.0)
        until = n.get("until", parse_duration, None)
        self.monotonic &= step >= 0
        return _staircase(every, step, start, until)

    def _noise(self, n: Node, item_path: str) -> Component:
        # The default seed depends on where the curve is written: two noisy curves differ.
        default_seed = (self.seed_base ^ zlib.crc32(item_path.encode())) & 0x7FFFFFFF
        self.monotonic = False
        return _noise(n.get("stddev", size_nonneg if self.bytes_ else nonneg),
                      n.get("seed", integer, default_seed), n.get("every", positive, 1.0))


def parse_curve(value: Any, path: str, *, bytes_: bool, seed_base: int = 0,
                counter: bool = False) -> Curve:
    """A curve from a scalar (constant), a one-component mapping, or a list of components.

    `bytes_` selects whether values take size units ("1GiB") or must be plain numbers.
    `counter` allows only components that never decrease (a Prometheus counter never does).
    """
    reading = _Reading(bytes_, seed_base)
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return Curve((constant(reading.value(value, path)),))
    if isinstance(value, Mapping):
        items, paths = [value], [path]
    elif isinstance(value, list):
        items, paths = value, [f"{path}[{i}]" for i in range(len(value))]
    else:
        raise ScenarioError(f"{path}: expected a curve (a number, a component or a list), got {type_name(value)}")
    components = []
    for item, p in zip(items, paths, strict=True):
        if not isinstance(item, Mapping) or len(item) != 1:
            raise ScenarioError(f"{p}: expected one component, one of: {', '.join(COMPONENTS)}")
        (kind, params), = item.items()
        if kind not in COMPONENTS:
            raise ScenarioError(f"{p}.{kind}: unknown curve component (expected one of: {', '.join(COMPONENTS)})")
        components.append(reading.component(kind, params, p))
    if counter and not reading.monotonic:
        raise ScenarioError(f"{path}: a counter may only use components that never decrease "
                            "(constant, step up, linear with rate >= 0, staircase with step >= 0)")
    return Curve(tuple(components), MappingProxyType(reading.startup) if reading.startup else None)
