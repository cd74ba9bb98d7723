"""The agent's configuration as a pydantic model: the full validation and its error messages.

Imported only when the quick path of :func:`orchard.inagent.config.load_agent_config` cannot
decide (a YAML file, JSON values, the ``env`` map, anything invalid), so a plain start never
pays for pydantic. Defaults come from :class:`~orchard.inagent.config.AgentConfig`.
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, field_validator, model_validator

from orchard.core.config import PlainServerConfig, ServiceConfig
from orchard.inagent.config import AgentConfig

__all__ = ["AgentConfigModel"]

_DEFAULTS = AgentConfig(server=PlainServerConfig())


class AgentConfigModel(ServiceConfig):
    """Configuration of orchard-inagent."""

    working_dir: str | None = Field(
        _DEFAULTS.working_dir,
        description=(
            "Directory that relative paths (of files and of command working directories) "
            "resolve against. Default: the agent's current directory at start."
        ),
    )
    default_timeout_s: float = Field(
        _DEFAULTS.default_timeout_s,
        gt=0,
        description="Wall-clock limit of a command that sets no timeout, seconds.",
    )
    default_output_limit_bytes: int = Field(
        _DEFAULTS.default_output_limit_bytes,
        gt=0,
        description="Bytes kept of each of stdout and stderr when a command sets no cap.",
    )
    max_output_limit_bytes: int = Field(
        _DEFAULTS.max_output_limit_bytes,
        gt=0,
        description=(
            "Largest cap a command may ask for. Both outputs travel in one Exec response, so "
            "twice this must fit in server.max_message_bytes."
        ),
    )
    inherit_env: bool = Field(
        _DEFAULTS.inherit_env,
        description=(
            "Start commands' base environment from the agent's own (minus ORCHARD_* "
            "variables, which configure the agent); false starts from nothing."
        ),
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Variables added to the base environment of every command (e.g. PATH).",
    )
    shell: str = Field(
        _DEFAULTS.shell, description="The shell that runs Command.shell, as SHELL -c."
    )
    reap_orphans: bool | None = Field(
        _DEFAULTS.reap_orphans,
        description=(
            "Reap orphaned processes reparented to the agent (the duty of PID 1). "
            "Unset: only when the agent runs as PID 1."
        ),
    )
    address_file: str | None = Field(
        _DEFAULTS.address_file,
        description=(
            "Write the bound addresses here, one per line, once listening (useful with port 0). "
            "Written to a temporary sibling and renamed, so a reader never sees half of it."
        ),
    )

    ready_fd: int | None = Field(
        _DEFAULTS.ready_fd,
        ge=0,
        description=(
            "An open file descriptor (a pipe the starter holds) to which the agent writes its "
            "bound addresses, one per line, once SERVING, and then closes: the starter learns "
            "readiness from the event without polling. Unset: nothing is written."
        ),
    )
    listen_dir_fd: int | None = Field(
        _DEFAULTS.listen_dir_fd,
        ge=0,
        description=(
            "An inherited descriptor of a directory outside the agent's root (the local "
            "runtime's run directory) that a `unix:/proc/self/fd/N/NAME` listen address binds "
            "in. Closed as soon as the server is bound, so the agent keeps no way out of its "
            "root and the socket is out of the sandbox's reach. Unset: none."
        ),
    )

    lane: str | None = Field(
        _DEFAULTS.lane,
        description=(
            "Also serve the exec lane here (`unix:PATH`, or `HOST:PORT`): orchard-env's Exec "
            "calls in a lean framing beside AgentService (orchard/inagent/v1/exec_lane.proto), "
            "under the same credential rules. Unset: no lane, every call is gRPC."
        ),
    )
    grpc_on_demand: bool = Field(
        _DEFAULTS.grpc_on_demand,
        description=(
            "Serve only the lane at start; the gRPC server (AgentService, health, reflection) "
            "starts on the lane's `open_grpc` call and then serves until the agent stops. "
            "Spares a sandbox that only runs commands grpc's start and its idle threads. "
            "Needs `lane`."
        ),
    )
    require_credential: bool = Field(
        _DEFAULTS.require_credential,
        description=(
            "Refuse calls that carry no route credential (`authorization: Bearer <credential>` "
            "from EnvService.OpenAgentRoute), except health, reflection and ProveIdentity. "
            "False: such calls are served, and the transport must keep them to orchard-env "
            "(a host-only socket, a NetworkPolicy). A call that carries a credential is checked "
            "either way."
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
    def _check_settings(self) -> Self:
        problem = self.to_config().problem()
        if problem:
            raise ValueError(problem)
        return self

    def to_config(self) -> AgentConfig:
        """The validated values as the plain :class:`AgentConfig` the agent runs with."""
        values = self.model_dump(exclude={"server"})
        return AgentConfig(server=PlainServerConfig.from_values(self.server.model_dump()), **values)
