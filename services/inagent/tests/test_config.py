"""The agent's quick configuration path agrees with the full pydantic validation."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from orchard.core.config import ConfigError, ServerConfig, add_config_arguments, config_from_args
from orchard.core.config_sources import PlainServerConfig
from orchard.inagent.config import AGENT_FLAGS, AgentConfig, load_agent_config
from orchard.inagent.config_model import AgentConfigModel

PREFIX = "ORCHARD_INAGENT_"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, AGENT_FLAGS)
    return parser.parse_args(argv)


def full(argv: list[str], env: dict[str, str]) -> AgentConfig:
    return config_from_args(AgentConfigModel, parse(argv), env=env, env_prefix=PREFIX).to_config()


def test_plain_defaults_match_the_models() -> None:
    assert PlainServerConfig.from_values(ServerConfig().model_dump()) == PlainServerConfig()
    assert AgentConfigModel().to_config() == AgentConfig()


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        ([], {}),
        (["--listen", "unix:/run/a.sock", "--listen", "127.0.0.1:0", "--working-dir", "/w"], {}),
        (["--grace-period-s", "0", "--default-timeout-s", "2.5", "--reap-orphans", "true"], {}),
        (["--metrics-address", "off", "--log-level", "debug", "--address-file", "/a"], {}),
        (["--metrics-address", "127.0.0.1:0"], {"ORCHARD_INAGENT_SERVER__LISTEN": "a:1, unix:/b"}),
        (["--set", "server.unix_socket_mode=0600", "--set", "shell=/bin/bash"], {}),
        ([], {"ORCHARD_INAGENT_INHERIT_ENV": "no", "ORCHARD_INAGENT_REAP_ORPHANS": "0"}),
        ([], {"ORCHARD_INAGENT_DEFAULT_OUTPUT_LIMIT_BYTES": "1024", "ORCHARD_OTHER_X": "1"}),
        (["--set", "max_output_limit_bytes=4096", "--set", "default_output_limit_bytes=9"], {}),
        (["--set", "server.max_concurrent_rpcs=5", "--grace-period-s", "3"], {}),
    ],
)
def test_quick_path_agrees_with_the_model(argv: list[str], env: dict[str, str]) -> None:
    assert load_agent_config(parse(argv), env, PREFIX) == full(argv, env)


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--set", 'env={"PATH": "/bin"}'], {}),  # maps go through pydantic
        ([], {"ORCHARD_INAGENT_ENV__PATH": "/bin"}),
        (["--set", 'server.listen=["unix:/a.sock"]'], {}),
        (["--grace-period-s", "1e1"], {}),  # spellings only pydantic reads
        (["--default-timeout-s", " 5"], {}),
        (["--reap-orphans", "On"], {}),
        (["--set", "server.max_concurrent_rpcs=010"], {}),
    ],
)
def test_unusual_values_take_the_full_path(argv: list[str], env: dict[str, str]) -> None:
    assert load_agent_config(parse(argv), env, PREFIX) == full(argv, env)


@pytest.mark.parametrize(
    ("argv", "env", "words"),
    [
        (["--default-timeout-s", "0"], {}, "default_timeout_s: Input should be greater than 0"),
        (["--listen", "nowhere"], {}, "server.listen: 'nowhere': expected HOST:PORT"),
        (["--log-level", "loud"], {}, "server.log_level: Input should be 'DEBUG'"),
        ([], {"ORCHARD_INAGENT_SHEL": "/bin/sh"}, "shel: unknown key; did you mean 'shell'?"),
        (["--set", "max_output_limit_bytes=67108864"], {}, "an Exec response could reach"),
        (["--set", "default_output_limit_bytes=9999999999"], {}, "must not exceed"),
        (["--set", 'env={"A=B": "c"}'], {}, "bad name or NUL"),
        (["--metrics-address", "unix:/m.sock"], {}, "metrics are served over TCP"),
        (["--set", "server.listen=[]"], {}, "server.listen: List should have at least 1 item"),
    ],
)
def test_errors_come_from_the_model(argv: list[str], env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("?", r"\?").replace("(", r"\(")):
        load_agent_config(parse(argv), env, PREFIX)


def test_a_plain_start_does_not_import_pydantic() -> None:
    code = (
        "import sys, argparse\n"
        "from orchard.core.config_sources import add_config_arguments\n"
        "from orchard.inagent.config import AGENT_FLAGS, load_agent_config\n"
        "import orchard.inagent.main\n"
        "parser = argparse.ArgumentParser()\n"
        "add_config_arguments(parser, AGENT_FLAGS)\n"
        "args = parser.parse_args(['--listen', 'unix:/run/a.sock', '--working-dir', '/w'])\n"
        "load_agent_config(args, {}, 'ORCHARD_INAGENT_')\n"
        "assert 'pydantic' not in sys.modules, 'pydantic imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
