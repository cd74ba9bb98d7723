"""What the command line prints: tables for people, JSON for scripts, progress, error lines."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

from orchard.sdk.units import format_size

__all__ = ["Progress", "print_json", "print_table"]


def print_json(value: Any, out: IO[str] | None = None) -> None:
    """One JSON document on stdout (sorted keys, so scripts and diffs see a stable shape)."""
    out = out or sys.stdout
    json.dump(value, out, indent=2, sort_keys=True, default=str)
    out.write("\n")


def print_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], out: IO[str] | None = None
) -> None:
    """Left-aligned columns separated by two spaces, headers in capitals."""
    out = out or sys.stdout
    cells = [[str(h).upper() for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        out.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        out.write("\n")


class Progress:
    """A one-line progress indicator on stderr for transfers, drawn only on a terminal and
    only once a transfer is big enough to be worth watching."""

    def __init__(
        self,
        label: str,
        *,
        enabled: bool | None = None,
        min_bytes: int = 1 << 20,
        out: IO[str] | None = None,
    ) -> None:
        self.out = out or sys.stderr
        self.label = label
        self.enabled = self.out.isatty() if enabled is None else enabled
        self.min_bytes = min_bytes
        self.started = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.min_bytes:
            return
        now = time.monotonic()
        if done < total and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        rate = done / max(now - self.started, 1e-6)
        percent = 100 * done / total if total else 100
        self.out.write(
            f"\r{self.label}  {format_size(done)} / {format_size(total)}  {percent:3.0f}%  "
            f"{format_size(rate)}/s\x1b[K"
        )
        self.out.flush()
        self._drawn = True

    def finish(self) -> None:
        if self._drawn:
            self.out.write("\n")
            self.out.flush()
