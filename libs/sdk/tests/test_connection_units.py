"""Connection resolution (arguments, environment, profile), units, and the retry policy."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import pytest

from orchard.sdk import ConfigurationError, RetryPolicy
from orchard.sdk.connection import Profile, resolve_connection, write_profile
from orchard.sdk.units import parse_duration, parse_size


def test_precedence(isolated_env: Path) -> None:
    profile = write_profile(Profile(endpoint="127.0.0.1:7100", token="local-token"))
    assert profile == isolated_env / "profile.json"
    from_profile = resolve_connection(environ={"ORCHARD_STATE_DIR": str(isolated_env)})
    assert (from_profile.endpoint, from_profile.token) == ("127.0.0.1:7100", "local-token")
    assert from_profile.from_local_profile
    environ = {"ORCHARD_STATE_DIR": str(isolated_env), "ORCHARD_ENDPOINT": "http://10.0.0.1:80"}
    from_env = resolve_connection(environ=environ)
    # The local token never goes to another endpoint.
    assert (from_env.endpoint, from_env.token) == ("10.0.0.1:80", None)
    environ["ORCHARD_ENDPOINT"] = "127.0.0.1:7100"
    assert resolve_connection(environ=environ).token == "local-token"
    explicit = resolve_connection("unix:/run/env.sock", "t", environ=environ)
    assert (explicit.endpoint, explicit.token, explicit.source) == (
        "unix:/run/env.sock",
        "t",
        "argument",
    )


def test_nothing_configured_or_bad(isolated_env: Path) -> None:
    environ = {"ORCHARD_STATE_DIR": str(isolated_env)}
    with pytest.raises(ConfigurationError, match="orchard up"):
        resolve_connection(environ=environ)
    with pytest.raises(ConfigurationError, match="no port"):
        resolve_connection("localhost", environ=environ)
    isolated_env.mkdir(parents=True)
    (isolated_env / "profile.json").write_text("{not json")
    with pytest.raises(ConfigurationError, match="cannot read"):
        resolve_connection(environ=environ)


def test_units() -> None:
    assert parse_size("512M") == parse_size("512Mi") == 512 << 20
    assert parse_size("1.5G") == 3 << 29 and parse_size(42) == 42
    assert parse_duration("1h30m") == 5400 and parse_duration("250ms") == 0.25
    assert parse_duration("10") == 10
    for bad in ("lots", "5 parsecs", ""):
        with pytest.raises(ValueError):
            parse_size(bad) if bad != "" else parse_duration(bad)


def test_retry_policy_full_jitter() -> None:
    policy = RetryPolicy(max_attempts=4, initial_backoff=0.1, max_backoff=0.3)
    rng = random.Random(0)
    sleeps = [[policy.backoff(attempt, rng) for _ in range(200)] for attempt in range(4)]
    assert [round(max(s), 1) for s in sleeps] == [0.1, 0.2, 0.3, 0.3]
    assert all(min(s) < 0.02 for s in sleeps)  # full jitter reaches down to zero
    assert policy.should_retry(grpc.StatusCode.UNAVAILABLE, 2)
    assert not policy.should_retry(grpc.StatusCode.UNAVAILABLE, 3)
    assert not policy.should_retry(grpc.StatusCode.RESOURCE_EXHAUSTED, 0)
    assert not policy.should_retry(grpc.StatusCode.DEADLINE_EXCEEDED, 0)
