"""The built-in Claw suite's tasks as ScoreTask scores them: their checks regenerated from the
task id (``claw/<seed>/<family>/<n>``, `orchard.tasks.claw.suite.task_by_id`), so no
configuration lists them."""

from __future__ import annotations

import functools

from orchard.core.errors import OrchardError, Reason
from orchard.reward.config import TaskChecksConfig
from orchard.tasks.claw.suite import is_claw_id, task_by_id

__all__ = ["builtin_task_checks", "is_claw_id"]


@functools.lru_cache(maxsize=1024)
def builtin_task_checks(task_id: str) -> TaskChecksConfig:
    """The checks of a built-in Claw task; INVALID_ARGUMENT for an id that names none."""
    try:
        task = task_by_id(task_id)
    except ValueError as exc:
        raise OrchardError(Reason.INVALID_ARGUMENT, str(exc)) from None
    return TaskChecksConfig.model_validate(task.checks_config())
