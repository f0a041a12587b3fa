"""The building blocks of the configuration schemas: the value types (seconds, sizes, counts,
addresses, URLs, paths), the section base class, and ConfigError, which turns pydantic's
errors into one line per problem, each naming its key path.
"""
from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, get_args
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .. import units

DEFAULT_PORT = 9842
MAX_SECONDS = 366 * 86400.0  # longer is a typo, and too long for a thread's wait
MAX_PROBLEMS_SHOWN = 50
EMPTY: Any = dict  # the default of a section: an absent one is checked as {} (validate_default)


class ConfigError(ValueError):
    """Every problem found, one per line: 'key.path: what is wrong'."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        shown = self.problems[:MAX_PROBLEMS_SHOWN]
        if len(self.problems) > len(shown):
            shown.append(f"... and {len(self.problems) - len(shown)} more")
        super().__init__("\n".join(shown))


@dataclass(frozen=True)
class Doc:
    """How docs/configuration.md names a value's type."""

    type: str


@dataclass(frozen=True)
class OnRestart:
    """Marks a key (or a whole section) that a reload does not change: it takes effect only when
    the daemon restarts, and a reload that changes it says so. Read by `restart_keys`."""


RESTART = OnRestart()


def restart_keys(model: type[BaseModel], prefix: str = "") -> tuple[str, ...]:
    """The dotted key paths marked RESTART in `model`, in the schema's order."""
    out: list[str] = []
    for name, info in model.model_fields.items():
        typ = info.annotation
        if RESTART in info.metadata:
            out.append(prefix + name)
        elif isinstance(typ, type) and issubclass(typ, BaseModel):
            out += restart_keys(typ, f"{prefix}{name}.")
    return tuple(out)


def fail(message: str, key: str = "", more: list[tuple[str, str]] | None = None) -> PydanticCustomError:
    """A problem for pydantic to report at the value being checked; `key` extends its path, and
    `more` adds (key, message) problems of the same section."""
    return PydanticCustomError("config", "{message}", {"message": message, "key": key, "more": more or []})


def show(value: Any) -> str:
    """A value for an error message, never the repr of something huge."""
    if isinstance(value, str):
        return repr(value if len(value) <= 64 else value[:64] + "...")
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if abs(value) < 10**30 else "a number with more than 30 digits"
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return type(value).__name__


class Section(BaseModel):
    """One mapping of the file: unknown keys are errors, nothing is coerced (a quoted "5" is not
    a number, 1 is not true), and `problems()` adds the checks that concern several keys."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False,
                              validate_default=True)  # an absent section is checked as {}

    def problems(self) -> Iterator[tuple[str, str]]:
        """(key, message) for each rule across keys that this section breaks."""
        return iter(())

    @model_validator(mode="after")
    def _check_across_keys(self) -> Section:
        found = list(self.problems())
        if found:
            raise fail(found[0][1], found[0][0], found[1:])
        return self


# -- value types ------------------------------------------------------------------------------
def _size(value: Any) -> int:
    try:
        return int(units.parse_size(value))
    except units.UnitError as exc:
        raise fail(str(exc)) from None


def size_text(n: int) -> str:
    """Bytes the way a person writes them in the file: '8MiB', '1536KiB', '1000'."""
    for name, factor in (("TiB", units.TiB), ("GiB", units.GiB), ("MiB", units.MiB), ("KiB", units.KiB)):
        if n and n % factor == 0:
            return f"{n // factor}{name}"
    return str(n)


def parse_listen(value: str) -> tuple[str, int]:
    """'HOST:PORT', ':PORT' or '[v6]:PORT' -> (host, port). Raises ConfigError."""
    m = re.fullmatch(r"(?:\[([0-9A-Fa-f:.]+)\]|([A-Za-z0-9._-]*)):(\d{1,5})", value.strip())
    if m is None or int(m.group(3)) > 65535 or (m.group(1) and not _is_ipv6(m.group(1))):
        raise ConfigError(f"expected HOST:PORT (e.g. 0.0.0.0:{DEFAULT_PORT}), got {show(value)}")
    return (m.group(1) or m.group(2) or "0.0.0.0", int(m.group(3)))


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
        return True
    except ValueError:
        return False


def _listen_field(value: str) -> str:
    try:
        parse_listen(value)
        return value
    except ConfigError as exc:
        raise fail(str(exc)) from None


def check_url(value: str, example: str) -> str:
    """The one URL check: http(s), a host, a port that exists, nothing a request would choke on."""
    if any(c.isspace() or ord(c) < 32 for c in value):
        raise fail("a URL must not contain spaces or control characters")
    try:
        parts = urlsplit(value)
        _ = parts.port  # read only to validate: raises on a port out of range or not a number
    except ValueError as exc:  # also a broken IPv6 literal such as http://[::1/metrics
        raise fail(f"not a valid URL ({exc}): {show(value)}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise fail(f"expected {example}, got {show(value)}")
    return value


def no_nul(value: str) -> str:
    if "\x00" in value:
        raise fail("a file path must not contain a NUL character")
    return value


def _regex(value: str) -> str:
    try:
        re.compile(value)
    except re.error as exc:
        raise fail(f"not a valid regex: {exc}") from None
    return value


Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS), Doc("seconds")]
PositiveSeconds = Annotated[float, Field(gt=0, le=MAX_SECONDS), Doc("seconds")]
Ratio = Annotated[float, Field(gt=0, le=1), Doc("ratio")]
# A byte size: a whole number or a string such as 8MiB (binary) or 8MB (SI). Only byte sizes:
# a count written "1KiB" is an error, not 1024.
Size = Annotated[int, BeforeValidator(_size), PlainSerializer(size_text, when_used="json"), Doc("size")]
Count = Annotated[int, Field(ge=0, le=1_000_000), Doc("count")]
Listen = Annotated[str, Field(max_length=300), AfterValidator(_listen_field), Doc("HOST:PORT")]
ListenOrOff = Annotated[str, Field(max_length=300), AfterValidator(lambda v: v and _listen_field(v)),
                        Doc("HOST:PORT or empty")]
Path = Annotated[str, Field(max_length=4096), AfterValidator(no_nul), Doc("file path")]
Regex = Annotated[str, Field(max_length=1024), AfterValidator(_regex), Doc("regex")]
Text = Annotated[str, Field(max_length=1024), Doc("string")]


def url_check(example: str, *, optional: bool = False) -> Callable[[str], str]:
    """The URL check for one key (empty allowed where `optional`: a default applies)."""
    return lambda value: value if optional and not value else check_url(value, example)


# -- errors -----------------------------------------------------------------------------------
# YAML 1.1, which PyYAML reads, takes 1e9 for a string: a number needs a dot (1.0e+9) there.
_YAML_TEXT_EXPONENT = re.compile(r"[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+")
_MESSAGES = {
    "float_type": "expected a finite number", "float_parsing": "expected a finite number",
    "finite_number": "expected a finite number", "int_type": "expected a whole number",
    "int_parsing": "expected a whole number", "int_from_float": "expected a whole number",
    "bool_type": "expected true or false", "bool_parsing": "expected true or false",
    "string_type": "expected a string", "tuple_type": "expected a list", "list_type": "expected a list",
    "model_type": "expected a mapping", "model_attributes_type": "expected a mapping",
    "dict_type": "expected a mapping",
}


def _key_text(part: Any) -> str:
    if isinstance(part, int):
        return f"[{part}]"
    text = str(part)
    return "." + (text if re.fullmatch(r"[\w-]{1,64}", text) else show(text))


def path_text(loc: tuple[int | str, ...]) -> str:
    return "".join(_key_text(p) for p in loc).lstrip(".")


def _bound(value: Any, loc: tuple[int | str, ...]) -> str:
    if loc and str(loc[-1]).endswith("_bytes"):
        return size_text(value)
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _section(typ: Any) -> Any:
    """The model inside tuple[Model, ...] or dict[str, Model]."""
    while not hasattr(typ, "model_fields") and get_args(typ):
        typ = [a for a in get_args(typ) if a is not Ellipsis][-1]
    return typ


def _known_keys(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The keys the section at `loc` knows, for 'did you mean'."""
    typ: Any = model
    for part in loc:
        fields = getattr(_section(typ), "model_fields", {})
        if isinstance(part, int):
            continue
        if part not in fields:
            return []
        typ = fields[part].annotation
    return list(getattr(_section(typ), "model_fields", {}))


def problems_of(exc: ValidationError, model: type[BaseModel], show_input: bool = True) -> list[str]:
    """One 'key.path: message' per error, in the schema's order."""
    out = []
    for err in exc.errors(include_url=False):
        loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
        if kind == "extra_forbidden":
            known = _known_keys(model, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            out.append(f"{path_text(loc)}: unknown key ({hint})")
            continue
        if kind == "invalid_key":
            out.append(f"{path_text(loc[:-1]) or 'config'}: key {show(loc[-1])} is not a string")
            continue
        if kind == "missing":
            out.append(f"{path_text(loc[:-1]) or 'config'}: missing required key {loc[-1]}")
            continue
        if kind == "config":
            for key, message in [(ctx["key"], ctx["message"]), *ctx["more"]]:
                # "endpoints.1": list items by their index, as pydantic's own paths give them.
                path = tuple(int(part) if part.isdigit() else part for part in key.split(".")) if key else ()
                out.append(f"{path_text(loc + path) or 'config'}: {message}")
            continue
        if kind == "greater_than":
            message = "must be positive" if ctx["gt"] == 0 else f"must be more than {_bound(ctx['gt'], loc)}"
        elif kind == "greater_than_equal":
            message = "must not be negative" if ctx["ge"] == 0 else f"must be at least {_bound(ctx['ge'], loc)}"
        elif kind in ("less_than_equal", "less_than"):
            message = f"must be at most {_bound(ctx.get('le', ctx.get('lt')), loc)}"
        elif kind == "literal_error":
            message = f"expected one of {ctx['expected']}"
        elif kind == "string_too_long":
            message = f"longer than {ctx['max_length']} characters"
        elif kind == "too_long":
            message = f"more than {ctx['max_length']} items"
        else:
            message = _MESSAGES.get(kind, err["msg"])
        if show_input:
            message += f", got {show(err['input'])}"
            if kind in ("float_type", "float_parsing") and _YAML_TEXT_EXPONENT.fullmatch(str(err["input"])):
                message += " (YAML reads an exponent without a dot as text: write 1.0e+9 or 1000000000)"
        out.append(f"{path_text(loc) or 'config'}: {message}")
    return out
