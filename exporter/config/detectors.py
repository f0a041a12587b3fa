"""The `detectors:` section of the configuration file, built from the detectors' own declarations.

Each registered detector (analysis.registry) declares its config type and the keys of it a file
may set, with their meaning; this module turns that into one pydantic section per detector,
`detectors.<name>`, so the schema, check-config, reload and docs/configuration.md know every key
without a list kept here. A key's value type follows its name (`_seconds`, `_bytes`, `_ratio` or
`_share`, else a count or a number). The detector's config type then checks the values across
keys itself (its __post_init__), and its message is reported at the section's path as it is.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import Field, create_model

from ..analysis.detector import DetectorSpec
from ..analysis.registry import DETECTORS
from .fields import EMPTY, Count, Doc, Seconds, Section, Size

Share = Annotated[float, Field(ge=0, le=1), Doc("ratio")]
# A plain number: finite and not negative; the detector checks its own range (__post_init__).
Number = Annotated[float, Field(ge=0, allow_inf_nan=False), Doc("number")]


def _value_type(key: str, default: object) -> Any:
    if key.endswith("_seconds"):
        return Seconds
    if key.endswith("_bytes"):
        return Size
    if key.endswith(("_ratio", "_share")):
        return Share
    return Count if isinstance(default, int) else Number


class DetectorSection(Section):
    """One detector's settings; keys the file leaves out keep the detector's defaults."""

    spec: ClassVar[DetectorSpec[Any]]

    def settings(self) -> Any:
        """The detector's config object. Raises ValueError where values disagree across keys."""
        return self.spec.config(**self.model_dump())

    def problems(self) -> Any:
        try:
            self.settings()
        except ValueError as exc:
            yield "", str(exc)


def section_model(spec: DetectorSpec[Any]) -> type[DetectorSection]:
    known = {f.name for f in dataclasses.fields(spec.config)}
    unknown = sorted(set(spec.settings) - known)
    if unknown:
        raise TypeError(f"detector {spec.name}: settings {unknown} are not fields of {spec.config.__name__}")
    defaults = spec.config()
    fields: dict[str, Any] = {
        key: (_value_type(key, getattr(defaults, key)), Field(getattr(defaults, key), description=doc))
        for key, doc in spec.settings.items()}
    model = create_model(f"{spec.config.__name__}Section", __base__=DetectorSection, __doc__=spec.help,
                         **fields)
    model.spec = spec
    return model


if TYPE_CHECKING:
    DetectorsConfig = Section
else:
    DetectorsConfig = create_model(
        "DetectorsConfig", __base__=Section, __doc__="Every registered detector's settings.",
        **{spec.name: (section_model(spec), Field(default_factory=EMPTY, description=spec.help))
           for spec in DETECTORS})


def detector_settings(detectors: Section) -> dict[str, Any]:
    """{detector name: its config object}, for analysis.engine.AnalysisConfig."""
    return {spec.name: getattr(detectors, spec.name).settings() for spec in DETECTORS}
