"""Tasks as the rollout manager runs them: the shared wire format `orchard.tasks.spec`.

What `scorer_json` holds is documented there; orchard-rollout scores a `CommandCheck` itself
(`orchard.rollout.scoring`) and the other checks through the reward service.
"""

from __future__ import annotations

from orchard.tasks.spec import (
    Check,
    CommandCheck,
    ServiceTaskCheck,
    TaskFile,
    TaskSpec,
    TestsCheck,
)

__all__ = ["Check", "CommandCheck", "ServiceTaskCheck", "TaskFile", "TaskSpec", "TestsCheck"]
