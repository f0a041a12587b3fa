"""Lines a scenario's vLLM servers write to their logs while they run (`vllm[].log`), such as an
out-of-memory error at a given moment: appended to the server's log file when the clock passes
their time, just before the `logs` source reads (`LoggedSource`), the way the probes' files are
brought up to the clock's moment (sim/probes.py). The exporter reads them with the same tailer
and parser as a real server's log."""
from __future__ import annotations

from ..model import Snapshot
from ..sources.source import Reading, Source
from .scenario import Scenario, ScenarioClock


class SimulatedLogs:
    def __init__(self, scenario: Scenario, clock: ScenarioClock, files: dict[int, str]):
        self.scenario = scenario
        self.clock = clock
        self.files = files  # server index -> its log file
        self._written = dict.fromkeys(files, 0)  # lines appended so far, per server

    def write(self) -> None:
        """Append every line whose moment has come and that is not in its log yet."""
        t = self.clock.elapsed()
        for index, path in self.files.items():
            lines = self.scenario.vllm[index].log_lines
            due = [text for at, text in lines[self._written[index]:] if at <= t]
            if due:
                with open(path, "a", encoding="utf-8") as fh:
                    fh.write("".join(f"{text}\n" for text in due))
                self._written[index] += len(due)


class LoggedSource:
    """The `logs` source over a simulated host: the servers write, then the source reads."""

    def __init__(self, logs: SimulatedLogs, source: Source):
        self.logs = logs
        self.source = source
        self.name, self.needs, self.gives = source.name, source.needs, source.gives

    def collect(self, snapshot: Snapshot) -> Reading:
        self.logs.write()
        return self.source.collect(snapshot)

    def close(self) -> None:
        self.source.close()
