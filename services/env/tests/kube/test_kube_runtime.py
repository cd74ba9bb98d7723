"""The kubernetes runtime against the Kubernetes API test double: the one LIST+WATCH stream
(resume, 410, bookmarks), disruptions, NetworkPolicy lifecycle and expiry, and the protocol
of the double itself."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from kube_harness import BUSYBOX_IMAGE, NAMESPACE
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiException
from kubernetes_asyncio.watch import Watch

from orchard.env.runtime.base import (
    EgressRule,
    FailureReason,
    RuntimeFailure,
    RuntimeNotSupported,
    RuntimeSandboxSpec,
    SandboxStatus,
)

pytestmark = [pytest.mark.root, pytest.mark.slow]

PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"


def sandbox(sandbox_id: str, **fields: Any) -> RuntimeSandboxSpec:
    return RuntimeSandboxSpec(sandbox_id=sandbox_id, image=BUSYBOX_IMAGE, **fields)


def watches(double: Any) -> list[dict[str, str]]:
    return [q for m, path, q in double.requests if m == "GET" and path == PODS and q.get("watch")]


async def until(condition: Any, timeout_s: float = 20.0) -> None:
    """Wait for a condition that the double's background work makes true."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_one_stream_and_no_per_sandbox_calls(runtime_for: Any, double: Any) -> None:
    runtime = await runtime_for()
    made = await asyncio.gather(*(runtime.create(sandbox(f"s{i}")) for i in range(3)))
    assert len({s.agent_address for s in made}) == 3
    assert all(s.agent_address.startswith("127.") for s in made)  # the Pod IPs
    # One LIST, and no call ever asked for one Pod: readiness came from the stream.
    assert double.count("GET", PODS, labelSelector=runtime._pods.selector) >= 1
    assert runtime._pods.lists == 1
    assert not [p for m, p, _ in double.requests if m == "GET" and p.startswith(PODS + "/")]
    for s in made:
        assert await runtime.status(s.sandbox_id) is SandboxStatus.RUNNING


async def test_watch_resumes_from_the_last_version_without_a_list(
    runtime_for: Any, double: Any
) -> None:
    runtime = await runtime_for()
    await runtime.create(sandbox("first"))
    seen = runtime._pods.resource_version
    before = len(watches(double))
    double.end_watches()  # as a server-side timeout would
    await until(lambda: len(watches(double)) > before)
    assert watches(double)[-1]["resourceVersion"] == seen
    await runtime.create(sandbox("second"))
    assert runtime._pods.lists == 1


async def test_expired_version_lists_again_and_sees_what_changed(
    runtime_for: Any, double: Any
) -> None:
    runtime = await runtime_for()
    await runtime.create(sandbox("kept"))
    await runtime._pods.close()  # the stream is down while things change
    double.kill_container(NAMESPACE, "kept")
    await until(lambda: double.get("pods", NAMESPACE, "kept")["status"]["phase"] == "Failed")
    double.expire_history()
    await runtime._pods.start()  # resumes the watch from the old version: 410
    exits = runtime.exits()
    event = await asyncio.wait_for(anext(exits), 10)
    assert (event.sandbox_id, event.reason) == ("kept", FailureReason.AGENT_EXITED)
    assert runtime._pods.lists >= 2
    await runtime.create(sandbox("after"))  # the stream works from the new list's version
    assert await runtime.status("kept") is SandboxStatus.EXITED


async def test_an_open_stream_told_410_lists_again(runtime_for: Any, double: Any) -> None:
    runtime = await runtime_for()
    await runtime.create(sandbox("one"))
    lists = runtime._pods.lists
    double.expire_history()
    await until(lambda: runtime._pods.lists > lists)
    await runtime.create(sandbox("two"))
    assert await runtime.status("one") is SandboxStatus.RUNNING


async def test_bookmarks_move_the_version_while_no_sandbox_changes(
    runtime_for: Any, double: Any
) -> None:
    runtime = await runtime_for()
    await until(lambda: len(watches(double)) >= 1)
    # The client sends Python's spelling of a bool; the API server parses it as Go's ParseBool.
    assert all(q.get("allowWatchBookmarks") in ("true", "True") for q in watches(double))
    start = runtime._pods.resource_version
    # Something outside the selector changes: the stream has no event for it, only bookmarks.
    double.put_object(
        "networkpolicies",
        {"metadata": {"name": "unrelated", "namespace": NAMESPACE}, "spec": {"podSelector": {}}},
    )
    await until(lambda: runtime._pods.resource_version != start)
    assert runtime._pods.bookmarks >= 1
    assert int(runtime._pods.resource_version) == double._rv
    double.end_watches()
    await until(lambda: watches(double)[-1]["resourceVersion"] == str(double._rv))


@pytest.mark.parametrize(
    ("reason", "expected"),
    [("Evicted", FailureReason.EVICTED), ("Preempted", FailureReason.PREEMPTED)],
)
async def test_disrupted_pods_are_reported_with_the_reason(
    runtime_for: Any, double: Any, reason: str, expected: FailureReason
) -> None:
    runtime = await runtime_for()
    await runtime.create(sandbox("victim"))
    exits = runtime.exits()
    await double.disrupt(NAMESPACE, "victim", reason, "The node was low on resource: memory.")
    event = await asyncio.wait_for(anext(exits), 10)
    assert (event.sandbox_id, event.reason) == ("victim", expected)
    assert "low on resource" in event.message
    assert await runtime.status("victim") is SandboxStatus.EXITED
    await runtime.delete("victim")
    assert await runtime.status("victim") is SandboxStatus.ABSENT


async def test_a_pod_deleted_outside_is_reported(runtime_for: Any, double: Any) -> None:
    runtime = await runtime_for()
    await runtime.create(sandbox("gone"))
    exits = runtime.exits()
    async with client.ApiClient(client.Configuration(host=double.url)) as api:
        await client.CoreV1Api(api).delete_namespaced_pod("gone", NAMESPACE, grace_period_seconds=0)
    event = await asyncio.wait_for(anext(exits), 10)
    assert (event.sandbox_id, event.reason) == ("gone", FailureReason.RUNTIME_DIED)
    # The Pod owned its agent key's Secret: the key went with it.
    secret = double.objects("secrets", NAMESPACE)
    assert [s["metadata"]["name"] for s in secret] == []


async def test_the_agent_key_secret_is_owned_by_the_pod(runtime_for: Any, double: Any) -> None:
    runtime = await runtime_for()
    made = await runtime.create(sandbox("keyed"))
    assert made.agent_version  # the agent proved it holds the key at create
    pod = double.get("pods", NAMESPACE, "keyed")
    secret = double.get("secrets", NAMESPACE, "keyed-agent-key")
    assert secret["immutable"] is True
    assert secret["metadata"]["labels"] == pod["metadata"]["labels"]
    assert secret["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "keyed", "uid": pod["metadata"]["uid"]}
    ]
    await runtime.delete("keyed")
    assert double.get("secrets", NAMESPACE, "keyed-agent-key") is None


async def test_network_policy_lifecycle(runtime_for: Any, double: Any) -> None:
    runtime = await runtime_for()
    await runtime.create(sandbox("closed"))
    assert double.get("networkpolicies", NAMESPACE, "closed-egress") is None  # default deny only
    soon = time.time() + 1.0
    await runtime.create(
        sandbox(
            "open",
            egress=(
                EgressRule("10.1.0.0/16", ports=(443,), protocol="tcp"),
                EgressRule("192.0.2.9", expire_unix_s=soon),
            ),
        )
    )
    policy = double.get("networkpolicies", NAMESPACE, "open-egress")
    assert policy is not None
    assert policy["spec"]["podSelector"]["matchLabels"] == {"orchard.dev/sandbox-id": "open"}
    assert [e["to"][0]["ipBlock"]["cidr"] for e in policy["spec"]["egress"]] == [
        "10.1.0.0/16",
        "192.0.2.9/32",
    ]
    assert "open" in await runtime.list_sandboxes()
    # At its expiry the rule leaves the policy.
    await until(
        lambda: len(double.get("networkpolicies", NAMESPACE, "open-egress")["spec"]["egress"]) == 1
    )
    await runtime.update_egress("open", [EgressRule("198.51.100.0/24")])
    cidrs = double.get("networkpolicies", NAMESPACE, "open-egress")["spec"]["egress"]
    assert cidrs == [{"to": [{"ipBlock": {"cidr": "198.51.100.0/24"}}]}]
    await runtime.update_egress("open", [])
    assert double.get("networkpolicies", NAMESPACE, "open-egress") is None
    await runtime.update_egress(
        "open", [EgressRule("203.0.113.1", expire_unix_s=time.time() + 0.5)]
    )
    assert double.get("networkpolicies", NAMESPACE, "open-egress") is not None
    await until(lambda: double.get("networkpolicies", NAMESPACE, "open-egress") is None)
    await runtime.update_egress("open", [EgressRule("203.0.113.2")])
    await runtime.delete("open")
    assert double.get("networkpolicies", NAMESPACE, "open-egress") is None
    assert double.get("pods", NAMESPACE, "open") is None


async def test_a_peer_rule_opens_the_peer_pod_to_this_one_until_it_expires(
    runtime_for: Any, double: Any
) -> None:
    runtime = await runtime_for()
    site = await runtime.create(sandbox("site", ingress_ports=(8080, 8082)))
    pod = double.get("pods", NAMESPACE, "site")
    assert site.network_address == pod["status"]["podIP"]
    plain = await runtime.create(sandbox("plain"))
    assert plain.network_address == ""
    soon = time.time() + 1.0
    await runtime.create(
        sandbox(
            "browser",
            egress=(
                EgressRule(site.network_address, ports=(8080,), peer="site", expire_unix_s=soon),
            ),
        )
    )
    egress = double.get("networkpolicies", NAMESPACE, "browser-egress")["spec"]["egress"]
    assert egress == [
        {
            "to": [{"podSelector": {"matchLabels": {"orchard.dev/sandbox-id": "site"}}}],
            "ports": [{"protocol": "TCP", "port": 8080}, {"protocol": "UDP", "port": 8080}],
        }
    ]
    ingress = double.get("networkpolicies", NAMESPACE, "browser-to-site")
    assert ingress["spec"]["podSelector"] == {"matchLabels": {"orchard.dev/sandbox-id": "site"}}
    assert ingress["spec"]["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": {"orchard.dev/sandbox-id": "browser"}}}],
            "ports": [{"protocol": "TCP", "port": 8080}, {"protocol": "UDP", "port": 8080}],
        }
    ]
    assert ingress["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]
    assert "orchard.dev/sandbox-id" not in ingress["metadata"]["labels"]
    # Both sides close at the rule's expiry.
    await until(lambda: double.get("networkpolicies", NAMESPACE, "browser-to-site") is None)
    assert double.get("networkpolicies", NAMESPACE, "browser-egress") is None
    # A new rule opens it again; the peer's deletion takes its side along (it owns it).
    await runtime.update_egress(
        "browser", [EgressRule(site.network_address, ports=(8082,), protocol="tcp", peer="site")]
    )
    ingress = double.get("networkpolicies", NAMESPACE, "browser-to-site")
    assert ingress["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 8082}]
    await runtime.delete("site")
    assert double.get("networkpolicies", NAMESPACE, "browser-to-site") is None
    # Deleting the source removes what it opened elsewhere, and reconcile counts none of it
    # as a sandbox.
    await runtime.create(sandbox("site2", ingress_ports=(8080,)))
    await runtime.update_egress(
        "browser", [EgressRule("10.0.0.9", ports=(8080,), protocol="tcp", peer="site2")]
    )
    assert double.get("networkpolicies", NAMESPACE, "browser-to-site2") is not None
    assert sorted(await runtime.list_sandboxes()) == ["browser", "plain", "site2"]
    await runtime.delete("browser")
    assert double.get("networkpolicies", NAMESPACE, "browser-to-site2") is None
    for name in ("plain", "site2"):
        await runtime.delete(name)


async def test_a_restarted_runtime_schedules_expiries_again(runtime_for: Any, double: Any) -> None:
    first = await runtime_for()
    rules = (EgressRule("10.0.0.1"), EgressRule("10.0.0.2", expire_unix_s=time.time() + 1.0))
    await first.create(sandbox("kept", egress=rules))
    await first.close()
    second = await runtime_for(deployment=first.config.deployment)
    assert await second.status("kept") is SandboxStatus.RUNNING
    await until(
        lambda: len(double.get("networkpolicies", NAMESPACE, "kept-egress")["spec"]["egress"]) == 1
    )


async def test_refusals(runtime_for: Any, double: Any) -> None:
    runtime = await runtime_for()
    with pytest.raises(RuntimeFailure) as caught:
        await runtime.create(RuntimeSandboxSpec(sandbox_id="local", image="rootfs:/srv/root"))
    assert caught.value.reason is FailureReason.IMAGE_INVALID
    with pytest.raises(RuntimeNotSupported):
        await runtime.fork("any", sandbox("copy"))
    with pytest.raises(ValueError, match="DNS label"):
        await runtime.create(sandbox("Upper_Case"))
    await runtime.create(sandbox("twice"))
    with pytest.raises(RuntimeFailure, match="exists already"):
        await runtime.create(sandbox("twice"))


async def test_the_double_answers_410_and_status_objects(double: Any) -> None:
    """The protocol the runtime relies on, seen through kubernetes-asyncio itself."""
    async with client.ApiClient(client.Configuration(host=double.url)) as api:
        core = client.CoreV1Api(api)
        with pytest.raises(ApiException) as missing:
            await core.read_namespaced_pod("nope", NAMESPACE)
        assert missing.value.status == 404 and '"reason": "NotFound"' in missing.value.body
        listed = await core.list_namespaced_pod(NAMESPACE)
        old = listed.metadata.resource_version
        double.put_object(
            "pods",
            {
                "metadata": {"name": "p1", "namespace": NAMESPACE, "labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "none:1"}]},
            },
        )
        double.expire_history()
        with pytest.raises(ApiException) as expired:
            async with Watch() as watch:
                async for _ in watch.stream(
                    core.list_namespaced_pod, NAMESPACE, resource_version=old, timeout_seconds=5
                ):
                    pass
        assert expired.value.status == 410
        selected = await core.list_namespaced_pod(NAMESPACE, label_selector="a in (b,c)")
        assert [p.metadata.name for p in selected.items] == ["p1"]
        assert not (await core.list_namespaced_pod(NAMESPACE, label_selector="a!=b")).items
