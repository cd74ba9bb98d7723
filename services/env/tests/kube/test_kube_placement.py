"""Image locality and image pre-pull of the kubernetes runtime, against the Kubernetes API test
double (``kube_api_double.py``): there is no Kubernetes API server on the build machine, so the
double serves Nodes and Pods, binds Pods to its nodes as a minimal scheduler and plays their
kubelets (the containers run for real, the agent's no-op included). What only a real cluster
can confirm: the default scheduler's weighing of the preferred affinity against its other
scores, real image pulls and the 50-image cap of Node.status.images."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kube_harness import BUSYBOX_IMAGE, INAGENT_IMAGE, MISSING_IMAGE, NAMESPACE

from orchard.env.runtime.base import RuntimeSandboxSpec, RuntimeUnavailable

pytestmark = [pytest.mark.root, pytest.mark.slow]

NODES = "/api/v1/nodes"


def sandbox(sandbox_id: str) -> RuntimeSandboxSpec:
    return RuntimeSandboxSpec(sandbox_id=sandbox_id, image=BUSYBOX_IMAGE)


def pod(double: Any, name: str) -> dict[str, Any]:
    found = double.get("pods", NAMESPACE, name)
    assert found is not None, f"no Pod {name}"
    return found


def preferred_nodes(manifest: dict[str, Any]) -> list[str]:
    affinity = manifest["spec"].get("affinity") or {}
    terms = affinity.get("nodeAffinity", {}).get(
        "preferredDuringSchedulingIgnoredDuringExecution", []
    )
    return [v for t in terms for f in t["preference"]["matchFields"] for v in f["values"]]


def prepull_pods(double: Any) -> list[str]:
    return [
        p["metadata"]["name"]
        for p in double.objects("pods", NAMESPACE)
        if p["metadata"]["labels"].get("app.kubernetes.io/managed-by") == "orchard-env-prepull"
    ]


async def until(condition: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_a_sandbox_lands_on_the_node_holding_its_image(runtime_for: Any, double: Any) -> None:
    # node-a would win a tie (first by name): only the preference sends the Pod to node-b.
    double.add_node("node-a")
    double.add_node("node-b", images=["registry.test/busybox:1.37"])
    runtime = await runtime_for()
    await runtime.create(sandbox("near"))
    placed = pod(double, "near")
    assert preferred_nodes(placed) == ["node-b"]
    weights = placed["spec"]["affinity"]["nodeAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert [w["weight"] for w in weights] == [50]
    assert (
        "requiredDuringSchedulingIgnoredDuringExecution"
        not in placed["spec"]["affinity"]["nodeAffinity"]
    )
    assert placed["spec"]["nodeName"] == "node-b"
    # A node that joins later is learned from the watch, not a new LIST.
    double.add_node("node-c", images=["registry.test/busybox@sha256:0f00", BUSYBOX_IMAGE])
    await until(lambda: runtime.image_nodes(BUSYBOX_IMAGE) == ["node-b", "node-c"])
    assert runtime._node_images.lists == 1
    await runtime.create(sandbox("near2"))
    assert preferred_nodes(pod(double, "near2")) == ["node-b", "node-c"]


async def test_no_node_holds_the_image_and_it_still_schedules(
    runtime_for: Any, double: Any
) -> None:
    double.add_node("node-a")
    double.add_node("node-b", images=["docker.io/library/python:3.12"])
    runtime = await runtime_for()
    made = await runtime.create(sandbox("anywhere"))
    assert made.agent_address
    placed = pod(double, "anywhere")
    assert "affinity" not in placed["spec"]
    assert placed["spec"]["nodeName"] == "node-a"
    # Its container ran there: the kubelet now lists the image, and the index learns it.
    assert BUSYBOX_IMAGE in double.node_images("node-a")
    await until(lambda: runtime.image_nodes(BUSYBOX_IMAGE) == ["node-a"])


async def test_the_node_watch_lists_again_after_410(runtime_for: Any, double: Any) -> None:
    double.add_node("node-a")
    runtime = await runtime_for()
    await until(lambda: any(w.resource == "nodes" for w in double._watchers))
    double.expire_history()  # the open stream gets an ERROR event with a 410 Status
    await until(lambda: runtime._node_images.lists == 2)
    double.add_node("node-b", images=[BUSYBOX_IMAGE])
    await until(lambda: runtime.image_nodes(BUSYBOX_IMAGE) == ["node-b"])
    assert runtime._node_images.lists == 2


async def test_without_access_to_nodes_sandboxes_still_start(
    runtime_for: Any, double: Any, caplog: pytest.LogCaptureFixture
) -> None:
    double.add_node("node-b", images=[BUSYBOX_IMAGE])
    double.forbidden.add("nodes")
    runtime = await runtime_for()
    assert "image locality is off" in caplog.text and "403" in caplog.text
    await runtime.create(sandbox("unplaced"))
    assert "affinity" not in pod(double, "unplaced")["spec"]
    with pytest.raises(RuntimeUnavailable, match="cannot list nodes"):
        async with contextlib.aclosing(runtime.prepull_images([BUSYBOX_IMAGE])) as progress:
            await anext(progress)


async def test_locality_off_reads_no_node(runtime_for: Any, double: Any) -> None:
    double.add_node("node-b", images=[BUSYBOX_IMAGE])
    runtime = await runtime_for(image_locality_weight=0)
    await runtime.create(sandbox("plain"))
    assert "affinity" not in pod(double, "plain")["spec"]
    assert double.count("GET", NODES) == 0
    assert runtime.image_nodes(BUSYBOX_IMAGE) == []


async def test_prepull_reports_each_node_and_image_and_leaves_no_pod(
    runtime_for: Any, double: Any
) -> None:
    double.add_node("node-a", labels={"pool": "sandboxes"})
    double.add_node("node-b", labels={"pool": "sandboxes"})
    double.add_node("node-c", labels={"pool": "gpu"})
    runtime = await runtime_for(node_selector={"pool": "sandboxes"})
    updates = []
    async with contextlib.aclosing(
        runtime.prepull_images([BUSYBOX_IMAGE, MISSING_IMAGE], timeout_s=60)
    ) as progress:
        async for update in progress:
            updates.append(update)
    final = updates[-1]
    assert final.finished and not any(u.finished for u in updates[:-1])
    states = {(s.node, s.image): s for s in final.states}
    assert set(states) == {
        (node, image) for node in ("node-a", "node-b") for image in (BUSYBOX_IMAGE, MISSING_IMAGE)
    }
    for node in ("node-a", "node-b"):
        assert states[(node, BUSYBOX_IMAGE)].status == "done"
        missing = states[(node, MISSING_IMAGE)]
        assert missing.status == "failed" and "ErrImagePull" in missing.message
        assert BUSYBOX_IMAGE in double.node_images(node)
    assert BUSYBOX_IMAGE not in double.node_images("node-c")  # not in the sandbox pool
    assert final.count("done") == 2 and final.count("failed") == 2
    # The Pods are gone (their processes too), and the sandbox watch never saw them.
    await until(lambda: not prepull_pods(double))
    assert await runtime.list_sandboxes() == []
    assert runtime._pods.names() == []
    # Sandboxes now prefer the nodes the pre-pull filled.
    await until(lambda: runtime.image_nodes(BUSYBOX_IMAGE) == ["node-a", "node-b"])


async def test_prepull_stopped_early_deletes_its_pods(runtime_for: Any, double: Any) -> None:
    double.add_node("node-a")
    runtime = await runtime_for()
    async with contextlib.aclosing(
        runtime.prepull_images([BUSYBOX_IMAGE], ["node-a"], timeout_s=60)
    ) as progress:
        async for _ in progress:
            assert prepull_pods(double)
            break
    await until(lambda: not prepull_pods(double) and not double._runs)


async def test_prepull_times_out_with_a_reason(runtime_for: Any, double: Any) -> None:
    double.add_node("node-a")
    runtime = await runtime_for()
    async with contextlib.aclosing(
        runtime.prepull_images([BUSYBOX_IMAGE], ["node-a"], timeout_s=0.01)
    ) as progress:
        updates = [update async for update in progress]
    final = updates[-1]
    assert final.finished
    [state] = final.states
    assert state.status == "failed" and "not pulled within 0.01 s" in state.message
    await until(lambda: not prepull_pods(double) and not double._runs)


async def test_prepull_refuses_bad_arguments(runtime_for: Any, double: Any) -> None:
    double.add_node("node-a", labels={"pool": "sandboxes"})
    runtime = await runtime_for()
    cases = [
        (([], ["node-a"]), {}, "at least one image"),
        ((["rootfs:/srv/root"], ["node-a"]), {}, "local runtime image"),
        (([BUSYBOX_IMAGE], ["node-x"]), {}, "no such nodes: node-x"),
        (([BUSYBOX_IMAGE], []), {"node_selector": {"pool": "gpu"}}, "no node matches"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            async with contextlib.aclosing(runtime.prepull_images(*args, **kwargs)) as progress:
                await anext(progress)
    assert not prepull_pods(double)


async def test_the_cli_prepulls_through_the_runtime(double: Any, tmp_path: Path) -> None:
    """``orchard images prepull`` as a person runs it: a separate process, the env config file."""
    double.add_node("node-a")
    double.add_node("node-b")
    config = tmp_path / "env.yaml"
    config.write_text(
        "runtime:\n"
        "  type: kubernetes\n"
        f"  namespace: {NAMESPACE}\n"
        f"  inagent_image: {INAGENT_IMAGE}\n"
        f"  api_url: {double.url}\n"
        "  deployment: cli-test\n"
    )
    command = [sys.executable, "-m", "orchard.sdk.cli", "images", "prepull", "--config"]
    process = await asyncio.create_subprocess_exec(
        *command,
        str(config),
        "--nodes",
        "node-b",
        "--json",
        BUSYBOX_IMAGE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err.decode()
    assert b"node-b  registry.test/busybox:1.37  done" in err
    assert b"prepull: 1/1 pulled, 0 failed" in err
    states = json.loads(out)["states"]
    assert states == [{"node": "node-b", "image": BUSYBOX_IMAGE, "status": "done", "message": ""}]
    assert BUSYBOX_IMAGE in double.node_images("node-b")
    assert BUSYBOX_IMAGE not in double.node_images("node-a")
    await until(lambda: not prepull_pods(double))

    # A missing image: exit status 1 and the kubelet's reason.
    process = await asyncio.create_subprocess_exec(
        *command,
        str(config),
        MISSING_IMAGE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 1
    assert b"ErrImagePull" in out and b"failed" in out
    # No runtime section: a usage error (status 2) that names the problem.
    config.write_text("server: {}\n")
    process = await asyncio.create_subprocess_exec(
        *command, str(config), BUSYBOX_IMAGE, stderr=asyncio.subprocess.PIPE
    )
    _, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2 and b"no `runtime: {type: kubernetes" in err
