"""The sources run in the order their declarations give: each after whoever fills what it reads.
The runtime lists them in no particular order; the sampler's order is derived, and checked."""
from __future__ import annotations

import itertools

import pytest

from exporter.config import build
from exporter.daemon import Sampler
from exporter.model import Snapshot
from exporter.runtime import build as build_runtime
from exporter.sources.source import GPUS, HOST_MEMORY, PARTS, PROCESS_IDENTITY, Reading, in_order


class Fake:
    def __init__(self, name, needs=(), gives=(), seen=None):
        self.name, self.needs, self.gives = name, tuple(needs), tuple(gives)
        self.seen = seen if seen is not None else []

    def collect(self, snapshot: Snapshot) -> Reading:
        self.seen.append(self.name)
        return Reading(snapshot)

    def close(self) -> None:
        pass


def names(sources):
    return [s.name for s in sources]


def test_each_source_runs_after_the_sources_that_give_what_it_needs_whatever_the_listing():
    seen: list[str] = []
    gpu = Fake("gpu", gives=[GPUS], seen=seen)
    host = Fake("host", needs=[GPUS], gives=[HOST_MEMORY, PROCESS_IDENTITY], seen=seen)
    pods = Fake("pods", needs=[PROCESS_IDENTITY], gives=["pod_names"], seen=seen)
    logs = Fake("logs", gives=["log_events"], seen=seen)
    for listing in itertools.permutations([gpu, host, pods, logs]):
        ordered = names(in_order(listing))
        assert ordered.index("gpu") < ordered.index("host") < ordered.index("pods"), ordered
    seen.clear()
    Sampler([pods, logs, host, gpu]).sample()
    assert seen == ["logs", "gpu", "host", "pods"]  # otherwise as listed: logs needs nothing


def test_a_part_nobody_gives_is_simply_empty():
    assert names(in_order([Fake("pods", needs=[PROCESS_IDENTITY], gives=["pod_names"])])) == ["pods"]


@pytest.mark.parametrize("sources, why", [
    ([Fake("a", needs=["vllm"], gives=["gpus"]), Fake("b", needs=["gpus"], gives=["vllm"])], "in a circle"),
    ([Fake("a", gives=["gpus"]), Fake("b", gives=["gpus"])], "a and b both give gpus"),
    ([Fake("a", needs=["gpu"])], "unknown snapshot part 'gpu'"),
])
def test_declarations_that_cannot_be_ordered_are_refused(sources, why):
    with pytest.raises(ValueError, match=why):
        Sampler(sources)


def test_every_real_source_declares_known_parts_and_the_runtime_order_follows_from_them():
    """The simulated steady host with a vLLM server and a log: the order today's sources have,
    derived from what they declare, not from where the runtime lists them."""
    runtime = build_runtime(build({"logs": {"files": ["/nonexistent.log"]}}), simulate="steady")
    try:
        sources = runtime.sampler.sources
        assert names(sources) == ["nvml", "host", "vllm", "logs"]
        for s in sources:
            assert set(s.needs) | set(s.gives) <= set(PARTS), s.name
        assert [n for n in names(in_order(reversed(sources))) if n != "logs"] == ["nvml", "host", "vllm"]
    finally:
        runtime.close()
