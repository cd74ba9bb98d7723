"""The built-in state judge of JudgeOutcome (judge ``builtin:gui-state``): reads the site's
server-side state, no model and no screenshot.

A task of the built-in GUI suite (``gui/<seed>/<family>/<n>``,
`orchard.tasks.gui.suite.task_by_id`) is regenerated from its id; its site's state is read
inside the episode's site sandbox (`orchard.tasks.gui.episode.read_site_state`, with the token
only that sandbox holds) and the task's own check (`GuiTask.check`, which also reads the final
response of a lookup) decides success. The verdict becomes a reward as a model judge's does
(`orchard.reward.verdict.verdict_reward`: binary or format variant), under its own scorer name
:data:`SCORER`, so metrics tell state verdicts from model ones.

The site sandbox comes from the episode, not from a person typing an id: when it is gone
(the environment service does not know it: deleted or reaped mid-episode), not READY, or
does not give its state (the site server died, nothing answers on the port, the environment
service is unreachable), the fault lies outside the policy and the reward is EXCLUDED
(``SANDBOX_FAILURE``), never a low score. ScoreTask answers a missing sandbox NOT_FOUND
instead: there the caller names a sandbox it holds; here a vanished one is an episode fault.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from orchard.core.errors import OrchardError, Reason
from orchard.reward.outcome import Evidence, Exclusion, ScoreResult, excluded
from orchard.reward.verdict import Verdict, verdict_reward
from orchard.sdk import errors
from orchard.sdk.aio import AsyncSandbox, AsyncSandboxClient
from orchard.sdk.types import SandboxState
from orchard.tasks.gui.episode import DEFAULT_SITE_PORT, SiteStateUnreadable, read_site_state
from orchard.tasks.gui.suite import ID_PREFIX, GuiTask, task_by_id
from orchard.tasks.spec import GUI_STATE_JUDGE

__all__ = ["GUI_STATE_JUDGE", "SCORER", "gui_task", "judge_site_state", "site_port", "site_sandbox"]

SCORER = "gui_state_judge"


def gui_task(task_id: str) -> GuiTask:
    """The built-in GUI task ``task_id`` names: INVALID_ARGUMENT when it does not have a GUI
    id's shape, NOT_FOUND when it has but names no task (an unknown family, a bad number)."""
    parts = task_id.split("/")
    if len(parts) != 4 or parts[0] != ID_PREFIX:
        raise OrchardError(
            Reason.INVALID_ARGUMENT,
            f"judge {GUI_STATE_JUDGE} needs task_id, a built-in GUI task id "
            f"({ID_PREFIX}/<seed>/<family>/<n>), got {task_id!r}",
        )
    try:
        return task_by_id(task_id)
    except ValueError as exc:
        raise OrchardError(Reason.NOT_FOUND, str(exc), metadata={"task_id": task_id}) from None


def site_port(port: int) -> int:
    """The site server's port from the request (0: the default); INVALID_ARGUMENT when it is
    no port."""
    if not 0 <= port <= 65535:
        raise OrchardError(
            Reason.INVALID_ARGUMENT, f"site_port must lie in [0, 65535] (0: 8080), got {port}"
        )
    return port or DEFAULT_SITE_PORT


async def site_sandbox(client: AsyncSandboxClient, sandbox_id: str) -> AsyncSandbox | ScoreResult:
    """The READY site sandbox, or the EXCLUDED reward saying why there is none. A malformed id
    is the caller's mistake: INVALID_ARGUMENT."""
    try:
        sandbox = await client.get(sandbox_id)
    except errors.InvalidArgument as exc:
        raise OrchardError(
            Reason.INVALID_ARGUMENT, f"site_sandbox_id {sandbox_id!r}: {exc.message}"
        ) from None
    except errors.NotFound:
        return _sandbox_failure(
            f"site sandbox {sandbox_id} does not exist (any more): it was deleted or reaped "
            "before the episode was judged; keep it until JudgeOutcome answers"
        )
    except errors.ServiceError as exc:
        return _sandbox_failure(
            f"the environment service did not give site sandbox {sandbox_id}: {exc}"
        )
    if sandbox.state is not SandboxState.READY:
        info = sandbox.info
        why = info.failure_message or info.failure_reason or "not running"
        await sandbox.close()
        return _sandbox_failure(f"site sandbox {sandbox_id} is {sandbox.state.name}: {why}")
    return sandbox


async def judge_site_state(
    sandbox: AsyncSandbox,
    task: GuiTask,
    *,
    final_response: str,
    port: int = DEFAULT_SITE_PORT,
    screenshots: int = 0,
    format_variant: bool = False,
    policy_format_failures: int = 0,
    format_failure_limit: int = 3,
) -> ScoreResult:
    """The reward of ``task`` from its site's state in ``sandbox`` (served on ``port``) and the
    ``final_response``; EXCLUDED (``SANDBOX_FAILURE``) when the state cannot be read.
    ``screenshots`` is how many came with the request: counted in the evidence, never read."""
    shots = Evidence.of(
        "screenshots", f"{screenshots} came with the request; the state judge reads none"
    )
    try:
        state = await read_site_state(sandbox, task.site, port)
    except SiteStateUnreadable as exc:
        return _sandbox_failure(
            f"the state of {task.site} could not be read on port {port} ({exc}); is the site "
            f"server of task {task.id} running in that sandbox on that port?",
            evidence=(shots,),
        )
    except errors.ServiceError as exc:
        return _sandbox_failure(
            f"site sandbox {sandbox.id} failed while its state was read: {exc}",
            evidence=(shots,),
        )
    check = task.check(state, final_response)
    evidence = (
        Evidence.of(f"check of {task.id}", check.detail),
        Evidence.of(f"{task.site} state", json.dumps(state, sort_keys=True, separators=(",", ":"))),
        shots,
    )
    result = verdict_reward(
        Verdict(check.success, check.detail),
        evidence=evidence,
        format_variant=format_variant,
        policy_format_failures=policy_format_failures,
        format_failure_limit=format_failure_limit,
        scorer=SCORER,
    )
    components = {**result.components, "goal_share": check.score, "screenshots": float(screenshots)}
    return dataclasses.replace(result, components=components)


def _sandbox_failure(detail: str, *, evidence: Sequence[Evidence] = ()) -> ScoreResult:
    return excluded(SCORER, Exclusion.SANDBOX_FAILURE, detail, evidence=tuple(evidence))
