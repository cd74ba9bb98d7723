"""The program harnesses a service offers, from its `harnesses` configuration."""

from __future__ import annotations

from orchard.rollout.config import HarnessesConfig
from orchard.rollout.harnesses.builtin_programs import builtin_program_harnesses
from orchard.rollout.harnesses.sandboxed import HarnessCache, ProgramFile, SandboxedProgramHarness

__all__ = ["program_harnesses"]


def program_harnesses(config: HarnessesConfig) -> dict[str, SandboxedProgramHarness]:
    """The built-in and configured program harnesses by name; none without a cache folder."""
    cache_dir = config.resolved_cache_dir()
    if not cache_dir:
        return {}
    cache = HarnessCache(cache_dir)
    harnesses = builtin_program_harnesses(cache, config.builtin, wall_clock_s=config.wall_clock_s)
    for name, program in config.programs.items():
        harnesses[name] = SandboxedProgramHarness(
            name=name,
            program=program.program,
            command=tuple(program.command),
            cache=cache,
            dialect=program.dialect,
            env=dict(program.env),
            files=tuple(ProgramFile(f.path, f.content, f.mode) for f in program.files),
            wall_clock_s=program.wall_clock_s or config.wall_clock_s,
            description=program.description,
        )
    return harnesses
