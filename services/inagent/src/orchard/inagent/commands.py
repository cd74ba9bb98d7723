"""From a requested ``Command`` to a checked :class:`CommandSpec`, or a clear INVALID_ARGUMENT.

Everything that can be refused before a process exists is refused here: argv versus shell,
NUL bytes, environment names, timeout, output cap, working directory, and an executable given
as a path. A bare program name is searched on the command's own ``PATH`` by the spawn itself
(in C, as ``execvp`` does); :mod:`orchard.inagent.process` explains its errors.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from orchard.core.errors import OrchardError, Reason
from orchard.inagent.paths import check_path, display, resolve
from orchard.inagent.reasons import AgentReason
from orchard.types.v1 import exec_pb2

__all__ = ["CommandSpec", "ExecLimits", "prepare_command"]

_NANOS = 1_000_000_000


@dataclass(frozen=True)
class ExecLimits:
    """The agent's limits on commands, from its configuration."""

    default_timeout_s: float
    """Wall-clock limit of a command that asks for none."""
    default_output_limit_bytes: int
    """Cap of each of stdout and stderr when a command asks for none."""
    max_output_limit_bytes: int
    """Largest cap a command may ask for."""


@dataclass(frozen=True)
class CommandSpec:
    """A command ready to spawn: every field checked, the executable found."""

    executable: str | None
    """Path of the program to execute (absolute, or relative to ``cwd``); None to look
    ``argv[0]`` up on the ``PATH`` of ``env`` while executing it, as ``execvp`` does."""
    argv: list[str]
    """Arguments, ``argv[0]`` included, as the program will see them."""
    cwd: str
    """Absolute working directory."""
    env: dict[str, str]
    """The complete environment."""
    stdin: bytes
    """Bytes for standard input, which is then closed."""
    timeout_s: float
    """Wall-clock limit in seconds."""
    output_limit_bytes: int
    """Most bytes kept of each of stdout and stderr."""


def _invalid(message: str, field: str) -> OrchardError:
    return OrchardError(Reason.INVALID_ARGUMENT, message, metadata={"field": field})


def prepare_command(
    command: exec_pb2.Command,
    *,
    working_dir: bytes,
    base_env: Mapping[str, str],
    limits: ExecLimits,
    shell: str,
) -> CommandSpec:
    """Check ``command`` against the contract and the agent's limits; raise OrchardError if bad."""
    argv = list(command.argv)
    if argv and command.shell:
        raise _invalid("set exactly one of argv and shell, not both", "command")
    if not argv and not command.shell:
        raise _invalid("set one of argv (a program and its arguments) or shell", "command")
    if command.shell:
        if "\0" in command.shell:
            raise _invalid("shell contains a NUL byte", "command.shell")
        argv = [shell, "-c", command.shell]
    for index, arg in enumerate(argv):
        if "\0" in arg:
            raise _invalid(f"argv[{index}] contains a NUL byte", f"command.argv[{index}]")
    if not argv[0]:
        raise _invalid("argv[0] is empty: it must name the program", "command.argv[0]")

    env = {} if command.clear_env else dict(base_env)
    for name, value in command.env.items():
        if not name or "=" in name or "\0" in name:
            raise _invalid(
                f"environment variable name {name!r} is invalid: it must be non-empty and "
                "contain no '=' or NUL",
                "command.env",
            )
        if "\0" in value:
            raise _invalid(
                f"environment variable {name!r} has a NUL byte in its value", "command.env"
            )
        env[name] = value

    timeout_s = limits.default_timeout_s
    if command.HasField("timeout"):
        seconds, nanos = command.timeout.seconds, command.timeout.nanos
        if not -_NANOS < nanos < _NANOS:
            raise _invalid(f"timeout has nanos={nanos}, outside ±999,999,999", "command.timeout")
        timeout_s = seconds + nanos / _NANOS
        if timeout_s <= 0:
            raise _invalid(
                f"timeout must be positive, got {timeout_s:g}s (leave it unset for the "
                f"default of {limits.default_timeout_s:g}s)",
                "command.timeout",
            )

    output_limit = command.output_limit_bytes
    if output_limit < 0 or output_limit > limits.max_output_limit_bytes:
        raise _invalid(
            f"output_limit_bytes must be from 0 to {limits.max_output_limit_bytes} "
            f"(0 means {limits.default_output_limit_bytes}), got {output_limit}",
            "command.output_limit_bytes",
        )

    cwd = _working_dir(command.working_dir, working_dir)
    executable = _find_executable(argv[0], cwd, is_shell=bool(command.shell))
    return CommandSpec(
        executable=executable,
        argv=argv,
        cwd=cwd,
        env=env,
        stdin=command.stdin,
        timeout_s=timeout_s,
        output_limit_bytes=output_limit or limits.default_output_limit_bytes,
    )


def _working_dir(requested: str, agent_dir: bytes) -> str:
    if not requested:
        return os.fsdecode(agent_dir)
    path = resolve(check_path(requested, "working_dir"), agent_dir)
    shown = display(path)[0]
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise OrchardError(
            AgentReason.WORKING_DIR_NOT_FOUND,
            f"working directory {shown!r} does not exist",
            metadata={"path": shown},
        ) from None
    except NotADirectoryError:
        st = None
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise OrchardError(
            Reason.INVALID_PATH,
            f"working directory {shown!r} is not a directory",
            metadata={"path": shown, "field": "working_dir"},
        )
    return os.fsdecode(path)


def _find_executable(program: str, cwd: str, *, is_shell: bool) -> str | None:
    """Check the file ``program`` names if it is a path; a bare name is left to exec.

    Searching PATH here would cost a stat per directory in Python on every command; the
    spawn searches it in C instead, and its errors are explained by the caller.
    """
    if "/" in program:
        path = os.path.join(cwd, program)
        problem = _unusable(path)
        if problem is None:
            return program
        if problem == "missing":
            hint = "; this image has no shell, use argv instead" if is_shell else ""
            raise OrchardError(
                AgentReason.EXECUTABLE_NOT_FOUND,
                f"executable {program!r} does not exist{hint}",
                metadata={"executable": program},
            )
        raise OrchardError(
            AgentReason.NOT_EXECUTABLE,
            f"{program!r} is {problem}, so it cannot be executed",
            metadata={"executable": program},
        )
    return None


def _unusable(path: str) -> str | None:
    """None if ``path`` can be executed, else why not ("missing" when it does not exist)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except PermissionError:
        return "in a directory the agent may not search"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if not os.access(path, os.X_OK):
        return "not executable (no execute permission)"
    return None
