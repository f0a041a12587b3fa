"""The shape of one metric family's declaration, and of the docs section it is described in."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class Type(str, Enum):
    GAUGE = "gauge"
    COUNTER = "counter"


class Stability(str, Enum):
    """What a family promises (docs/metrics.md, "Stability")."""

    STABLE = "stable"  # name, type, labels and meaning change only as a breaking change
    EXPERIMENTAL = "experimental"  # may change in any release


# Base units a name ends with (before `_total` on a counter); "" for a count or a state.
UNITS = ("bytes", "seconds", "ratio", "tokens", "bytes_per_second")


@dataclass(frozen=True)
class Section:
    """A part of docs/metrics.md: a heading, prose before and after its table of families."""

    title: str
    intro: str = ""  # Markdown between the heading and the table
    outro: str = ""  # Markdown after the table (subsections without families of their own)
    level: int = 2  # heading level: 2 for ##, 3 for ###


@dataclass(frozen=True)
class Family:
    """One metric family: everything the exposition, the docs and the checks need to know.

    `name` is the name as served and queried: a counter's ends in `_total`. `help` is the
    HELP line; `doc` the meaning docs/metrics.md gives, which may say more."""

    name: str
    type: Type
    help: str
    labels: tuple[str, ...]
    unit: str
    stability: Stability
    section: Section
    doc: str

    def new(self) -> GaugeMetricFamily | CounterMetricFamily:
        """An empty family to add this scrape's series to."""
        if self.type is Type.COUNTER:
            return CounterMetricFamily(self.name, self.help, labels=list(self.labels))
        return GaugeMetricFamily(self.name, self.help, labels=list(self.labels))

    def of(self, value: float) -> GaugeMetricFamily | CounterMetricFamily:
        """The family with its one series, for a family without labels."""
        family = self.new()
        family.add_metric([], value)
        return family

    @property
    def sample_names(self) -> frozenset[str]:
        """Every name a series of this family may carry in an exposition or a query: a counter's
        family name without `_total` (OpenMetrics' TYPE line) and its `_created` series too."""
        if self.type is Type.COUNTER:
            base = self.name.removesuffix("_total")
            return frozenset({self.name, base, f"{base}_created"})
        return frozenset({self.name})


def gauge(name: str, help: str, labels: tuple[str, ...] = (), *, section: Section, doc: str, unit: str = "",
          stability: Stability = Stability.STABLE) -> Family:
    return Family(name, Type.GAUGE, help, labels, unit, stability, section, doc)


def counter(name: str, help: str, labels: tuple[str, ...] = (), *, section: Section, doc: str, unit: str = "",
            stability: Stability = Stability.STABLE) -> Family:
    return Family(name, Type.COUNTER, help, labels, unit, stability, section, doc)
