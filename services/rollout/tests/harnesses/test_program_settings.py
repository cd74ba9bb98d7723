"""Program harness settings without sandboxes: placeholders, configuration, the registry, what
ListHarnesses says, and the refusal of an endpoint a sandbox cannot reach."""

from __future__ import annotations

import json
import tomllib

import pytest
import yaml

from orchard.rollout.budgets import InfrastructureError
from orchard.rollout.config import HarnessesConfig
from orchard.rollout.harnesses.builtin_programs import BUILTIN_PROGRAMS, program_harness
from orchard.rollout.harnesses.program_registry import program_harnesses
from orchard.rollout.harnesses.sandboxed import HarnessCache, allow_endpoint, fill
from orchard.rollout.service import harness_proto

VALUES = {
    "base_url": "http://10.0.0.1:8000/rollouts/r1/v1",
    "anthropic_base_url": "http://10.0.0.1:8000/rollouts/r1",
    "api_key": "k",
    "model": "policy",
    "home": "/home/a",
    "max_tokens": "512",
}


def test_fill_replaces_known_placeholders_and_leaves_other_braces() -> None:
    assert fill('{"a": {model}, "b": {other}}', VALUES) == '{"a": policy, "b": {other}}'


def test_builtin_configuration_files_parse_once_filled() -> None:
    cache = HarnessCache("/cache")
    openclaw = json.loads(fill(program_harness("program:openclaw", cache).files[0].content, VALUES))
    provider = openclaw["models"]["providers"]["local"]
    assert (provider["baseUrl"], provider["models"][0]["maxTokens"]) == (VALUES["base_url"], 512)
    assert openclaw["agents"]["defaults"]["model"]["primary"] == "local/policy"
    codex = tomllib.loads(fill(program_harness("program:codex", cache).files[0].content, VALUES))
    assert codex["model_providers"]["local"]["wire_api"] == "responses"
    hermes = yaml.safe_load(fill(program_harness("program:hermes", cache).files[0].content, VALUES))
    assert hermes["model"]["base_url"] == VALUES["base_url"]
    claude = program_harness("program:claude-code", cache)
    assert fill(claude.env["ANTHROPIC_BASE_URL"], VALUES) == VALUES["anthropic_base_url"]


def test_configuration_offers_builtin_and_configured_programs() -> None:
    config = HarnessesConfig.model_validate(
        {
            "cache_dir": "/cache",
            "builtin": ["program:openclaw"],
            "wall_clock_s": 30,
            "programs": {
                "program:echo": {
                    "program": "node",
                    "command": ["node", "-e", "console.log('{instruction}')"],
                    "env": {"X": "{model}"},
                    "files": [{"path": "{home}/c.json", "content": "{}"}],
                }
            },
        }
    )
    harnesses = program_harnesses(config)
    assert sorted(harnesses) == ["program:echo", "program:openclaw"]
    assert harnesses["program:echo"].wall_clock_s == 30
    assert harness_proto(harnesses["program:openclaw"]).name == "program:openclaw"
    with pytest.raises(ValueError, match="unknown built-in"):
        HarnessesConfig.model_validate({"builtin": ["program:nope"]})
    with pytest.raises(ValueError, match="environment variable name"):
        HarnessesConfig.model_validate(
            {"programs": {"p": {"program": "x", "command": ["x"], "env": {"1A": "v"}}}}
        )
    assert set(BUILTIN_PROGRAMS) == {
        "program:openclaw", "program:claude-code", "program:codex", "program:hermes"
    }  # fmt: skip


async def test_a_loopback_endpoint_is_refused_with_advice() -> None:
    with pytest.raises(InfrastructureError, match=r"proxy\.host"):
        await allow_endpoint(None, "http://127.0.0.1:8000/v1", 60)  # type: ignore[arg-type]
