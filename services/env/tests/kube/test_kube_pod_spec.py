"""The sandbox Pod and NetworkPolicy manifests, field by field, and how Pod statuses read."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from orchard.env.runtime.base import (
    EgressRule,
    FailureReason,
    RuntimeNotSupported,
    RuntimeResources,
    RuntimeSandboxSpec,
)
from orchard.env.runtime.kubernetes.config import KubernetesRuntimeConfig
from orchard.env.runtime.kubernetes.pods import PodView, label_value, pod_manifest
from orchard.env.runtime.kubernetes.policies import policy_manifest, rules_from_policy

CONFIG = KubernetesRuntimeConfig(
    namespace="sandboxes",
    inagent_image="ghcr.io/orchard-dev/orchard-inagent:0.1.0",
    deployment="env-a",
    node_selector={"pool": "spot"},
    tolerations=[{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],  # type: ignore[list-item]
    priority_class_name="sandbox-low",
    shell_images=["python:*"],
    termination_grace_s=3,
)


def spec(image: str = "ubuntu:24.04", **fields: Any) -> RuntimeSandboxSpec:
    values: dict[str, Any] = {
        "sandbox_id": "sbx-0123456789ab",
        "image": image,
        "resources": RuntimeResources(cpu_millis=1500, memory_bytes=2 << 30, disk_bytes=10 << 30),
        "env": {"TASK": "t1", "ORCHARD_TRACE": "1"},
        "working_dir": "work/../srv",
        "labels": {"task": "t1"},
    }
    values.update(fields)
    return RuntimeSandboxSpec(**values)


def test_pod_manifest_snapshot() -> None:
    assert pod_manifest(spec(), CONFIG) == {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "sbx-0123456789ab",
            "namespace": "sandboxes",
            "labels": {
                "app.kubernetes.io/managed-by": "orchard-env",
                "orchard.dev/deployment": "env-a",
                "orchard.dev/sandbox-id": "sbx-0123456789ab",
            },
            "annotations": {"orchard.dev/labels": '{"task": "t1"}'},
        },
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 3,
            "volumes": [{"name": "orchard-inagent", "emptyDir": {}}],
            "initContainers": [
                {
                    "name": "inagent-copy",
                    "image": "ghcr.io/orchard-dev/orchard-inagent:0.1.0",
                    "command": ["cp", "-R", "/opt/orchard-inagent/.", "/.orchard/inagent/"],
                    "volumeMounts": [{"name": "orchard-inagent", "mountPath": "/.orchard/inagent"}],
                    "resources": {
                        "requests": {"cpu": "10m", "memory": "16Mi"},
                        "limits": {"memory": "64Mi"},
                    },
                }
            ],
            "containers": [
                {
                    "name": "sandbox",
                    "image": "ubuntu:24.04",
                    "command": ["/.orchard/inagent/orchard-inagent"],
                    "args": [
                        "--listen",
                        "$(ORCHARD_POD_IP):7070",
                        "--working-dir",
                        "/srv",
                        "--set",
                        "require_credential=true",
                    ],
                    "env": [
                        {
                            "name": "ORCHARD_POD_IP",
                            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                        },
                        {
                            "name": "ORCHARD_AGENT_KEY",
                            "valueFrom": {
                                "secretKeyRef": {
                                    "name": "sbx-0123456789ab-agent-key",
                                    "key": "agent-key",
                                }
                            },
                        },
                        {"name": "ORCHARD_AGENT_SANDBOX_ID", "value": "sbx-0123456789ab"},
                        {
                            "name": "ORCHARD_INAGENT_ENV",
                            "valueFrom": {
                                "secretKeyRef": {
                                    "name": "sbx-0123456789ab-agent-key",
                                    "key": "agent-env",
                                }
                            },
                        },
                        {
                            "name": "TASK",
                            "valueFrom": {
                                "secretKeyRef": {
                                    "name": "sbx-0123456789ab-agent-key",
                                    "key": "env-0",
                                }
                            },
                        },
                    ],
                    "workingDir": "/srv",
                    "ports": [{"name": "inagent", "containerPort": 7070, "protocol": "TCP"}],
                    "volumeMounts": [
                        {
                            "name": "orchard-inagent",
                            "mountPath": "/.orchard/inagent",
                            "readOnly": True,
                        }
                    ],
                    "readinessProbe": {
                        "grpc": {"port": 7070},
                        "periodSeconds": 1,
                        "timeoutSeconds": 1,
                        "failureThreshold": 3,
                    },
                    "resources": {
                        "requests": {
                            "cpu": "1500m",
                            "memory": str(2 << 30),
                            "ephemeral-storage": str(10 << 30),
                        },
                        "limits": {
                            "cpu": "1500m",
                            "memory": str(2 << 30),
                            "ephemeral-storage": str(10 << 30),
                        },
                    },
                    "securityContext": {
                        "capabilities": {"drop": ["NET_RAW", "SYS_PTRACE"]},
                        "seccompProfile": {"type": "RuntimeDefault"},
                        "allowPrivilegeEscalation": False,
                    },
                }
            ],
            "nodeSelector": {"pool": "spot"},
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "sandbox-low",
        },
    }


def test_shell_images_start_the_agent_through_sh() -> None:
    container = pod_manifest(spec("python:3.12-slim"), CONFIG)["spec"]["containers"][0]
    assert container["command"][:2] == ["/bin/sh", "-c"]
    assert 'exec /.orchard/inagent/orchard-inagent "$@"' in container["command"][2]
    assert container["args"][:2] == ["--listen", "$(ORCHARD_POD_IP):7070"]
    # A spec without resources and a default config: no quantities, no scheduling fields.
    plain = KubernetesRuntimeConfig(inagent_image="i:1")
    manifest = pod_manifest(spec(resources=RuntimeResources(), env={}), plain)
    assert manifest["spec"]["containers"][0]["resources"] == {}
    assert manifest["spec"]["containers"][0]["command"] == ["/.orchard/inagent/orchard-inagent"]
    for key in ("nodeSelector", "tolerations", "priorityClassName"):
        assert key not in manifest["spec"]


def test_bad_ids_and_config_are_refused() -> None:
    with pytest.raises(ValueError, match="DNS label"):
        pod_manifest(spec(sandbox_id="Not_A_Label"), CONFIG)
    with pytest.raises(ValueError, match="tolerations"):
        KubernetesRuntimeConfig(inagent_image="i:1", tolerations=[{"effect": "Sometimes"}])  # type: ignore[list-item]


def test_the_pod_carries_the_sandbox_owner() -> None:
    plain = pod_manifest(spec(), CONFIG)["metadata"]
    assert "orchard.dev/owner" not in plain["labels"]
    assert "orchard.dev/owner-id" not in plain["annotations"]
    owned = pod_manifest(spec(owner="own-0123456789ab"), CONFIG)["metadata"]
    assert owned["labels"]["orchard.dev/owner"] == "own-0123456789ab"
    assert owned["labels"]["orchard.dev/deployment"] == "env-a"
    assert owned["annotations"]["orchard.dev/owner-id"] == "own-0123456789ab"
    odd = pod_manifest(spec(owner="team a/run#7"), CONFIG)["metadata"]
    assert odd["labels"]["orchard.dev/owner"] == label_value("team a/run#7")
    assert odd["annotations"]["orchard.dev/owner-id"] == "team a/run#7"


_VALID_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


@pytest.mark.parametrize(
    "owner",
    ["team a/run#7", "-leading", "trailing.", "x" * 200, "__", "ünïcode", "a" * 62 + "/b"],
)
def test_owner_label_values_are_valid_and_distinct(owner: str) -> None:
    value = label_value(owner)
    assert _VALID_LABEL_VALUE.fullmatch(value) and 0 < len(value) <= 63, value
    assert value != label_value(owner + "!"), "different ids keep different labels"


def test_valid_owner_ids_are_kept_as_they_are() -> None:
    for owner in ("own-0123456789ab", "A.b_c-9", "x" * 63):
        assert label_value(owner) == owner


async def test_policy_manifest_and_its_expiry() -> None:
    rules = [
        EgressRule("10.0.0.0/8", ports=(443,), protocol="tcp"),
        EgressRule("192.168.1.7", expire_unix_s=1000.0),
        EgressRule("localhost", ports=(80,)),
    ]
    policy = await policy_manifest(CONFIG, "sbx-1", rules, now=500.0)
    assert policy is not None
    assert policy["metadata"]["name"] == "sbx-1-egress"
    assert policy["spec"]["podSelector"] == {"matchLabels": {"orchard.dev/sandbox-id": "sbx-1"}}
    assert policy["spec"]["policyTypes"] == ["Egress"]
    egress = policy["spec"]["egress"]
    assert egress[0] == {
        "to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
        "ports": [{"protocol": "TCP", "port": 443}],
    }
    assert egress[1] == {"to": [{"ipBlock": {"cidr": "192.168.1.7/32"}}]}
    assert {"ipBlock": {"cidr": "127.0.0.1/32"}} in egress[2]["to"]
    assert egress[2]["ports"] == [{"protocol": "TCP", "port": 80}, {"protocol": "UDP", "port": 80}]
    assert egress[3]["ports"][0] == {"protocol": "UDP", "port": 53}  # a name: DNS allowed
    assert rules_from_policy(policy) == rules
    later = await policy_manifest(CONFIG, "sbx-1", rules, now=2000.0)
    assert later is not None and len(later["spec"]["egress"]) == 3  # the expired rule left
    assert await policy_manifest(CONFIG, "sbx-1", rules[1:2], now=2000.0) is None
    assert json.loads(policy["metadata"]["annotations"]["orchard.dev/egress"])[1]["expire_unix_s"]


def _status(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "resourceVersion": "5"}, "status": status}


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (
            {"phase": "Failed", "reason": "Evicted", "message": "low on memory"},
            FailureReason.EVICTED,
        ),
        (
            {
                "phase": "Failed",
                "conditions": [
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "reason": "PreemptionByScheduler",
                    }
                ],
            },
            FailureReason.PREEMPTED,
        ),
        (
            {
                "containerStatuses": [
                    {
                        "name": "sandbox",
                        "image": "x:1",
                        "state": {"waiting": {"reason": "ImagePullBackOff"}},
                    }
                ]
            },
            FailureReason.IMAGE_NOT_FOUND,
        ),
        (
            {
                "phase": "Failed",
                "containerStatuses": [
                    {
                        "name": "sandbox",
                        "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
                    }
                ],
            },
            FailureReason.OUT_OF_MEMORY,
        ),
        (
            {
                "phase": "Failed",
                "containerStatuses": [
                    {"name": "sandbox", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}
                ],
            },
            FailureReason.AGENT_EXITED,
        ),
    ],
)
def test_pod_status_reasons(status: dict[str, Any], reason: FailureReason) -> None:
    view = PodView.of(_status(**status))
    assert view.failure is not None and view.failure.reason is reason
    assert not view.running


def test_a_starting_pod_is_no_failure() -> None:
    view = PodView.of(
        _status(
            phase="Pending",
            conditions=[
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available",
                }
            ],
        )
    )
    assert view.failure is None and view.running and not view.ready
    assert "Unschedulable" in view.waiting_for


def test_privileges_map_to_the_security_context() -> None:
    raw = pod_manifest(spec(raw_sockets=True), CONFIG)["spec"]["containers"][0]
    assert raw["securityContext"]["capabilities"] == {
        "add": ["NET_RAW"],
        "drop": ["SYS_PTRACE"],
    }
    with pytest.raises(RuntimeNotSupported, match="user namespaces"):
        pod_manifest(spec(user_namespaces=True), CONFIG)


def test_env_values_are_in_the_sandboxs_secret_not_the_pod() -> None:
    import base64

    from orchard.env.runtime.kubernetes.pods import key_secret_manifest

    env = {"API TOKEN": "s3cr$(ORCHARD_POD_IP)et", "ORCHARD_TRACE": "1", "A": "x"}
    pod = json.dumps(pod_manifest(spec(env=env), CONFIG))
    assert "s3cr" not in pod and "ORCHARD_TRACE" not in pod
    secret = key_secret_manifest(CONFIG, "sbx-0123456789ab", "k", env=env)
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    # Sorted names, one field each (a name need not be a valid Secret key); ORCHARD_* as JSON.
    assert data == {
        "agent-key": "k",
        "env-0": "x",
        "env-1": "s3cr$(ORCHARD_POD_IP)et",
        "agent-env": '{"ORCHARD_TRACE": "1"}',
    }
