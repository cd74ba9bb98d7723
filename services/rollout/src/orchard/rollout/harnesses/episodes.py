"""What a GUI rollout's browser episode carries between the runner, its harness and its
scoring: the episode's sandboxes, the page it starts on, and what the harness leaves behind
(the screenshot trail, the answer given to ``done``, the format failures)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchard.tasks.gui.episode import BrowserEpisode
from orchard.tasks.gui.observation import Observation

__all__ = ["BrowserRun", "BrowserStep"]


@dataclass(frozen=True, slots=True)
class BrowserStep:
    """One action the browser ran and what it returned (the page text left out: the trail
    keeps what a person reads, the screenshot holds the page)."""

    tool: str
    arguments: dict[str, Any]
    observation: Observation


@dataclass(slots=True)
class BrowserRun:
    """One rollout's browser episode; the harness fills the fields after `start_url`."""

    episode: BrowserEpisode
    start_url: str
    screenshots: list[bytes] = field(default_factory=list)
    """Every screenshot the episode showed, oldest first (the judge reads the last ones)."""
    steps: list[BrowserStep] = field(default_factory=list)
    """Every action run, oldest first, the opening of the start page included: the trail
    (`orchard.rollout.trails`). Its screenshots are the same bytes as `screenshots`."""
    response: str | None = None
    """The answer given to ``done``; None when the episode ended otherwise."""
    format_failures: int = 0
    """Turns whose action did not parse (no tool call, an unknown tool, bad arguments)."""
