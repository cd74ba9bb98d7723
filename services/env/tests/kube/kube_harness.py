"""The kubernetes runtime over the Kubernetes API test double (``kube_api_double.py``): the
image catalog it runs (a static busybox root; the inagent image as the real bundle on it) and
a started double with a runtime configuration pointing at it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from kube_api_double import ImageDouble, KubeApiDouble

from orchard.env.runtime.kubernetes.config import KubernetesRuntimeConfig
from orchard.env.runtime.local.config import default_agent_bundle

BUSYBOX = "/bin/busybox"
BUSYBOX_IMAGE = "registry.test/busybox:1.37"
INAGENT_IMAGE = "registry.test/orchard-inagent:test"
MISSING_IMAGE = "registry.test/no-such-image:1"
NAMESPACE = "orchard-sandboxes"


def unavailable() -> str | None:
    """Why the double cannot run Pods here, or None."""
    if os.geteuid() != 0:
        return "the Kubernetes test double runs Pods in namespaces: needs root"
    if not os.path.exists(BUSYBOX):
        return "needs busybox-static (/bin/busybox)"
    if not os.access(os.path.join(default_agent_bundle(), "orchard-inagent"), os.X_OK):
        return "needs the agent bundle (make inagent-binary)"
    return None


def build_busybox_root(root: Path) -> Path:
    """A root file system with nothing but a static busybox: no libc, no Python."""
    (root / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    applets = subprocess.run(
        [BUSYBOX, "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    for applet in applets:
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    for directory in ("etc", "root", "tmp", "usr/bin"):
        (root / directory).mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    return root


def build_bundle_layer(layer: Path) -> Path:
    """The inagent image's own layer: the bundle at /opt/orchard-inagent, as its Dockerfile
    puts it (hard links where the file system allows: no 50 MB copy)."""
    target = layer / "opt" / "orchard-inagent"
    target.parent.mkdir(parents=True)
    source = default_agent_bundle()
    linked = subprocess.run(["cp", "-al", source, str(target)], capture_output=True, check=False)
    if linked.returncode != 0:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target, symlinks=True)
    return layer


def catalog(busybox_root: Path, bundle_layer: Path) -> dict[str, ImageDouble]:
    return {
        BUSYBOX_IMAGE: ImageDouble(layers=(busybox_root,), cmd=("sh",)),
        INAGENT_IMAGE: ImageDouble(
            layers=(bundle_layer, busybox_root),
            entrypoint=("cp", "-R", "/opt/orchard-inagent/."),
            cmd=("/orchard/",),
        ),
    }


def runtime_config(double: KubeApiDouble, **overrides: Any) -> KubernetesRuntimeConfig:
    values: dict[str, Any] = {
        "api_url": double.url,
        "namespace": NAMESPACE,
        "inagent_image": INAGENT_IMAGE,
        "deployment": f"test-{uuid.uuid4().hex[:8]}",
        "start_timeout_s": 30,
        "delete_timeout_s": 20,
        "termination_grace_s": 1,
        "watch_timeout_s": 60,
    }
    values.update(overrides)
    return KubernetesRuntimeConfig(**values)


@contextlib.asynccontextmanager
async def started_double(
    base: Path, images: dict[str, ImageDouble], **options: Any
) -> AsyncIterator[KubeApiDouble]:
    double = KubeApiDouble(base, images, **options)
    await double.start()
    try:
        yield double
    finally:
        await double.close()


def leftovers(double: KubeApiDouble, sandbox_ids: set[str]) -> list[str]:
    """Pods, policies, key Secrets and Pod directories of these sandboxes still in the double."""
    found = []
    for resource in ("pods", "networkpolicies", "secrets"):
        for obj in double.objects(resource, NAMESPACE):
            labels = obj["metadata"].get("labels") or {}
            if labels.get("orchard.dev/sandbox-id") in sandbox_ids:
                found.append(f"{resource}/{obj['metadata']['name']}")
    pods_dir = double.base_dir / "pods"
    if pods_dir.exists():
        found += [f"pod directory {p.name}" for p in pods_dir.iterdir()]
    return found
