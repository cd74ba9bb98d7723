"""The environment service on the kubernetes runtime (through the Kubernetes API test double):
exec goes to the Pod IP, never the API server; evicted sandboxes become FAILED with the reason;
reconciliation deletes Pods, policies and key Secrets that have no record."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from kube_harness import BUSYBOX_IMAGE, NAMESPACE

from orchard.env.runtime.kubernetes.pods import (
    ANNOTATION_OWNER,
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    LABEL_OWNER,
    LABEL_SANDBOX,
)
from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api

pytestmark = [pytest.mark.root, pytest.mark.slow]


async def test_exec_reaches_the_pod_ip_not_the_api_server(
    env_factory: Any, runtime_for: Any, double: Any
) -> None:
    env = await env_factory(runtime=await runtime_for())
    sandbox = await env.ready(image=BUSYBOX_IMAGE)
    calls = len(double.requests)
    for _ in range(3):
        result = await env.shell(sandbox.id, "hostname; echo ok")
        assert result.stdout == f"{sandbox.id}\nok\n".encode()
    assert len(double.requests) == calls  # nothing reached the API server
    pod = double.get("pods", NAMESPACE, sandbox.id)
    assert pod["metadata"]["labels"][LABEL_SANDBOX] == sandbox.id
    await env.stub.DeleteSandbox(api.DeleteSandboxRequest(sandbox_id=sandbox.id), metadata=env.md())
    assert double.get("pods", NAMESPACE, sandbox.id) is None


async def test_sandbox_pods_are_labelled_with_their_owner(
    env_factory: Any, runtime_for: Any, double: Any
) -> None:
    env = await env_factory(runtime=await runtime_for())
    request = api.CreateOwnerRequest()
    request.heartbeat_timeout.FromSeconds(60)
    owner = (await env.stub.CreateOwner(request, metadata=env.md())).owner
    owned = await env.ready(image=BUSYBOX_IMAGE, owner_id=owner.id)
    alone = await env.ready(image=BUSYBOX_IMAGE)
    pod = double.get("pods", NAMESPACE, owned.id)
    assert pod["metadata"]["labels"][LABEL_OWNER] == owner.id
    assert pod["metadata"]["annotations"][ANNOTATION_OWNER] == owner.id
    assert LABEL_OWNER not in double.get("pods", NAMESPACE, alone.id)["metadata"]["labels"]
    # A LIST with a selector on it finds the owner's Pods, and no other.
    import aiohttp

    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"{double.url}/api/v1/namespaces/{NAMESPACE}/pods",
            params={"labelSelector": f"{LABEL_OWNER}={owner.id}"},
        ) as reply,
    ):
        listed = await reply.json()
    assert [p["metadata"]["name"] for p in listed["items"]] == [owned.id]
    await env.stub.DeleteOwner(api.DeleteOwnerRequest(owner_id=owner.id), metadata=env.md())
    deadline = time.monotonic() + 20
    while double.get("pods", NAMESPACE, owned.id) is not None:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


async def test_an_evicted_sandbox_becomes_failed_with_the_reason(
    env_factory: Any, runtime_for: Any, double: Any
) -> None:
    env = await env_factory(runtime=await runtime_for())
    sandbox = await env.ready(image=BUSYBOX_IMAGE)
    await double.disrupt(NAMESPACE, sandbox.id, "Evicted", "The node was low on resource: memory.")
    deadline = time.monotonic() + 20
    while True:
        got = await env.stub.GetSandbox(
            api.GetSandboxRequest(sandbox_id=sandbox.id), metadata=env.md()
        )
        if got.sandbox.state == env_pb2.SANDBOX_STATE_FAILED:
            break
        assert time.monotonic() < deadline, got.sandbox
        await asyncio.sleep(0.05)
    assert got.sandbox.failure.reason == "EVICTED"
    assert "low on resource" in got.sandbox.failure.message


async def test_reconcile_deletes_pods_policies_and_keys_without_a_record(
    env_factory: Any, runtime_for: Any, double: Any
) -> None:
    runtime = await runtime_for()
    labels = {
        LABEL_MANAGED_BY: "orchard-env",
        LABEL_DEPLOYMENT: runtime.config.deployment,
        LABEL_SANDBOX: "sbx-orphan",
    }
    double.put_object(
        "pods",
        {
            "metadata": {"name": "sbx-orphan", "namespace": NAMESPACE, "labels": labels},
            "spec": {"containers": [{"name": "sandbox", "image": BUSYBOX_IMAGE}]},
        },
    )
    double.put_object(
        "networkpolicies",
        {
            "metadata": {
                "name": "sbx-lone-egress",
                "namespace": NAMESPACE,
                "labels": {**labels, LABEL_SANDBOX: "sbx-lone"},
            },
            "spec": {"podSelector": {"matchLabels": {LABEL_SANDBOX: "sbx-lone"}}},
        },
    )
    # A key Secret left by a create that crashed before its Pod.
    double.put_object(
        "secrets",
        {
            "metadata": {
                "name": "sbx-keyonly-agent-key",
                "namespace": NAMESPACE,
                "labels": {**labels, LABEL_SANDBOX: "sbx-keyonly"},
            },
            "data": {"agent-key": "a2V5"},
        },
    )
    # Another deployment's Pod is none of this one's business.
    double.put_object(
        "pods",
        {
            "metadata": {
                "name": "sbx-other",
                "namespace": NAMESPACE,
                "labels": {**labels, LABEL_DEPLOYMENT: "someone-else"},
            },
            "spec": {"containers": [{"name": "sandbox", "image": BUSYBOX_IMAGE}]},
        },
    )
    env = await env_factory(runtime=runtime)
    live = await env.ready(image=BUSYBOX_IMAGE)
    deadline = time.monotonic() + 20
    while double.get("pods", NAMESPACE, "sbx-orphan") is not None:  # the reconcile at start
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    await env.app.controller.reconcile()
    assert double.get("networkpolicies", NAMESPACE, "sbx-lone-egress") is None
    assert double.get("secrets", NAMESPACE, "sbx-keyonly-agent-key") is None
    assert double.get("secrets", NAMESPACE, f"{live.id}-agent-key") is not None
    assert double.get("pods", NAMESPACE, "sbx-other") is not None
    assert double.get("pods", NAMESPACE, live.id) is not None
    assert sorted(await runtime.list_sandboxes()) == [live.id]
