"""Label selectors of ListSandboxes: ``key=value``, ``key!=value``, ``key``, ``!key``."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from orchard.env.validation import invalid

__all__ = ["parse_selector"]

Matcher = Callable[[Mapping[str, str]], bool]


def parse_selector(text: str, field: str = "label_selector") -> Matcher:
    """A predicate over labels that holds when every comma-separated term holds."""
    terms: list[Matcher] = []
    for raw in text.split(","):
        term = raw.strip()
        if not term:
            if text.strip():
                raise invalid(field, f"empty term in {text!r}")
            continue
        terms.append(_term(term, field))
    return lambda labels: all(term(labels) for term in terms)


def _term(term: str, field: str) -> Matcher:
    if "!=" in term:
        key, value = (part.strip() for part in term.split("!=", 1))
        _check_key(key, term, field)
        return lambda labels: labels.get(key) != value
    if "=" in term:
        key, value = (part.strip() for part in term.split("=", 1))
        _check_key(key, term, field)
        return lambda labels: labels.get(key) == value
    if term.startswith("!"):
        key = term[1:].strip()
        _check_key(key, term, field)
        return lambda labels: key not in labels
    _check_key(term, term, field)
    return lambda labels: term in labels


def _check_key(key: str, term: str, field: str) -> None:
    if not key or any(c in key for c in "!= \t"):
        raise invalid(field, f"bad term {term!r}: expected key=value, key!=value, key or !key")
