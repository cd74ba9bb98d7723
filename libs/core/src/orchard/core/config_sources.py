"""Configuration without pydantic: where raw values come from, and a quick path for common cases.

:mod:`orchard.core.config` validates with pydantic, whose import and model building cost a
process about 0.2 s at start. This module holds what needs no pydantic, so a service that must
start fast (the in-sandbox agent) can read its command line and environment, and, when every
value is plainly valid, build its configuration without pydantic at all:

- :class:`ConfigError`, :class:`ConfigFlag`, :data:`SERVER_FLAGS`, :func:`add_config_arguments`
  and :func:`service_env_prefix` (re-exported by :mod:`orchard.core.config`);
- :func:`raw_settings`: the environment, ``--set`` and flag values, as strings, per layer;
- :class:`PlainServerConfig` and :func:`quick_values`: strict parsers that accept only values
  pydantic would accept unchanged, and give up (return None) on anything else, so the caller
  falls back to the pydantic model, which reports errors with the usual messages.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from orchard.core.addresses import parse_listen_address

__all__ = [
    "CONFIG_FILE_ENV",
    "ENV_PREFIX",
    "NON_CONFIG_ENV",
    "SERVER_FLAGS",
    "ConfigError",
    "ConfigFlag",
    "PlainServerConfig",
    "RawSetting",
    "RawSettings",
    "add_config_arguments",
    "config_file_name",
    "quick_values",
    "raw_settings",
    "service_env_prefix",
]

ENV_PREFIX = "ORCHARD_"
"""Default prefix: environment variables with it are configuration, every one of them."""
CONFIG_FILE_ENV = "ORCHARD_CONFIG"
"""Names the YAML file when ``--config`` is not given (``<prefix>CONFIG`` for another prefix);
not itself a configuration key."""
NON_CONFIG_ENV = frozenset({CONFIG_FILE_ENV, "ORCHARD_ETCD_BINARY", "ORCHARD_HARNESS_CACHE"})
"""``ORCHARD_*`` variables that are not configuration keys (read elsewhere); never an error.
Keep this list short: each name here is one a typo check cannot catch."""

_ENV_NESTING = "__"
_FLAGS_DEST = "config_flags"
DISABLED_WORDS = frozenset({"", "off", "none", "disabled", "false"})
"""Values of ``server.metrics_address`` that turn metrics off."""


class ConfigError(ValueError):
    """The configuration is unusable; the message says which key, why, and where it came from."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            text = f"invalid configuration: {self.problems[0]}"
        else:
            text = "invalid configuration:\n" + "\n".join(f"  {p}" for p in self.problems)
        super().__init__(text)


# ---------------------------------------------------------------------------------------------
# Command line


@dataclass(frozen=True)
class ConfigFlag:
    """A typed command-line shortcut for one configuration key (``--listen`` for server.listen)."""

    flag: str
    """The option, e.g. ``--log-level``."""
    key: str
    """The dotted configuration key it sets, e.g. ``server.log_level``."""
    help: str
    """One line for ``--help``."""
    repeatable: bool = False
    """Given several times, the values form a list (for list fields)."""
    metavar: str | None = None
    """Placeholder shown in ``--help``."""

    @property
    def dest(self) -> str:
        """Attribute of the parsed arguments that holds the flag's value."""
        return "config_flag:" + self.key


SERVER_FLAGS: tuple[ConfigFlag, ...] = (
    ConfigFlag(
        "--listen",
        "server.listen",
        "serve gRPC on ADDR (HOST:PORT, [IPv6]:PORT, unix:PATH); repeat for several",
        repeatable=True,
        metavar="ADDR",
    ),
    ConfigFlag("--grace-period-s", "server.grace_period_s", "drain time on SIGTERM", metavar="S"),
    ConfigFlag(
        "--metrics-address",
        "server.metrics_address",
        "serve Prometheus /metrics on HOST:PORT ('off' disables)",
        metavar="ADDR",
    ),
    ConfigFlag(
        "--log-level", "server.log_level", "DEBUG, INFO, WARNING, ERROR or CRITICAL", metavar="L"
    ),
)
"""The convenience flags every service with a ``server: ServerConfig`` field gets."""


class RaisingParser(argparse.ArgumentParser):
    """An argument parser that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError([f"command line: {message}"])


def add_config_arguments(
    parser: argparse.ArgumentParser,
    flags: Sequence[ConfigFlag] = SERVER_FLAGS,
    *,
    env_prefix: str = "ORCHARD_",
) -> None:
    """Add ``--config FILE``, ``--set KEY=VALUE`` and the given typed flags to ``parser``.

    ``env_prefix`` only shapes the help text (which variables the service reads).
    """
    group = parser.add_argument_group(
        "configuration",
        f"Settings also come from a YAML file and from {env_prefix}<KEY> environment variables "
        f"(nested keys joined by '__', e.g. {env_prefix}SERVER__LOG_LEVEL=DEBUG); flags win.",
    )
    group.add_argument(
        "--config",
        metavar="FILE",
        dest="config_file",
        help=f"YAML configuration file (default: ${env_prefix}CONFIG)",
    )
    group.add_argument(
        "--set",
        metavar="KEY=VALUE",
        dest="config_set",
        action="append",
        default=[],
        help="set one configuration key, e.g. --set server.grace_period_s=5; repeatable",
    )
    parser.set_defaults(**{_FLAGS_DEST: tuple(flags)})
    for flag in flags:
        group.add_argument(
            flag.flag,
            dest=flag.dest,
            action="append" if flag.repeatable else "store",
            metavar=flag.metavar,
            help=f"{flag.help} (sets {flag.key})",
        )


def service_env_prefix(service: str) -> str:
    """The environment prefix of one service: ``ORCHARD_INAGENT_`` for ``inagent``."""
    return f"{ENV_PREFIX}{service.upper().replace('-', '_')}_"


# ---------------------------------------------------------------------------------------------
# Raw values


@dataclass(frozen=True)
class RawSetting:
    """One value as given: a string (a list of strings from a repeatable flag), and its source."""

    path: tuple[str, ...]
    """The key, split: ``("server", "grace_period_s")``."""
    value: str | list[str]
    source: str
    """Where it came from, for messages: ``ORCHARD_X``, ``--set x=1``, ``--listen``."""

    @property
    def key(self) -> str:
        """The dotted key."""
        return ".".join(self.path)


@dataclass(frozen=True)
class RawSettings:
    """The string-valued layers, lowest precedence first (the YAML file is separate)."""

    env: list[RawSetting]
    set: list[RawSetting]
    flags: list[RawSetting]

    def in_order(self) -> list[RawSetting]:
        """Every setting, lowest precedence first: a later one wins."""
        return [*self.env, *self.set, *self.flags]


def config_file_name(
    args: argparse.Namespace,
    env: Mapping[str, str],
    env_prefix: str,
    yaml_path: str | os.PathLike[str] | None = None,
) -> str | os.PathLike[str] | None:
    """The YAML file to read: ``--config``, else ``$<prefix>CONFIG``, else ``yaml_path``."""
    name: str | os.PathLike[str] | None = (
        getattr(args, "config_file", None) or env.get(f"{env_prefix}CONFIG") or yaml_path
    )
    return name or None


def raw_settings(
    args: argparse.Namespace, env: Mapping[str, str], env_prefix: str = ENV_PREFIX
) -> RawSettings:
    """The environment, ``--set`` and flag values, unconverted. Raises ConfigError if malformed."""
    return RawSettings(
        env=_env_settings(env, env_prefix),
        set=_set_settings(getattr(args, "config_set", None) or []),
        flags=_flag_settings(args, getattr(args, _FLAGS_DEST, ())),
    )


def _env_settings(env: Mapping[str, str], prefix: str) -> list[RawSetting]:
    settings = []
    for name in sorted(env):
        if not name.startswith(prefix) or name in NON_CONFIG_ENV or name == f"{prefix}CONFIG":
            continue
        path = tuple(part.lower() for part in name[len(prefix) :].split(_ENV_NESTING))
        if not all(path):
            raise ConfigError([f"{name}: empty key part; nest keys with '__' ({prefix}A__B)"])
        settings.append(RawSetting(path, env[name], name))
    return settings


def _set_settings(assignments: Sequence[str]) -> list[RawSetting]:
    settings = []
    for item in assignments:
        key, sep, value = item.partition("=")
        path = tuple(key.strip().split("."))
        if not sep or not all(path):
            raise ConfigError([f"--set {item!r}: expected KEY=VALUE, e.g. server.log_level=DEBUG"])
        settings.append(RawSetting(path, value, f"--set {item}"))
    return settings


def _flag_settings(args: argparse.Namespace, flags: Sequence[ConfigFlag]) -> list[RawSetting]:
    settings = []
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if value is not None:
            settings.append(RawSetting(tuple(flag.key.split(".")), value, flag.flag))
    return settings


# ---------------------------------------------------------------------------------------------
# Quick path: plain values, strictly parsed

ValueParser = Callable[[str], Any]
"""Turns one string into a field's value; raises ValueError where unsure or invalid."""

# Only the plainest spellings: anything else (signs, exponents, "inf", underscores, spaces) is
# left to pydantic, which accepts more but must then be asked.
_PLAIN_INT = re.compile(r"0|[1-9][0-9]*")
_PLAIN_FLOAT = re.compile(r"[0-9]+(\.[0-9]+)?")
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def int_at_least(minimum: int, maximum: int | None = None) -> ValueParser:
    """A parser of a plain decimal integer in ``[minimum, maximum]``."""

    def parse(text: str) -> int:
        if not _PLAIN_INT.fullmatch(text):
            raise ValueError(text)
        value = int(text)
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(text)
        return value

    return parse


def float_above(minimum: float, *, inclusive: bool) -> ValueParser:
    """A parser of a plain decimal number above ``minimum`` (or equal, if ``inclusive``)."""

    def parse(text: str) -> float:
        if not _PLAIN_FLOAT.fullmatch(text):
            raise ValueError(text)
        value = float(text)
        if value < minimum or (value == minimum and not inclusive):
            raise ValueError(text)
        return value

    return parse


def parse_bool(text: str) -> bool:
    """``true``/``false``, ``1``/``0``, ``yes``/``no``."""
    return _BOOL_WORDS[text]  # KeyError is a LookupError, turned into "unsure" below


def any_string(text: str) -> str:
    return text


def _listen_address(text: str) -> str:
    return str(parse_listen_address(text))


def _metrics_address(text: str) -> str | None:
    if text.strip().lower() in DISABLED_WORDS:
        return None
    address = parse_listen_address(text)
    if address.is_unix:
        raise ValueError(text)
    return str(address)


def _octal_mode(text: str) -> int:
    mode = int(text, 8)
    if not 0 <= mode <= 0o777:
        raise ValueError(text)
    return mode


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(text)
    return level


@dataclass(frozen=True)
class PlainServerConfig:
    """The values of :class:`orchard.core.config.ServerConfig`, as a plain frozen dataclass.

    Same fields and defaults (a test keeps them equal); built by :func:`quick_values` or from a
    validated ServerConfig, for a service that must start without importing pydantic.
    """

    listen: tuple[str, ...] = ("127.0.0.1:0",)
    grace_period_s: float = 10.0
    max_concurrent_rpcs: int = 100_000
    max_message_bytes: int = 64 * 1024 * 1024
    metrics_address: str | None = None
    unix_socket_mode: int = 0o660
    log_level: str = "INFO"
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> PlainServerConfig:
        """From ``{field: value}`` (e.g. ``ServerConfig.model_dump()``)."""
        return cls(**{**values, "listen": tuple(values.get("listen", cls.listen))})


# The TLS keys have no quick parser on purpose: their files must be checked and paired, which
# the pydantic model does, so a service given TLS settings takes the full path.
SERVER_PARSERS: dict[str, ValueParser] = {
    "server.listen": _listen_address,
    "server.grace_period_s": float_above(0, inclusive=True),
    "server.max_concurrent_rpcs": int_at_least(1),
    "server.max_message_bytes": int_at_least(1024),
    "server.metrics_address": _metrics_address,
    "server.unix_socket_mode": _octal_mode,
    "server.log_level": _log_level,
}
"""Quick parsers of the ``server`` section, by dotted key."""

SERVER_LIST_KEYS = frozenset({"server.listen"})


def quick_values(
    settings: Sequence[RawSetting],
    parsers: Mapping[str, ValueParser],
    list_keys: frozenset[str] = frozenset(),
) -> dict[str, Any] | None:
    """``{dotted key: value}`` from ``settings`` (later ones win), or None if any is unusual.

    Unusual: a key without a parser, JSON (``[``/``{``), a value a parser rejects, an empty list.
    A list key takes a repeated flag's values or one comma-separated string.
    """
    values: dict[str, Any] = {}
    for setting in settings:
        parse = parsers.get(setting.key)
        if parse is None:
            return None
        items = [setting.value] if isinstance(setting.value, str) else setting.value
        if any(item.strip()[:1] in ("[", "{") for item in items):
            return None
        try:
            if setting.key in list_keys:
                if isinstance(setting.value, str):
                    items = [part.strip() for part in setting.value.split(",") if part.strip()]
                if not items:
                    return None
                values[setting.key] = [parse(item) for item in items]
            elif isinstance(setting.value, str):
                values[setting.key] = parse(setting.value)
            else:
                return None
        except (ValueError, LookupError):
            return None
    return values


def section(values: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The ``name.*`` entries of :func:`quick_values`' result, keyed by field name."""
    prefix = name + "."
    return {key[len(prefix) :]: value for key, value in values.items() if key.startswith(prefix)}
