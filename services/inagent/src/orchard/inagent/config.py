"""The agent's configuration: where it listens, where relative paths start, command limits.

Loaded once by :func:`orchard.inagent.main.main` from the usual layers (defaults < YAML file <
``ORCHARD_INAGENT_*`` environment < ``--set`` < flags); see :mod:`orchard.core.config`.

The agent runs with :class:`AgentConfig`, a plain frozen dataclass. :func:`load_agent_config`
builds it without pydantic when every value is plainly valid (the usual start: a few flags),
which saves about 0.2 s of start; anything else (a YAML file, JSON, the ``env`` map, a bad
value) goes through :class:`~orchard.inagent.config_model.AgentConfigModel`, the full pydantic
validation with its messages. Tests keep the two paths in agreement.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from orchard.core.config_sources import (
    SERVER_FLAGS,
    SERVER_LIST_KEYS,
    SERVER_PARSERS,
    ConfigFlag,
    PlainServerConfig,
    ValueParser,
    any_string,
    config_file_name,
    float_above,
    int_at_least,
    parse_bool,
    quick_values,
    raw_settings,
    section,
)
from orchard.inagent.commands import ExecLimits

__all__ = ["AGENT_FLAGS", "MESSAGE_OVERHEAD_BYTES", "AgentConfig", "load_agent_config"]

MESSAGE_OVERHEAD_BYTES = 64 * 1024
"""Room for the rest of an Exec response beside both outputs."""


@dataclass(frozen=True)
class AgentConfig:
    """Configuration of orchard-inagent; field documentation: AgentConfigModel."""

    server: PlainServerConfig = field(default_factory=PlainServerConfig)
    working_dir: str | None = None
    default_timeout_s: float = 600.0
    default_output_limit_bytes: int = 1024 * 1024
    max_output_limit_bytes: int = 16 * 1024 * 1024
    inherit_env: bool = True
    env: Mapping[str, str] = field(default_factory=dict)
    shell: str = "/bin/sh"
    reap_orphans: bool | None = None
    address_file: str | None = None
    ready_fd: int | None = None
    listen_dir_fd: int | None = None
    require_credential: bool = False
    lane: str | None = None
    grpc_on_demand: bool = False

    def problem(self) -> str | None:
        """Why these settings do not fit together, or None."""
        if self.grpc_on_demand and not self.lane:
            return (
                "grpc_on_demand needs a lane: the agent's gRPC server starts when asked over "
                "it (set lane, or leave grpc_on_demand false)"
            )
        return self.limits_problem()

    def limits_problem(self) -> str | None:
        """Why the output limits do not fit together or in a message, or None."""
        if self.default_output_limit_bytes > self.max_output_limit_bytes:
            return (
                "default_output_limit_bytes must not exceed max_output_limit_bytes "
                f"({self.default_output_limit_bytes} > {self.max_output_limit_bytes})"
            )
        needed = 2 * self.max_output_limit_bytes + MESSAGE_OVERHEAD_BYTES
        if needed > self.server.max_message_bytes:
            return (
                f"max_output_limit_bytes={self.max_output_limit_bytes}: an Exec response could "
                f"reach {needed} bytes, above server.max_message_bytes="
                f"{self.server.max_message_bytes}"
            )
        return None

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

    def base_env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
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


# The keys the quick path decides itself; `env` (a map) and anything else go to pydantic.
_QUICK_PARSERS: dict[str, ValueParser] = {
    **SERVER_PARSERS,
    "working_dir": any_string,
    "default_timeout_s": float_above(0, inclusive=False),
    "default_output_limit_bytes": int_at_least(1),
    "max_output_limit_bytes": int_at_least(1),
    "inherit_env": parse_bool,
    "shell": any_string,
    "reap_orphans": parse_bool,
    "address_file": any_string,
    "ready_fd": int_at_least(0),
    "listen_dir_fd": int_at_least(0),
    "require_credential": parse_bool,
    "lane": any_string,
    "grpc_on_demand": parse_bool,
}


def load_agent_config(
    args: argparse.Namespace, env: Mapping[str, str], env_prefix: str
) -> AgentConfig:
    """The agent's configuration from the command line and environment (a ConfigLoader).

    Raises :class:`~orchard.core.config_sources.ConfigError` naming the key and its source.
    """
    if not config_file_name(args, env, env_prefix):
        values = quick_values(
            raw_settings(args, env, env_prefix).in_order(), _QUICK_PARSERS, SERVER_LIST_KEYS
        )
        if values is not None:
            server = PlainServerConfig.from_values(section(values, "server"))
            own = {key: value for key, value in values.items() if "." not in key}
            config = AgentConfig(server=server, **own)
            if config.problem() is None:
                return config
    from orchard.core.config import config_from_args  # noqa: PLC0415 - pydantic, only if needed
    from orchard.inagent.config_model import AgentConfigModel  # noqa: PLC0415

    model = config_from_args(AgentConfigModel, args, env=env, env_prefix=env_prefix)
    return model.to_config()


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
        "--ready-fd",
        "ready_fd",
        "once serving, write the bound addresses to file descriptor N and close it",
        metavar="N",
    ),
    ConfigFlag(
        "--listen-dir-fd",
        "listen_dir_fd",
        "descriptor N of the directory a unix:/proc/self/fd/N/NAME address binds in; "
        "closed once bound",
        metavar="N",
    ),
    ConfigFlag(
        "--lane",
        "lane",
        "also serve orchard-env's exec lane at ADDRESS (unix:PATH or HOST:PORT)",
        metavar="ADDRESS",
    ),
    ConfigFlag(
        "--grpc-on-demand",
        "grpc_on_demand",
        "true: serve only the lane until asked over it to start gRPC (default false)",
        metavar="BOOL",
    ),
    ConfigFlag(
        "--reap-orphans",
        "reap_orphans",
        "reap orphaned processes: true or false (default: only as PID 1)",
        metavar="BOOL",
    ),
)
"""The agent's command-line flags: the common server flags and its own shortcuts."""
