"""The module-level API: find, scrub and scrub_value with the default Scrubber, and merge_counts.
"""
from __future__ import annotations

from typing import Any, Iterator

from edgeflow.pii.detectors import Finding
from edgeflow.pii.scrubber import Scrubber


_DEFAULT = Scrubber()


def find(text: str) -> list[Finding]:
    """Every PII span in text (start, end, kind, placeholder, region), by position."""
    return _DEFAULT.find(text)


def scrub(text: str) -> tuple[str, dict[str, int]]:
    """Replace PII and secrets with typed placeholders; returns the text and what was replaced, by kind."""
    return _DEFAULT.scrub(text)


def merge_counts(into: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
    """Add counts into `into` (in place) and return it."""
    for k, v in counts.items():
        into[k] = into.get(k, 0) + v
    return into


def scrub_value(value: Any) -> tuple[Any, dict[str, int]]:
    """Scrub every string in a JSON value (dict/list/str/other; dict keys untouched): a new value and merged counts.

    Numbers, booleans and None pass through unchanged; tuples come back as lists. Iterative, so nesting depth
    is not limited by Python's recursion limit. Raises only for a container that contains itself, which no
    JSON value can.
    """
    counts: dict[str, int] = {}

    def leaf(v: Any) -> Any:
        if isinstance(v, str):
            text, found = _DEFAULT.scrub(v)
            merge_counts(counts, found)
            return text
        return v

    if not isinstance(value, (dict, list, tuple)):
        return leaf(value), counts
    root: Any = {} if isinstance(value, dict) else []
    # (source container, its copy, iterator over its items); a copy is filled as its items are visited
    stack = [(value, root, _items(value))]
    on_path = {id(value)}
    while stack:
        src, dst, items = stack[-1]
        step = next(items, None)
        if step is None:
            on_path.discard(id(src))
            stack.pop()
            continue
        key, child = step
        if isinstance(child, (dict, list, tuple)):
            if id(child) in on_path:
                raise ValueError(f"scrub_value: a {type(child).__name__} contains itself; JSON values cannot be cyclic")
            new: Any = {} if isinstance(child, dict) else []
            on_path.add(id(child))
            stack.append((child, new, _items(child)))
        else:
            new = leaf(child)
        if isinstance(dst, dict):
            dst[key] = new
        else:
            dst.append(new)
    return root, counts


def _items(container: dict | list | tuple) -> Iterator[tuple[Any, Any]]:
    return iter(container.items()) if isinstance(container, dict) else enumerate(container)
