"""SWE tasks built in code: the torch-free shared library `orchard.tasks.swe_tasks`."""

from __future__ import annotations

from orchard.tasks.swe_tasks import (
    BUILTIN_BLUEPRINTS,
    RepoBlueprint,
    build_instances,
    diff_against_base,
    materialize,
)

__all__ = [
    "BUILTIN_BLUEPRINTS",
    "RepoBlueprint",
    "build_instances",
    "diff_against_base",
    "materialize",
]
