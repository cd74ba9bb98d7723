"""Configuration layering and error messages that name the key and its source."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import Field

from orchard.core.config import (
    ConfigError,
    ConfigFlag,
    ConfigModel,
    PlainServerConfig,
    ServerConfig,
    ServiceConfig,
    add_config_arguments,
    config_from_args,
    load_config,
)


class Limits(ConfigModel):
    max_output_bytes: int = Field(default=1024, gt=0, description="Cap on captured output.")
    tags: list[str] = Field(default_factory=list, description="Free-form labels.")


class ToyConfig(ServiceConfig):
    server: ServerConfig = ServerConfig(listen=["127.0.0.1:7000"])
    limits: Limits = Field(default_factory=Limits, description="Resource limits.")
    name: str = Field(default="toy", description="Display name.")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "toy.yaml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    config = load_config(ToyConfig, env={})
    assert config.server.listen == ["127.0.0.1:7000"]
    assert config.server.grace_period_s == 10.0
    assert config.server.max_concurrent_rpcs > 1000
    assert config.server.metrics_address is None
    assert config.limits.max_output_bytes == 1024


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "name: from-file\n"
        "limits: {max_output_bytes: 10, tags: [a]}\n"
        "server: {grace_period_s: 1, log_level: warning}\n",
    )
    env = {
        "ORCHARD_LIMITS__MAX_OUTPUT_BYTES": "20",
        "ORCHARD_SERVER__GRACE_PERIOD_S": "2",
        "ORCHARD_NAME": "from-env",
    }
    argv = ["--config", str(path), "--set", "server.grace_period_s=3", "--set", "name=from-set"]
    config = load_config(ToyConfig, argv=argv, env=env)
    assert config.name == "from-set"  # --set beats env beats file
    assert config.server.grace_period_s == 3.0
    assert config.limits.max_output_bytes == 20  # env beats file
    assert config.limits.tags == ["a"]  # file beats default; siblings merge
    assert config.server.log_level == "WARNING"  # file, normalized
    assert config.server.listen == ["127.0.0.1:7000"]  # default kept

    typed = load_config(ToyConfig, argv=[*argv, "--grace-period-s", "4"], env=env)
    assert typed.server.grace_period_s == 4.0  # typed flags win over --set


def test_config_file_from_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "name: via-env-file\n")
    assert load_config(ToyConfig, env={"ORCHARD_CONFIG": str(path)}).name == "via-env-file"
    assert load_config(ToyConfig, env={}, yaml_path=path).name == "via-env-file"


def test_lists_from_env_flags_and_json() -> None:
    env = {"ORCHARD_SERVER__LISTEN": "127.0.0.1:0, unix:/run/a.sock"}
    assert load_config(ToyConfig, env=env).server.listen == ["127.0.0.1:0", "unix:/run/a.sock"]
    flags = ["--listen", "[::]:50051", "--listen", "unix:///run/b.sock"]
    assert load_config(ToyConfig, argv=flags, env={}).server.listen == [
        "[::]:50051",
        "unix:/run/b.sock",
    ]
    as_json = load_config(ToyConfig, argv=["--set", 'limits.tags=["x", "y"]'], env={})
    assert as_json.limits.tags == ["x", "y"]


def test_metrics_address_and_disable() -> None:
    on = load_config(ToyConfig, argv=["--metrics-address", "0.0.0.0:0"], env={})
    assert on.server.metrics_address == "0.0.0.0:0"
    env = {"ORCHARD_SERVER__METRICS_ADDRESS": "127.0.0.1:9100"}
    off = load_config(ToyConfig, argv=["--metrics-address", "off"], env=env)
    assert off.server.metrics_address is None


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (
            [],
            {"ORCHARD_SERVER__GRACE_PERIOD_S": "abc"},
            "server.grace_period_s: Input should be a valid number, unable to parse string as"
            " a number, got 'abc' (from ORCHARD_SERVER__GRACE_PERIOD_S)",
        ),
        (
            ["--set", "server.grace_perod_s=1"],
            {},
            "server.grace_perod_s: unknown key; did you mean 'grace_period_s'?"
            " (from --set server.grace_perod_s=1)",
        ),
        ([], {"ORCHARD_COLOUR": "red"}, "colour: unknown key (from ORCHARD_COLOUR)"),
        (
            ["--listen", "localhost"],
            {},
            "server.listen: 'localhost': expected HOST:PORT, [IPv6]:PORT or unix:PATH",
        ),
        (
            ["--log-level", "loud"],
            {},
            "server.log_level: Input should be 'DEBUG', 'INFO', 'WARNING', 'ERROR' or"
            " 'CRITICAL', got 'LOUD' (from --log-level)",
        ),
        (["--set", "limits.max_output_bytes=0"], {}, "limits.max_output_bytes: Input should"),
        (["--set", "novalue"], {}, "--set 'novalue': expected KEY=VALUE"),
        (["--bogus"], {}, "command line: unrecognized arguments: --bogus"),
        ([], {"ORCHARD_SERVER____X": "1"}, "ORCHARD_SERVER____X: empty key part"),
    ],
)
def test_errors_name_the_key_and_source(
    argv: list[str], env: dict[str, str], expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(ToyConfig, argv=argv, env=env)
    assert expected in str(caught.value)


def test_file_errors(tmp_path: Path) -> None:
    bad_key = write(tmp_path, "server:\n  grace_period_s: 1\n  listne: []\n")
    with pytest.raises(ConfigError, match=r"server\.listne: unknown key; did you mean 'listen'\?"):
        load_config(ToyConfig, yaml_path=bad_key, env={})
    with pytest.raises(ConfigError, match=f"from config file {bad_key}"):
        load_config(ToyConfig, yaml_path=bad_key, env={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(ToyConfig, yaml_path=write(tmp_path, "server: [\n"), env={})
    with pytest.raises(ConfigError, match="mapping of keys"):
        load_config(ToyConfig, yaml_path=write(tmp_path, "- 1\n"), env={})
    with pytest.raises(ConfigError, match="No such file"):
        load_config(ToyConfig, yaml_path=tmp_path / "absent.yaml", env={})


def test_several_problems_reported_at_once() -> None:
    env = {"ORCHARD_SERVER__GRACE_PERIOD_S": "-1", "ORCHARD_NAMEE": "x"}
    with pytest.raises(ConfigError) as caught:
        load_config(ToyConfig, env=env)
    assert len(caught.value.problems) == 2


def test_models_are_frozen() -> None:
    config = load_config(ToyConfig, env={})
    with pytest.raises(ValueError, match="frozen"):
        config.name = "changed"


def test_argparse_integration_with_service_flags() -> None:
    parser = argparse.ArgumentParser(prog="orchard-toy")
    parser.add_argument("--verbose", action="store_true")
    output_flag = ConfigFlag("--max-output-bytes", "limits.max_output_bytes", "output cap")
    add_config_arguments(parser, [output_flag])
    args = parser.parse_args(["--verbose", "--max-output-bytes", "99", "--set", "name=n"])
    config = config_from_args(ToyConfig, args, env={})
    assert args.verbose
    assert (config.limits.max_output_bytes, config.name) == (99, "n")
    with pytest.raises(ConfigError, match=r"limits\.max_output_bytes: .* \(from --max-output"):
        config_from_args(ToyConfig, parser.parse_args(["--max-output-bytes", "x"]), env={})


def test_unix_socket_mode_octal_string() -> None:
    config = load_config(ToyConfig, argv=["--set", "server.unix_socket_mode=0600"], env={})
    assert config.server.unix_socket_mode == 0o600


def test_plain_server_config_matches_the_model() -> None:
    assert PlainServerConfig.from_values(ServerConfig().model_dump()) == PlainServerConfig()


def test_unknown_section_given_by_nested_env_names_the_variable() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(ToyConfig, env={"ORCHARD_SERVR__GRACE_PERIOD_S": "1"})
    assert "servr: unknown key; did you mean 'server'? (from ORCHARD_SERVR__GRACE_PERIOD_S)" in str(
        caught.value
    )
