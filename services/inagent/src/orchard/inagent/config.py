"""The agent's configuration: where it listens, where relative paths start, command limits.

Loaded once by :func:`orchard.inagent.main.main` from the usual layers (defaults < YAML file <
``ORCHARD_*`` environment < ``--set`` < flags); see :mod:`orchard.core.config`.
"""

from __future__ import annotations

import os
from typing import Self

from pydantic import Field, field_validator, model_validator

from orchard.core.config import SERVER_FLAGS, ConfigFlag, ServiceConfig
from orchard.inagent.commands import ExecLimits

__all__ = ["AGENT_FLAGS", "AgentConfig"]

_MESSAGE_OVERHEAD_BYTES = 64 * 1024


class AgentConfig(ServiceConfig):
    """Configuration of orchard-inagent."""

    working_dir: str | None = Field(
        None,
        description=(
            "Directory that relative paths (of files and of command working directories) "
            "resolve against. Default: the agent's current directory at start."
        ),
    )
    default_timeout_s: float = Field(
        600.0, gt=0, description="Wall-clock limit of a command that sets no timeout, seconds."
    )
    default_output_limit_bytes: int = Field(
        1024 * 1024,
        gt=0,
        description="Bytes kept of each of stdout and stderr when a command sets no cap.",
    )
    max_output_limit_bytes: int = Field(
        16 * 1024 * 1024,
        gt=0,
        description=(
            "Largest cap a command may ask for. Both outputs travel in one Exec response, so "
            "twice this must fit in server.max_message_bytes."
        ),
    )
    inherit_env: bool = Field(
        True,
        description=(
            "Start commands' base environment from the agent's own (minus ORCHARD_* "
            "variables, which configure the agent); false starts from nothing."
        ),
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Variables added to the base environment of every command (e.g. PATH).",
    )
    shell: str = Field("/bin/sh", description="The shell that runs Command.shell, as SHELL -c.")
    reap_orphans: bool | None = Field(
        None,
        description=(
            "Reap orphaned processes reparented to the agent (the duty of PID 1). "
            "Unset: only when the agent runs as PID 1."
        ),
    )
    address_file: str | None = Field(
        None,
        description=(
            "Write the bound addresses here, one per line, once listening (useful with port 0). "
            "Written to a temporary sibling and renamed, so a reader never sees half of it."
        ),
    )

    @field_validator("env")
    @classmethod
    def _check_env(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if not name or "=" in name or "\0" in name or "\0" in text:
                raise ValueError(f"environment variable {name!r}: bad name or NUL in value")
        return value

    @model_validator(mode="after")
    def _check_limits(self) -> Self:
        if self.default_output_limit_bytes > self.max_output_limit_bytes:
            raise ValueError(
                "default_output_limit_bytes must not exceed max_output_limit_bytes "
                f"({self.default_output_limit_bytes} > {self.max_output_limit_bytes})"
            )
        needed = 2 * self.max_output_limit_bytes + _MESSAGE_OVERHEAD_BYTES
        if needed > self.server.max_message_bytes:
            raise ValueError(
                f"max_output_limit_bytes={self.max_output_limit_bytes}: an Exec response could "
                f"reach {needed} bytes, above server.max_message_bytes="
                f"{self.server.max_message_bytes}"
            )
        return self

    @property
    def limits(self) -> ExecLimits:
        """The command limits, as the exec machinery takes them."""
        return ExecLimits(
            default_timeout_s=self.default_timeout_s,
            default_output_limit_bytes=self.default_output_limit_bytes,
            max_output_limit_bytes=self.max_output_limit_bytes,
        )

    def resolved_working_dir(self) -> bytes:
        """The absolute working directory, as bytes."""
        return os.fsencode(os.path.abspath(self.working_dir or os.getcwd()))

    def base_env(self, environ: dict[str, str] | None = None) -> dict[str, str]:
        """The environment commands start from (before a request's own variables)."""
        source = os.environ if environ is None else environ
        base = (
            {k: v for k, v in source.items() if not k.startswith("ORCHARD_")}
            if self.inherit_env
            else {}
        )
        base.update(self.env)
        return base

    def should_reap_orphans(self) -> bool:
        """Whether to reap orphans: as configured, else when running as PID 1."""
        return self.reap_orphans if self.reap_orphans is not None else os.getpid() == 1


AGENT_FLAGS: tuple[ConfigFlag, ...] = (
    *SERVER_FLAGS,
    ConfigFlag("--working-dir", "working_dir", "resolve relative paths against DIR", metavar="DIR"),
    ConfigFlag(
        "--default-timeout-s",
        "default_timeout_s",
        "time limit of commands that set none",
        metavar="S",
    ),
    ConfigFlag(
        "--address-file", "address_file", "write the bound addresses to FILE", metavar="FILE"
    ),
    ConfigFlag(
        "--reap-orphans",
        "reap_orphans",
        "reap orphaned processes: true or false (default: only as PID 1)",
        metavar="BOOL",
    ),
)
"""The agent's command-line flags: the common server flags and its own shortcuts."""
