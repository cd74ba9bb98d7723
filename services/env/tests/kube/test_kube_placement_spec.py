"""Image locality and pre-pull manifests field by field, how node image names normalize, and
how a pre-pull Pod's status reads (pure functions, no API server)."""

from __future__ import annotations

from typing import Any

import pytest

from orchard.env.runtime.base import RuntimeSandboxSpec
from orchard.env.runtime.kubernetes.config import KubernetesRuntimeConfig
from orchard.env.runtime.kubernetes.node_images import image_keys
from orchard.env.runtime.kubernetes.pods import pod_manifest
from orchard.env.runtime.kubernetes.prepull import prepull_pod_manifest, pull_states

CONFIG = KubernetesRuntimeConfig(
    namespace="sandboxes",
    inagent_image="ghcr.io/orchard-dev/orchard-inagent:0.1.0",
    deployment="env-a",
    tolerations=[{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],  # type: ignore[list-item]
    priority_class_name="sandbox-low",
    image_locality_weight=70,
    image_locality_max_nodes=2,
)


@pytest.mark.parametrize(
    ("reference", "keys"),
    [
        ("python:3.12", {"docker.io/library/python:3.12"}),
        ("python", {"docker.io/library/python:latest"}),
        ("docker.io/library/python:3.12", {"docker.io/library/python:3.12"}),
        ("index.docker.io/acme/task:7", {"docker.io/acme/task:7"}),
        ("acme/task:7", {"docker.io/acme/task:7"}),
        ("ghcr.io/acme/task", {"ghcr.io/acme/task:latest"}),
        ("localhost:5000/task:1", {"localhost:5000/task:1"}),
        ("registry:5000/task", {"registry:5000/task:latest"}),
        ("ghcr.io/acme/task@sha256:ab", {"ghcr.io/acme/task@sha256:ab"}),
        (
            "ghcr.io/acme/task:7@sha256:ab",
            {"ghcr.io/acme/task@sha256:ab", "ghcr.io/acme/task:7"},
        ),
    ],
)
def test_image_names_normalize_as_container_runtimes_do(reference: str, keys: set[str]) -> None:
    assert image_keys(reference) == keys


def test_the_sandbox_pod_prefers_at_most_max_nodes_never_requires() -> None:
    spec = RuntimeSandboxSpec(sandbox_id="sbx-1", image="python:3.12")
    pod = pod_manifest(spec, CONFIG, ["n3", "n1", "n2"])
    assert pod["spec"]["affinity"] == {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 70,
                    "preference": {
                        "matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": ["n1", "n2"]}
                        ]
                    },
                }
            ]
        }
    }
    assert "affinity" not in pod_manifest(spec, CONFIG)["spec"]
    off = CONFIG.model_copy(update={"image_locality_weight": 0})
    assert "affinity" not in pod_manifest(spec, off, ["n1"])["spec"]


def test_the_prepull_pod_is_pinned_and_runs_a_no_op_from_the_agent() -> None:
    pod = prepull_pod_manifest(CONFIG, "run1", 3, "gpu-7", ["python:3.12", "ghcr.io/a/b:1"])
    spec = pod["spec"]
    assert pod["metadata"]["name"] == "prepull-run1-3"
    assert pod["metadata"]["namespace"] == "sandboxes"
    labels = pod["metadata"]["labels"]
    # Not orchard-env: the sandbox watch and reconciliation never see it.
    assert labels["app.kubernetes.io/managed-by"] == "orchard-env-prepull"
    assert labels["orchard.dev/prepull"] == "run1"
    required = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required == {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-7"]}]}
        ]
    }
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert spec["tolerations"] == [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["priorityClassName"] == "sandbox-low"
    [copy] = spec["initContainers"]
    assert copy["image"] == CONFIG.inagent_image
    assert [c["image"] for c in spec["containers"]] == ["python:3.12", "ghcr.io/a/b:1"]
    for container in spec["containers"]:
        assert container["command"] == ["/.orchard/inagent/orchard-inagent", "--help"]
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert container["volumeMounts"][0]["readOnly"] is True
        assert container["resources"]["limits"] == {"memory": "64Mi"}


def _pod(phase: str = "Running", **status: Any) -> dict[str, Any]:
    return {"status": {"phase": phase, **status}}


def _container(name: str, state: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "state": state}


IMAGES = ["a:1", "b:1", "c:1"]


def test_pull_states_read_each_container() -> None:
    assert [s.status for s in pull_states(None, "n", IMAGES)] == ["waiting"] * 3
    pod = _pod(
        containerStatuses=[
            _container("pull-0", {"terminated": {"exitCode": 0}}),
            _container("pull-1", {"waiting": {"reason": "ErrImagePull", "message": "no b"}}),
            _container("pull-2", {"waiting": {"reason": "ContainerCreating"}}),
        ]
    )
    states = pull_states(pod, "n", IMAGES)
    assert [(s.image, s.status) for s in states] == [
        ("a:1", "done"),
        ("b:1", "failed"),
        ("c:1", "pulling"),
    ]
    assert states[1].message == "ErrImagePull: no b"
    # A non-zero exit of the no-op still means the image was there to run.
    pod = _pod("Failed", containerStatuses=[_container("pull-0", {"terminated": {"exitCode": 1}})])
    assert pull_states(pod, "n", ["a:1"])[0].status == "done"


def test_pull_states_of_a_pod_that_cannot_run() -> None:
    unschedulable = _pod(
        "Pending",
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "node(s) had untolerated taint",
            }
        ],
    )
    states = pull_states(unschedulable, "n7", IMAGES)
    assert {s.status for s in states} == {"failed"}
    assert "cannot be scheduled on node n7: node(s) had untolerated taint" in states[0].message
    no_agent = _pod(
        "Pending",
        initContainerStatuses=[
            {"image": "agent:0", "state": {"waiting": {"reason": "ImagePullBackOff"}}}
        ],
    )
    states = pull_states(no_agent, "n", IMAGES)
    assert {s.status for s in states} == {"failed"}
    assert "the agent image 'agent:0' could not run on node n" in states[0].message
