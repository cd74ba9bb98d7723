"""Human units for sizes (``512M``, ``2Gi``) and durations (``90s``, ``10m``, ``1h30m``)."""

from __future__ import annotations

import re

__all__ = ["format_duration", "format_size", "parse_duration", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string: ``"512M"`` and ``"512Mi"`` are both 512 * 2**20.

    Memory limits are binary in practice, so ``K/M/G`` mean powers of 1024 (as in
    ``docker --memory``); a bare number is bytes. Raises ValueError on anything else.
    """
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    match = _SIZE.match(value)
    if match is None:
        raise ValueError(f"not a size: {value!r} (use e.g. 512M, 2G, 1048576)")
    number, unit, _ = match.groups()
    return int(float(number) * 1024 ** _SIZE_POWERS[unit.lower()])


def parse_duration(value: float | str) -> float:
    """Seconds from a number or a string: ``"90"``, ``"90s"``, ``"10m"``, ``"1h30m"``,
    ``"500ms"``."""
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"duration must not be negative, got {value}")
        return float(value)
    text = value.strip().lower()
    try:
        return parse_duration(float(text))
    except ValueError:
        pass
    total = 0.0
    position = 0
    for match in _DURATION_PART.finditer(text):
        if match.start() != position:
            break
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        position = match.end()
    if position != len(text) or not text:
        raise ValueError(f"not a duration: {value!r} (use e.g. 30s, 10m, 1h30m)")
    return total


def format_size(count: float) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def format_duration(value: float) -> str:
    """``75`` → ``"1m15s"``, ``0.25`` → ``"250ms"``."""
    if value < 1:
        return f"{value * 1000:.0f}ms"
    whole = round(value)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [
        f"{hours}h" if hours else "",
        f"{minutes}m" if minutes else "",
        f"{secs}s" if secs else "",
    ]
    return "".join(parts) or "0s"
