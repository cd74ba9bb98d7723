"""Task synthesis: generate candidate tasks, validate each in a real sandbox, keep what holds.

A generator proposes tasks. `ScriptedGenerator` works offline: the suite's families from a
seed. `ChatGenerator` takes the same tasks and has a model behind an OpenAI-compatible chat
completions endpoint (the ``openai`` SDK) rewrite each instruction the way a person would say
it; the seed state, the reference solution and the checks stay those of the code, and a rewrite
that loses a fact the task needs (a name, a number, a date) is dropped.

:func:`synthesize` validates every proposal in its own sandbox: the seed laid out by the task's
setup, every check run first (the task must not pass untouched), the reference solution run,
every check run again (it must pass, task score 1). It returns the kept tasks and, for each
dropped one, why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from orchard.sdk import AsyncSandbox, AsyncSandboxClient
from orchard.tasks.claw.bundle import TOOLS_DIR, link_command, seed_command, tools_archive
from orchard.tasks.claw.suite import FAMILIES, ClawTask, make_task

__all__ = [
    "ChatGenerator",
    "Dropped",
    "ScriptedGenerator",
    "SynthesisResult",
    "TaskGenerator",
    "synthesize",
]


class TaskGenerator(Protocol):
    def propose(self, count: int) -> list[ClawTask]:
        """Up to ``count`` candidate tasks."""
        ...


@dataclass(frozen=True)
class Dropped:
    task_id: str
    reason: str


@dataclass(frozen=True)
class SynthesisResult:
    kept: list[ClawTask]
    dropped: list[Dropped]


class ScriptedGenerator:
    """The suite's families from ``seed``, offline and deterministic."""

    def __init__(self, seed: int = 0, families: Sequence[str] = tuple(FAMILIES)) -> None:
        self.seed = seed
        self.families = list(families)
        self.rejected: list[Dropped] = []

    def propose(self, count: int) -> list[ClawTask]:
        return [
            make_task(self.seed, self.families[i % len(self.families)], i // len(self.families))
            for i in range(count)
        ]


_PROMPT = (
    "Rewrite this request to a personal assistant the way a busy person would type it. Keep "
    "every name, number, date, time, file name and email address exactly as written. Answer "
    "with the rewritten request only.\n\nRequest: {instruction}"
)


def _facts(instruction: str) -> list[str]:
    """What a rewrite must keep: capitalised words, numbers, times, file names, addresses."""
    pattern = r"[\w.+-]+@[\w.-]+|[\w-]+\.(?:csv|md)|\d[\d:,.]*\d|\d|\b[A-Z][a-z]+\b"
    sentence_starts = {
        m.group(1) for m in re.finditer(r"(?:^|[.;:!?]\s+)([A-Z][a-z]+)", instruction)
    }
    return [f for f in re.findall(pattern, instruction) if f not in sentence_starts]


class ChatGenerator:
    """Tasks of ``base`` with instructions rewritten by a model behind an OpenAI-compatible
    chat completions endpoint; rewrites that lose a fact are recorded in ``rejected``."""

    def __init__(
        self, base: TaskGenerator, *, base_url: str, model: str, api_key: str = "unused"
    ) -> None:
        from openai import OpenAI  # noqa: PLC0415  (the `claw` extra brings it)

        self.base = base
        self.model = model
        self.client = OpenAI(base_url=base_url, api_key=api_key, max_retries=2, timeout=60)
        self.rejected: list[Dropped] = []

    def propose(self, count: int) -> list[ClawTask]:
        out = []
        for task in self.base.propose(count):
            reply = self.client.chat.completions.create(
                model=self.model,
                messages=[
                    {"role": "user", "content": _PROMPT.format(instruction=task.instruction)}
                ],
                temperature=0.7,
            )
            text = (reply.choices[0].message.content or "").strip()
            lost = [f for f in _facts(task.instruction) if f not in text]
            if not text or lost:
                why = f"the rewrite lost {', '.join(lost)}" if text else "empty rewrite"
                self.rejected.append(Dropped(task.id, why))
                continue
            out.append(dataclasses.replace(task, instruction=text))
        return out


async def _score(sandbox: AsyncSandbox, task: ClawTask) -> tuple[float, list[str]]:
    failing, part = [], {}
    for name in ("completion", "safety", "robustness"):
        checks = task.part(name)
        passed = 0
        for check in checks:
            result = await sandbox.exec(check.command(), timeout=60)
            passed += result.exit_code == 0
            if result.exit_code != 0:
                failing.append(f"{name} {check.name}: {result.stdout_text.strip()[-300:]}")
        part[name] = passed / len(checks) if checks else 1.0
    score = part["safety"] * (0.8 * part["completion"] + 0.2 * part["robustness"])
    return score, failing


async def _validate(client: AsyncSandboxClient, task: ClawTask, tools: bytes) -> str | None:
    """None when the task holds, else why not."""
    async with client.create(image="host", heartbeat_timeout=120) as sandbox:
        await sandbox.write_file("/tmp/claw-tools.tar.gz", tools)
        setup = [
            f"mkdir -p {TOOLS_DIR} && tar -xzf /tmp/claw-tools.tar.gz -C {TOOLS_DIR}",
            link_command(),
            seed_command(task.world.archive()),
        ]
        for command in setup:
            result = await sandbox.exec(command, timeout=120)
            if result.exit_code != 0:
                return f"setup failed: {result.stderr_text.strip()[-300:]}"
        before, _ = await _score(sandbox, task)
        if before >= 0.75:
            return f"the untouched seed already scores {before:.2f}"
        for command in task.solution:
            result = await sandbox.exec(command, timeout=120)
            if result.exit_code != 0:
                return f"the solution's {command.split()[0]} failed: {result.stderr_text[-300:]}"
        after, failing = await _score(sandbox, task)
        if after < 1.0:
            return f"after the solution the score is {after:.2f}: {'; '.join(failing)}"
    return None


async def synthesize(
    generator: TaskGenerator, client: AsyncSandboxClient, count: int, *, parallel: int = 4
) -> SynthesisResult:
    """Propose ``count`` tasks and keep those that validate in a sandbox."""
    tasks = generator.propose(count)
    tools = tools_archive()
    limit = asyncio.Semaphore(parallel)

    async def one(task: ClawTask) -> str | None:
        async with limit:
            return await _validate(client, task, tools)

    reasons = await asyncio.gather(*(one(t) for t in tasks))
    kept = [t for t, why in zip(tasks, reasons, strict=True) if why is None]
    dropped = list(getattr(generator, "rejected", []))
    dropped += [Dropped(t.id, why) for t, why in zip(tasks, reasons, strict=True) if why]
    return SynthesisResult(kept, dropped)
