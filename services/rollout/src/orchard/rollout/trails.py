"""The screenshot trail of a GUI episode, kept in the artifact store when its job asks for it
(`RolloutJobSpec.keep_gui_trails`).

A trail is a folder ``trails/<job id>/<rollout id>/`` under the store's root: each action's
screenshot as ``NNN.png`` (``000.png`` is the start page) and ``trail.json``, written last, so a
trail.json that exists names screenshots that exist::

    {"version": 1, "job_id", "rollout_id", "task_id", "gui_task_id", "harness",
     "intent", "start_url",
     "steps": [{"index", "tool", "arguments", "ok", "error", "message", "events", "url",
                "title", "tabs": [{"index", "url", "title", "active"}], "screenshot": "000.png"
                or null, "elapsed_s"}],
     "response", "status", "outcome", "format_failures",
     "reward": {"value", "scorer", "detail"} or null, "failure": "layer: error" or null}

Everything in it but the ids came from the sandbox (the intent aside): whoever shows it treats
it as hostile text. A trail is evidence, never part of the rollout: one that cannot be written is
logged and left out, and the rollout keeps its reward.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchard.rollout.harnesses.episodes import BrowserRun, BrowserStep
from orchard.rollout.provenance import RolloutRecord
from orchard.rollout.results import RolloutStatus
from orchard.tasks.spec import GuiCheck

if TYPE_CHECKING:
    from orchard.core.artifacts import ArtifactStore
    from orchard.rollout.tasks import TaskSpec

__all__ = ["TRAILS_FOLDER", "TRAIL_FILE", "TRAIL_VERSION", "TrailWriter", "trail_json"]

log = logging.getLogger(__name__)

TRAILS_FOLDER = "trails"
"""Folder of every job's trails under the artifact store's root."""
TRAIL_FILE = "trail.json"
TRAIL_VERSION = 1
WRITE_TIMEOUT_S = 60.0
"""Longest writing one trail may hold up its rollout's result (a slow store)."""


def screenshot_name(index: int) -> str:
    """The file name of step ``index``'s screenshot: ``000.png``, ``001.png``, ..."""
    return f"{index:03d}.png"


def _step_json(index: int, step: BrowserStep) -> dict[str, Any]:
    seen = step.observation
    active = next((tab for tab in seen.tabs if tab.active), None)
    return {
        "index": index,
        "tool": step.tool,
        "arguments": step.arguments,
        "ok": seen.ok,
        "error": seen.error,
        "message": seen.message,
        "events": list(seen.events),
        "url": active.url if active is not None else "",
        "title": active.title if active is not None else "",
        "tabs": [
            {"index": t.index, "url": t.url, "title": t.title, "active": t.active}
            for t in seen.tabs
        ],
        "screenshot": screenshot_name(index) if seen.screenshot is not None else None,
        "elapsed_s": round(seen.elapsed_s, 4),
    }


def trail_json(
    *,
    job_id: str,
    record: RolloutRecord,
    task: TaskSpec,
    run: BrowserRun,
    status: RolloutStatus,
) -> dict[str, Any]:
    """The trail.json of a rollout (see the module docstring)."""
    reward = record.reward
    failure = record.failure
    check = task.check
    return {
        "version": TRAIL_VERSION,
        "job_id": job_id,
        "rollout_id": record.rollout_id,
        "task_id": record.task_id,
        "gui_task_id": check.task_id if isinstance(check, GuiCheck) else "",
        "harness": record.harness,
        "intent": task.instruction,
        "start_url": run.start_url,
        "steps": [_step_json(i, step) for i, step in enumerate(run.steps)],
        "response": run.response,
        "status": status.value,
        "outcome": record.outcome,
        "format_failures": run.format_failures,
        "reward": (
            None
            if reward is None or status is RolloutStatus.ABORTED
            else {"value": reward.value, "scorer": reward.scorer, "detail": reward.detail}
        ),
        "failure": None if failure is None else f"{failure.layer.value}: {failure.error}",
    }


@dataclass(frozen=True, slots=True)
class TrailWriter:
    """Writes the trails of one job's GUI episodes into ``store``."""

    store: ArtifactStore
    job_id: str

    def folder(self, rollout_id: str) -> str:
        """URL of a rollout's trail folder."""
        return self.store.url(TRAILS_FOLDER, self.job_id, rollout_id)

    async def keep(
        self, record: RolloutRecord, task: TaskSpec, run: BrowserRun, status: RolloutStatus
    ) -> str:
        """Writes the rollout's trail; returns its trail.json URL, or "" when the episode ran no
        action or the trail could not be written (logged: a trail never fails its rollout)."""
        if not run.steps:
            return ""
        try:
            document = trail_json(
                job_id=self.job_id, record=record, task=task, run=run, status=status
            )
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                return await asyncio.to_thread(self._write, record.rollout_id, run, document)
        except Exception as exc:  # the store's, its driver's, a timeout: never the rollout's
            log.warning(
                "rollout %s: its GUI trail was not written to %s: %s: %s",
                record.rollout_id,
                self.store.root_url,
                type(exc).__name__,
                exc,
            )
            return ""

    def _write(self, rollout_id: str, run: BrowserRun, document: dict[str, Any]) -> str:
        folder = self.folder(rollout_id)
        for index, step in enumerate(run.steps):
            if step.observation.screenshot is not None:
                png = f"{folder}/{screenshot_name(index)}"
                self.store.write_bytes(png, step.observation.screenshot)
        body = json.dumps(document, ensure_ascii=False, indent=1).encode()
        return self.store.write_bytes(f"{folder}/{TRAIL_FILE}", body)
