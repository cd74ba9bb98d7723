"""SWE-bench task instances: the torch-free shared library `orchard.tasks.swe_instances`."""

from __future__ import annotations

from orchard.tasks.swe_instances import (
    DEFAULT_REPO_PATH,
    InstanceFormatError,
    SweInstance,
    load_instances,
    parse_instance,
    read_instances,
    write_instances,
)

__all__ = [
    "DEFAULT_REPO_PATH",
    "InstanceFormatError",
    "SweInstance",
    "load_instances",
    "parse_instance",
    "read_instances",
    "write_instances",
]
