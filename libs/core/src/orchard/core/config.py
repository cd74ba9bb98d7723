"""Configuration: one typed, frozen object per service, loaded once at the entry point.

Layers, lowest precedence first:

1. the defaults declared on the model,
2. a YAML file (``--config FILE``, else ``$<PREFIX>CONFIG``, else the ``yaml_path`` argument),
3. environment variables ``<PREFIX><KEY>``, nesting with a double underscore. The prefix is
   ``ORCHARD_`` by default; :func:`orchard.core.server.run_service` scopes it to the service
   (``ORCHARD_INAGENT_``), so services started from one shell never read each other's settings:
   ``ORCHARD_INAGENT_SERVER__GRACE_PERIOD_S=5`` sets the agent's ``server.grace_period_s``,
4. command-line flags: ``--set key.sub=value`` (repeatable, applied in order), then the typed
   convenience flags (``--listen``, ``--log-level``, ...), which win.

Values from the environment and ``--set`` are strings that pydantic converts to the field's type;
a value starting with ``[`` or ``{`` is read as JSON, and a plain string given for a list field
is split on commas (``ORCHARD_SERVER__LISTEN=127.0.0.1:0,unix:/run/a.sock``).

Every mistake is a :class:`ConfigError` whose message names the key and where the value came
from, e.g. ``server.grace_period_s: Input should be a valid number, got 'abc' (from
ORCHARD_SERVER__GRACE_PERIOD_S)``. Unknown keys are mistakes too, in every layer. A service's
``main`` prints the message and exits with status 2 (see :func:`orchard.core.server.run_service`).

A service declares its configuration as a :class:`ServiceConfig` (which has the ``server:``
:class:`ServerConfig` section) plus whatever else it needs::

    class AgentConfig(ServiceConfig):
        server: ServerConfig = ServerConfig(listen=["unix:/run/orchard/agent.sock"])
        max_output_bytes: int = Field(1 << 20, gt=0, description="Cap on captured output.")

    config = load_config(AgentConfig, argv=sys.argv[1:])

Importing pydantic and building the models costs a process about 0.2 s. The parts that need no
pydantic (the command line, the raw layers, :class:`ConfigError`) live in
:mod:`orchard.core.config_sources`, with a quick path a service that must start fast can take
when every value is plainly valid, falling back to its model here otherwise.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from orchard.core.addresses import parse_listen_address
from orchard.core.config_sources import (
    CONFIG_FILE_ENV,
    DISABLED_WORDS,
    ENV_PREFIX,
    NON_CONFIG_ENV,
    SERVER_FLAGS,
    ConfigError,
    ConfigFlag,
    PlainServerConfig,
    RaisingParser,
    RawSetting,
    add_config_arguments,
    config_file_name,
    raw_settings,
    service_env_prefix,
)

__all__ = [
    "CONFIG_FILE_ENV",
    "ENV_PREFIX",
    "NON_CONFIG_ENV",
    "SERVER_FLAGS",
    "ConfigError",
    "ConfigFlag",
    "ConfigModel",
    "PlainServerConfig",
    "ServerConfig",
    "ServiceConfig",
    "add_config_arguments",
    "config_from_args",
    "deep_merge",
    "load_config",
    "load_document",
    "service_env_prefix",
    "validate_document",
]

M = TypeVar("M", bound=BaseModel)


class ConfigModel(BaseModel):
    """Base for every configuration model: immutable, and unknown keys are errors."""

    model_config = ConfigDict(frozen=True, extra="forbid")


LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class ServerConfig(ConfigModel):
    """How a gRPC server listens, drains and reports; shared by every Orchard service."""

    listen: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:0"],
        min_length=1,
        description=(
            "Addresses to serve gRPC on: HOST:PORT, [IPv6]:PORT or unix:PATH. "
            "Port 0 picks a free port, reported in the 'serving' log line."
        ),
    )
    grace_period_s: float = Field(
        default=10.0,
        ge=0,
        description=(
            "On SIGTERM/SIGINT, how long in-flight calls may run before they are cancelled."
        ),
    )
    max_concurrent_rpcs: int = Field(
        default=100_000,
        ge=1,
        description=(
            "Calls served at once before new ones get RESOURCE_EXHAUSTED; also the queue "
            "limit of pending calls (gRPC's own default of 1000 cancels calls past it)."
        ),
    )
    max_message_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="Largest message the server accepts or sends, in bytes.",
    )
    metrics_address: str | None = Field(
        default=None,
        description=(
            "HOST:PORT of the Prometheus /metrics endpoint; port 0 picks a free port. "
            "Unset, empty or 'off' disables metrics (and never imports prometheus_client)."
        ),
    )
    unix_socket_mode: int = Field(
        default=0o660,
        ge=0,
        le=0o777,
        description="Permissions of Unix sockets the server creates (octal string accepted).",
    )
    log_level: LogLevel = Field(default="INFO", description="Lowest level of log records written.")
    tls_cert_file: str | None = Field(
        default=None,
        description=(
            "PEM certificate chain the server presents; with tls_key_file, TCP listeners serve "
            "TLS only. Unix sockets stay plaintext (their file mode guards them)."
        ),
    )
    tls_key_file: str | None = Field(
        default=None, description="PEM private key of tls_cert_file; set both or neither."
    )
    tls_client_ca_file: str | None = Field(
        default=None,
        description=(
            "PEM CA bundle; when set, TLS clients must present a certificate signed by it "
            "(mutual TLS). Needs tls_cert_file and tls_key_file."
        ),
    )

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: list[str]) -> list[str]:
        return [str(parse_listen_address(item)) for item in value]

    @field_validator("metrics_address", mode="before")
    @classmethod
    def _check_metrics_address(cls, value: object) -> object:
        if isinstance(value, str):
            if value.strip().lower() in DISABLED_WORDS:
                return None
            address = parse_listen_address(value)
            if address.is_unix:
                raise ValueError("metrics are served over TCP: use HOST:PORT")
            return str(address)
        return value

    @field_validator("unix_socket_mode", mode="before")
    @classmethod
    def _octal_mode(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                return int(value, 8)
            except ValueError:
                raise ValueError(f"expected an octal mode such as 0660, got {value!r}") from None
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator("tls_cert_file", "tls_key_file", "tls_client_ca_file")
    @classmethod
    def _readable_pem(cls, value: str | None) -> str | None:
        if not value:
            return None  # an empty string (e.g. from the environment) means unset
        from orchard.core.tls import read_pem  # noqa: PLC0415 - grpc, only when TLS is used

        read_pem(value)
        return value

    @model_validator(mode="after")
    def _tls_pairing(self) -> ServerConfig:
        if not (self.tls_cert_file or self.tls_key_file or self.tls_client_ca_file):
            return self
        from orchard.core.tls import tls_pairing_problem  # noqa: PLC0415

        problem = tls_pairing_problem(
            self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file
        )
        if problem is not None:
            raise ValueError(problem)
        return self


class ServiceConfig(ConfigModel):
    """Base for a service's configuration: a ``server`` section plus the service's own keys.

    Override the default to give a service its own listen address::

        class AgentConfig(ServiceConfig):
            server: ServerConfig = ServerConfig(listen=["unix:/run/orchard/agent.sock"])
    """

    server: ServerConfig = Field(
        default_factory=ServerConfig, description="How the gRPC server listens and drains."
    )


# ---------------------------------------------------------------------------------------------
# Loading


def config_from_args(
    model_cls: type[M],
    args: argparse.Namespace,
    *,
    env: Mapping[str, str] | None = None,
    yaml_path: str | os.PathLike[str] | None = None,
    env_prefix: str = ENV_PREFIX,
) -> M:
    """Build ``model_cls`` from parsed arguments (see :func:`add_config_arguments`) and layers.

    Environment variables starting with ``env_prefix`` are configuration; ``<env_prefix>CONFIG``
    names the YAML file when ``--config`` is not given.
    """
    env = os.environ if env is None else env
    layers: list[_Layer] = [_default_layer(model_cls)]
    file_name = config_file_name(args, env, env_prefix, yaml_path)
    if file_name:
        layers.append(_yaml_layer(Path(file_name)))
    raw = raw_settings(args, env, env_prefix)
    layers += [_string_layer(model_cls, settings) for settings in (raw.env, raw.set, raw.flags)]
    return _validate(model_cls, layers)


def load_config(
    model_cls: type[M],
    *,
    argv: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    yaml_path: str | os.PathLike[str] | None = None,
    flags: Sequence[ConfigFlag] | None = None,
    prog: str | None = None,
    env_prefix: str = ENV_PREFIX,
) -> M:
    """Parse ``argv`` (configuration options only) and load ``model_cls`` from all layers.

    ``flags`` defaults to :data:`SERVER_FLAGS` when the model has a ``server`` field, else none.
    Raises :class:`ConfigError`, also for a malformed command line.
    """
    if flags is None:
        flags = SERVER_FLAGS if "server" in model_cls.model_fields else ()
    parser = RaisingParser(prog=prog, add_help=False)
    add_config_arguments(parser, flags)
    args = parser.parse_args(list(argv))
    return config_from_args(model_cls, args, env=env, yaml_path=yaml_path, env_prefix=env_prefix)


# A layer is a nested dict of raw values plus, per dotted key, where each value came from.
@dataclass
class _Layer:
    values: dict[str, Any]
    sources: dict[str, str]


def _default_layer(model_cls: type[BaseModel]) -> _Layer:
    """Defaults that are model instances, so a partial override keeps the rest of them.

    Without this, ``ORCHARD_SERVER__GRACE_PERIOD_S`` would rebuild ``server`` from the class
    defaults of ServerConfig and drop a service's own default listen address.
    """
    values: dict[str, Any] = {}
    for name, field in model_cls.model_fields.items():
        if field.is_required():
            continue
        default = field.get_default(call_default_factory=True, validated_data={})
        if isinstance(default, BaseModel):
            values[name] = default.model_dump()
    return _Layer(values, {})


def _yaml_layer(path: Path) -> _Layer:
    import yaml  # noqa: PLC0415 - only services that use a file pay for the import

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"config file {path}: {exc.strerror or exc}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"config file {path}: not valid YAML: {exc}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"config file {path}: expected a mapping of keys at the top level"])
    sources: dict[str, str] = {}
    _record_sources(data, (), f"config file {path}", sources)
    return _Layer(data, sources)


def _record_sources(value: Any, prefix: tuple[str, ...], source: str, out: dict[str, str]) -> None:
    if prefix:
        out[".".join(prefix)] = source
    if isinstance(value, dict):
        for key, item in value.items():
            _record_sources(item, (*prefix, str(key)), source, out)


def load_document(model_cls: type[M], path: str | os.PathLike[str]) -> M:
    """One YAML document (a recipe, say; not a layered service configuration) as ``model_cls``.

    Every problem names its key and line, e.g. ``stages.sft.learning_rate: Input should be
    greater than 0, got -1 (from recipe.yaml, line 14)``; all problems are reported at once as a
    :class:`ConfigError`.
    """
    import yaml  # noqa: PLC0415

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: {exc.strerror or exc}"]) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping of keys at the top level"])
    sources: dict[str, str] = {}
    _record_lines(node, (), path.name, sources)
    return _validate(model_cls, [_Layer(data, sources)])


def validate_document(model_cls: type[M], data: Mapping[str, Any], source: str) -> M:
    """``data`` (a document built in code, e.g. a recipe with an experiment's settings laid
    over it) as ``model_cls``; every problem names its key and ``source``, all at once, as a
    :class:`ConfigError`."""
    sources: dict[str, str] = {}
    _record_sources(dict(data), (), source, sources)
    return _validate(model_cls, [_Layer(dict(data), sources)])


def _record_lines(node: Any, prefix: tuple[str, ...], name: str, out: dict[str, str]) -> None:
    """Where each key path of a composed YAML node starts (lines from 1)."""
    import yaml  # noqa: PLC0415

    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = (*prefix, str(key.value))
            out[".".join(path)] = f"{name}, line {key.start_mark.line + 1}"
            _record_lines(value, path, name, out)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            path = (*prefix, str(index))
            out[".".join(path)] = f"{name}, line {item.start_mark.line + 1}"
            _record_lines(item, path, name, out)


def _string_layer(model_cls: type[BaseModel], settings: Sequence[RawSetting]) -> _Layer:
    layer = _Layer({}, {})
    for setting in settings:
        value = setting.value
        raw = value if isinstance(value, list) else _coerce(model_cls, setting.path, value)
        _put(layer, setting.path, raw, setting.source)
    return layer


def _put(layer: _Layer, path: tuple[str, ...], value: Any, source: str) -> None:
    node = layer.values
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value
    layer.sources[".".join(path)] = source


def _coerce(model_cls: type[BaseModel], path: tuple[str, ...], text: str) -> Any:
    """Turn a string from the environment or --set into the shape its field expects."""
    stripped = text.strip()
    if stripped[:1] in ("[", "{"):
        try:
            return json.loads(stripped)
        except ValueError:
            return text  # let validation report it against the key
    if _is_list_field(model_cls, path):
        return [part.strip() for part in stripped.split(",") if part.strip()]
    return text


def _is_list_field(model_cls: type[BaseModel], path: tuple[str, ...]) -> bool:
    annotation: Any = model_cls
    for part in path:
        model = _model_in(annotation)
        if model is None or part not in model.model_fields:
            return False
        annotation = model.model_fields[part].annotation
    return any(
        typing.get_origin(arm) in (list, tuple, set, frozenset, Sequence)
        for arm in _arms(annotation)
    )


def _arms(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [arm for arm in typing.get_args(annotation) if arm is not type(None)]
    return [annotation]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    for arm in _arms(annotation):
        if isinstance(arm, type) and issubclass(arm, BaseModel):
            return arm
    return None


def deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``update`` laid over it: mappings merge key by key, anything else replaces."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _validate(model_cls: type[M], layers: Sequence[_Layer]) -> M:
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for layer in layers:
        values = deep_merge(values, layer.values)
        sources.update(layer.sources)
    try:
        return model_cls.model_validate(values)
    except ValidationError as exc:
        problems = [_describe(model_cls, error, sources) for error in exc.errors()]
        raise ConfigError(problems) from None


def _describe(model_cls: type[BaseModel], error: Any, sources: Mapping[str, str]) -> str:
    loc = [str(part) for part in error["loc"]]
    key = ".".join(loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        text = f"{key}: unknown key{_suggestion(model_cls, loc)}"
    else:
        message = str(error["msg"])
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        text = f"{key}: {message}"
        if not isinstance(error.get("input"), dict) and "input" in error:
            text += f", got {error['input']!r}"
    source = _source_of(loc, sources)
    return f"{text} (from {source})" if source else text


def _source_of(loc: Sequence[str], sources: Mapping[str, str]) -> str | None:
    for end in range(len(loc), 0, -1):
        source = sources.get(".".join(loc[:end]))
        if source is not None:
            return source
    # An unknown section (`servr`) was given only through nested keys (`servr.x`): name those.
    below = ".".join(loc) + "."
    nested = sorted({source for key, source in sources.items() if key.startswith(below)})
    return ", ".join(nested) or None


def _suggestion(model_cls: type[BaseModel], loc: Sequence[str]) -> str:
    annotation: Any = model_cls
    for part in loc[:-1]:
        model = _model_in(annotation)
        if model is None or part not in model.model_fields:
            return ""
        annotation = model.model_fields[part].annotation
    model = _model_in(annotation)
    if model is None:
        return ""
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
