"""Tasks as the rollout manager runs them, and the check that scores them in their sandbox.

A task comes from `orchard.rollout.v1.RolloutTask`: id, image, instruction and `scorer_json`,
a JSON object with

- `setup`: shell commands run in the fresh sandbox before the harness starts,
- `check`: {"command": shell command, "timeout_s": seconds}: exit code 0 scores 1, else 0,
- `tools`: tool declarations for the generic loop ({"name", "description", "parameters",
  "command": argv, "timeout_s"?}),
- `memory`: the sandbox's memory limit ("512M"); doubled once when setup runs out of memory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchard.rollout.harnesses.tools import CommandTool
from orchard.rollout.provenance import RewardEvidence, RewardRecord
from orchard.rollout.v1 import rollout_service_pb2
from orchard.sdk import AsyncSandbox


@dataclass(frozen=True, slots=True)
class CommandCheck:
    command: str
    timeout_s: float = 120.0

    async def score(self, sandbox: AsyncSandbox) -> RewardRecord:
        result = await sandbox.exec(["/bin/sh", "-c", self.command], timeout=self.timeout_s)
        passed = result.ok
        output = (result.stdout_text + result.stderr_text)[-2000:]
        detail = (
            "the check passed"
            if passed
            else (
                "the check timed out"
                if result.timed_out
                else f"the check exited {result.exit_code}"
            )
        )
        return RewardRecord(
            value=1.0 if passed else 0.0,
            scorer="command_check",
            detail=detail,
            evidence=(RewardEvidence(f"$ {self.command}", output),),
        )


@dataclass(frozen=True, slots=True)
class TaskSpec:
    id: str
    instruction: str
    check: CommandCheck
    image: str = "host"
    setup: tuple[str, ...] = ()
    tools: tuple[CommandTool, ...] = ()
    memory: str = ""

    @classmethod
    def from_proto(cls, task: rollout_service_pb2.RolloutTask) -> TaskSpec:
        """Raises ValueError with what is wrong."""
        if not task.id:
            raise ValueError("a task has no id")
        if not task.instruction:
            raise ValueError(f"task {task.id!r} has no instruction")
        try:
            settings = json.loads(task.scorer_json or "{}")
        except ValueError as exc:
            raise ValueError(f"task {task.id!r}: scorer_json is not JSON: {exc}") from exc
        if not isinstance(settings, dict):
            raise ValueError(f"task {task.id!r}: scorer_json must be a JSON object")
        return cls.from_settings(task.id, task.instruction, settings, image=task.image or "host")

    @classmethod
    def from_settings(
        cls, task_id: str, instruction: str, settings: Mapping[str, Any], *, image: str = "host"
    ) -> TaskSpec:
        check = settings.get("check")
        if not isinstance(check, dict) or not isinstance(check.get("command"), str):
            raise ValueError(f'task {task_id!r}: scorer_json needs "check": {{"command": "..."}}')
        setup = settings.get("setup", [])
        if not isinstance(setup, list) or not all(isinstance(s, str) for s in setup):
            raise ValueError(f'task {task_id!r}: "setup" must be a list of shell commands')
        try:
            tools = tuple(CommandTool.from_declaration(d) for d in settings.get("tools", []))
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"task {task_id!r}: {exc}") from exc
        return cls(
            id=task_id,
            instruction=instruction,
            check=CommandCheck(check["command"], float(check.get("timeout_s", 120.0))),
            image=image,
            setup=tuple(setup),
            tools=tools,
            memory=str(settings.get("memory", "")),
        )
