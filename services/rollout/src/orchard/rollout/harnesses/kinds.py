"""Every harness kind a rollout can run: the built-in tool-calling loop (in the rollout's
process, its tools in the sandbox), the browser loop of GUI tasks (its tools in the episode's
browser sandbox) and an unmodified agent program inside the sandbox."""

from __future__ import annotations

from typing import TypeAlias

from orchard.rollout.harnesses.browser import BrowserHarness
from orchard.rollout.harnesses.sandboxed import SandboxedProgramHarness
from orchard.rollout.harnesses.tool_loop import ToolCallingHarness

__all__ = ["Harness"]

Harness: TypeAlias = ToolCallingHarness | SandboxedProgramHarness | BrowserHarness
