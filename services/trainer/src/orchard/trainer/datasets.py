"""Trajectory datasets: JSON Lines, one `orchard.types.v1.Trajectory` per line.

Each line is the protobuf JSON form of a trajectory (`json_format.MessageToJson`, camelCase or
the proto field names). A line that does not parse raises `DatasetError` naming the file, the
line and the field, so a person can fix the file instead of guessing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from google.protobuf import json_format

from orchard.types.v1 import trajectory_pb2

__all__ = [
    "DatasetError",
    "parse_numbered",
    "parse_trajectories",
    "read_trajectories",
    "write_trajectories",
]


class DatasetError(ValueError):
    """A dataset file that cannot be read as trajectories."""


def read_trajectories(path: Path) -> Iterator[trajectory_pb2.Trajectory]:
    """The trajectories of a JSONL file, in file order; blank lines are skipped."""
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"cannot read dataset {path}: {exc.strerror}") from exc
    with handle:
        yield from parse_trajectories(handle, str(path))


def parse_trajectories(lines: Iterable[str], source: str) -> Iterator[trajectory_pb2.Trajectory]:
    """The trajectories of JSONL ``lines`` (a file, an artifact stream); ``source`` names them
    in errors (a path or URL)."""
    for _, trajectory in parse_numbered(lines, source):
        yield trajectory


def parse_numbered(
    lines: Iterable[str], source: str
) -> Iterator[tuple[int, trajectory_pb2.Trajectory]]:
    """Each trajectory of JSONL ``lines`` with its line number (from 1), so a report can
    point at the line."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        trajectory = trajectory_pb2.Trajectory()
        try:
            json_format.Parse(line, trajectory)
        except json_format.ParseError as exc:
            raise DatasetError(f"{source}:{number}: not a trajectory: {exc}") from exc
        yield number, trajectory


def write_trajectories(path: Path, trajectories: Iterable[trajectory_pb2.Trajectory]) -> int:
    """Write trajectories as JSONL (one compact object per line); returns how many."""
    count = 0
    with path.open("w", encoding="utf-8") as handle:
        for trajectory in trajectories:
            handle.write(json_format.MessageToJson(trajectory, indent=None) + "\n")
            count += 1
    return count
