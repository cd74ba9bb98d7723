"""tools/charts.py: a service's rendered config file is checked against the service's own
configuration model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _load_charts() -> Any:
    spec = importlib.util.spec_from_file_location("orchard_charts", ROOT / "tools" / "charts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


charts = _load_charts()


def rendered(service: str, config: dict[str, Any], port: int = 7200) -> list[dict[str, Any]]:
    """A Deployment and its ConfigMap as the service charts render them."""
    name = f"orchard-{service}"
    container = {
        "name": service,
        "env": [{"name": f"ORCHARD_{service.upper()}_CONFIG", "value": "/etc/orchard/config.yaml"}],
        "ports": [
            {"name": "grpc", "containerPort": port},
            {"name": "metrics", "containerPort": port + 2000},
        ],
    }
    return [
        {
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": "orchard"},
            "spec": {"template": {"spec": {"containers": [container]}}},
        },
        {
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "orchard"},
            "data": {"config.yaml": yaml.safe_dump(config)},
        },
    ]


SERVER = {"listen": ["0.0.0.0:7200"], "metrics_address": "0.0.0.0:9200"}


def failures(docs: list[dict[str, Any]]) -> list[str]:
    report = charts.Report()
    charts.check_service_configs(docs, report, "case")
    return list(report.failures)


def test_the_reward_model_accepts_what_the_chart_writes() -> None:
    assert failures(rendered("reward", {"server": SERVER, "env": {"endpoint": "env:7100"}})) == []


def test_a_key_the_reward_model_lacks_is_caught() -> None:
    found = failures(
        rendered("reward", {"server": SERVER, "etcd": {"endpoints": ["http://e:2379"]}})
    )
    assert len(found) == 1 and "RewardConfig refuses the chart's config" in found[0], found
    assert "etcd" in found[0]


def test_a_bad_value_and_a_port_mismatch_are_caught() -> None:
    found = failures(
        rendered("reward", {"server": {"listen": ["0.0.0.0:7201"]}, "default_judge": "absent"})
    )
    assert any("must be the container's grpc and metrics ports" in f for f in found), found
    assert any("default_judge 'absent' is not in judges" in f for f in found), found


def test_the_rollout_model_checks_all_of_the_rollout_config() -> None:
    server = {"listen": ["0.0.0.0:7300"], "metrics_address": "0.0.0.0:9300"}
    assert failures(rendered("rollout", {"server": server}, port=7300)) == []
    found = failures(rendered("rollout", {"server": server, "anything": 1}, port=7300))
    assert len(found) == 1 and "RolloutConfig refuses the chart's config" in found[0], found


def test_a_service_without_a_model_has_its_server_section_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every service has a model now; a new service may not yet: its module does not exist.
    monkeypatch.setitem(charts.CONFIG_MODELS, "rollout", ("orchard.unmodelled.config", "Config"))
    monkeypatch.setattr(charts, "UNMODELLED", set())
    assert charts.config_model("rollout") is None
    server = {"listen": ["0.0.0.0:7300"], "metrics_address": "0.0.0.0:9300"}
    # Only the server section can be checked: other keys pass unseen.
    assert failures(rendered("rollout", {"server": server, "anything": 1}, port=7300)) == []
    found = failures(rendered("rollout", {"server": {**server, "no_such_key": 1}}, port=7300))
    assert len(found) == 1 and "ServerConfig (server section) refuses" in found[0], found
