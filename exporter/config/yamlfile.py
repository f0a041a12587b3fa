"""Reading YAML that someone else wrote: bounded in size, in nesting and in expansion, with
errors that name the file and line.

Anchors and aliases are refused by default: a 440-byte "billion laughs" file expands to a
billion strings the moment anything walks it. Files that use them on purpose (scenarios share
curves between processes) may allow them; the expanded size is then bounded instead.
"""
from __future__ import annotations

from typing import Any

import yaml

from ..boundedio import read_head

MAX_YAML_BYTES = 1 << 20
MAX_EXPANDED_NODES = 200_000  # with aliases allowed: nodes counted as if every alias were a copy


class YamlError(ValueError):
    """A file that is not acceptable YAML; the message names the file (and line, where known)."""


class _Loader(yaml.SafeLoader):
    allow_aliases = False

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]  # types-PyYAML leaves it unannotated
        if not self.allow_aliases and (isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None)):
            raise yaml.composer.ComposerError(
                None, None, "anchors and aliases (&name, *name) are not allowed in this file", event.start_mark)
        return super().compose_node(parent, index)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError):  # e.g. a 5,000-digit integer, a 13th month
            raise yaml.constructor.ConstructorError(None, None, "a value that cannot be read "
                                                    f"as {node.tag.rsplit(':', 1)[-1]}", node.start_mark) from None


class _AliasLoader(_Loader):
    allow_aliases = True


def _where(source: str, mark: yaml.Mark | None) -> str:
    return f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source


def _clip(text: str) -> str:
    return text if len(text) <= 40 else text[:40] + "..."


def _short(text: str) -> str:
    return repr(_clip(text))


def _duplicate_keys(node: yaml.Node, path: str, out: list[tuple[str, yaml.Mark | None]]) -> None:
    """Every key a mapping gives twice, with its key path (`vllm.endpoints[0].url`) and where
    the second one is. Recursion ends with the document (aliases, where allowed, are walked
    once: `_expanded_size` bounds them first)."""
    if isinstance(node, yaml.SequenceNode):
        for i, child in enumerate(node.value):
            _duplicate_keys(child, f"{path}[{i}]", out)
    elif isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = f"{path}.{key_node.value}" if path else str(key_node.value)
            if key_node.value in seen:
                out.append((key, key_node.start_mark))
            seen.add(key_node.value)
            _duplicate_keys(value, key, out)


def _expanded_size(node: yaml.Node, memo: dict[int, int], limit: int) -> int:
    """How many nodes the document has with every alias expanded; stops past `limit`. An
    alias inside the node it names expands without end."""
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = limit + 1  # while its children are counted
    size = 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    for child in children:
        size += _expanded_size(child, memo, limit)
        if size > limit:
            break
    memo[key] = size
    return size


def parse_yaml(text: str, source: str, *, allow_aliases: bool = False,
               max_nodes: int = MAX_EXPANDED_NODES, duplicates: list[str] | None = None) -> Any:
    """One YAML document from `text`; `source` (a file name) names it in errors. Raises YamlError.

    A key given twice in one mapping is an error. With `duplicates` (a list), each one is added
    to it as a problem (`key.path: ...`) and the document is read on, its last value kept, so
    a caller that checks the rest can report every problem at once; without it the first one
    raises."""
    _check_printable(text, source)
    loader = (_AliasLoader if allow_aliases else _Loader)(text)
    loader.name = source  # marks (and so messages) name the file, not "<unicode string>"
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if allow_aliases and _expanded_size(node, {}, max_nodes) > max_nodes:
            raise YamlError(f"{source}: expands to more than {max_nodes} values through its aliases")
        found: list[tuple[str, yaml.Mark | None]] = []
        _duplicate_keys(node, "", found)
        if found and duplicates is None:
            key, mark = found[0]
            raise YamlError(f"{_where(source, mark)}: not valid YAML: duplicate key {_short(key.rsplit('.', 1)[-1])}")
        if duplicates is not None:
            duplicates += [f"{_clip(key)}: given twice in the file (again at {_where(source, mark)}); "
                           "give each key once" for key, mark in found]
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise YamlError(f"{where}: not valid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise YamlError(f"{source}: not valid YAML: {exc}") from None
    except RecursionError:
        raise YamlError(f"{source}: not valid YAML: nested too deeply") from None
    finally:
        loader.dispose()


def _check_printable(text: str, source: str) -> None:
    """PyYAML checks this before any parsing, in a message that names no file: say it here."""
    match = yaml.reader.Reader.NON_PRINTABLE.search(text)
    if match:
        line = text.count("\n", 0, match.start()) + 1
        raise YamlError(f"{source}:{line}: not valid YAML: control character #x{ord(match.group()):04x}")


def read_yaml(path: str, what: str = "file", *, max_bytes: int = MAX_YAML_BYTES,
              allow_aliases: bool = False, duplicates: list[str] | None = None) -> Any:
    """One YAML document from a file of at most `max_bytes` UTF-8 bytes; `what` the file is
    says so in errors (`duplicates`: see parse_yaml). Raises YamlError."""
    try:
        raw, more = read_head(path, max_bytes)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise YamlError(f"{path}: cannot read {what}: {getattr(exc, 'strerror', None) or exc}") from None
    if more:
        raise YamlError(f"{path}: {what} larger than {max_bytes} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise YamlError(f"{path}:{line}: not UTF-8 text") from None
    return parse_yaml(text, path, allow_aliases=allow_aliases, duplicates=duplicates)
