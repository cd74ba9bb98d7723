"""Images that name host paths are the operator's, never a tenant's: `rootfs:` and archive paths
outside `images.allowed_paths`, or into the service's own state, are PERMISSION_DENIED (checked
again on the real path when the runtime creates the sandbox), the `host` image is off unless
allowed, and an allowed `host` sandbox sees nothing of the service's (state folder, etcd data,
the profile's token, other sandboxes' layers)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.core.errors import error_info
from orchard.core.etcd import EmbeddedEtcd
from orchard.env.config import AdmissionConfig, ImagesConfig, TenantImagesConfig
from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api
from orchard.types.v1 import exec_pb2

pytestmark = [pytest.mark.root, pytest.mark.slow]

BETA_TOKEN = "beta-token"  # tenant beta of the tests' configuration (tests/conftest.py)

READY = env_pb2.SANDBOX_STATE_READY
FAILED = env_pb2.SANDBOX_STATE_FAILED


@dataclass
class StateFolder:
    """A stand-in for `orchard up`'s state folder, on the root file system (what the host image
    shows), with the files an attacker wants, and a sibling nobody protects (the control)."""

    root: Path
    etcd_db: Path
    profile: Path
    token: str
    control: Path


@pytest.fixture
def state_folder(tmp_path: Path) -> Iterator[StateFolder]:
    # The host image shows only the root mount: put the folder there even where /tmp is tmpfs.
    base = tmp_path if os.stat(tmp_path).st_dev == os.stat("/").st_dev else None
    parent = Path(tempfile.mkdtemp(prefix="orchard-state-", dir=base or "/var/tmp"))
    try:
        token = uuid.uuid4().hex
        root = parent / "state"
        (root / "etcd" / "member" / "snap").mkdir(parents=True)
        etcd_db = root / "etcd" / "member" / "snap" / "db"
        etcd_db.write_text(f"spec.env SECRET={token}")
        profile = parent / "profile.json"  # kept outside the folder, as $ORCHARD_PROFILE may
        profile.write_text(f'{{"token": "{token}"}}')
        control = parent / "control.txt"
        control.write_text("visible")
        yield StateFolder(root, etcd_db, profile, token, control)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def allowed_dir(tmp_path: Path, busybox_root: Path) -> Path:
    """The operator's image directory: a copy of the busybox root (links kept)."""
    images = tmp_path / "images"
    images.mkdir()
    shutil.copytree(busybox_root, images / "busybox", symlinks=True)
    return images


@pytest.fixture
async def service(
    env_factory: Any,
    local_runtime: Any,
    allowed_dir: Path,
    state_folder: StateFolder,
    etcd: EmbeddedEtcd,
) -> Any:
    """The real service and runtime; alpha may use the host image and the image directory, beta
    only the image directory; the state folder, the profile and etcd's data are masked."""
    images = ImagesConfig(
        allowed_paths=[str(allowed_dir)],
        host_masked_paths=[str(state_folder.root), str(state_folder.profile), str(etcd.data_dir)],
        tenants={"alpha": TenantImagesConfig(allow_host=True)},
    )
    return await env_factory(runtime=local_runtime, images=images)


async def run(env: Any, sandbox_id: str, script: str) -> Any:
    """The script's ExecResult, run by the sandbox's shell as its tenant (alpha)."""
    command = exec_pb2.Command(shell=script)
    command.timeout.FromSeconds(30)
    request = api.ExecRequest(sandbox_id=sandbox_id, command=command)
    return (await env.stub.Exec(request, metadata=env.md(), timeout=60)).result


async def create_as(env: Any, token: str, image: str) -> env_pb2.Sandbox:
    request = api.CreateSandboxRequest(spec=env_pb2.SandboxSpec(image=image))
    request.spec.heartbeat_timeout.FromSeconds(60)
    return (await env.stub.CreateSandbox(request, metadata=env.md(token))).sandbox


async def refused(env: Any, token: str, image: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await create_as(env, token, image)
    return caught.value


def assert_not_allowed(error: grpc.aio.AioRpcError, setting: str = "") -> None:
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
    assert error_info(error).reason == "IMAGE_NOT_ALLOWED"
    assert setting in (error.details() or "")


async def test_a_second_tenant_cannot_mount_the_runtime_workspace(
    service: Any, local_runtime: Any, allowed_dir: Path, attack: Any
) -> None:
    first = await service.ready(image=f"rootfs:{allowed_dir / 'busybox'}", timeout_s=60)
    written = await run(service, first.id, "echo alpha-private > /root/data.txt")
    assert written.status.exit_code == 0, written
    workspace = Path(local_runtime.config.workspace_dir)
    for target in (workspace, workspace / first.id / "upper", workspace / first.id):
        attack.tried(f"rootfs:{target.name} of the runtime workspace")
        assert_not_allowed(await refused(service, BETA_TOKEN, f"rootfs:{target}"))
        attack.held(f"rootfs:{target.name} of the runtime workspace")
    for directory in local_runtime.private_paths():
        attack.tried(f"rootfs: runtime dir {Path(directory).name}")
        assert_not_allowed(await refused(service, BETA_TOKEN, f"rootfs:{directory}"))
        attack.held(f"rootfs: runtime dir {Path(directory).name}")
    assert len(await local_runtime.list_sandboxes()) == 1


async def test_allowing_a_folder_that_holds_the_runtime_state_still_refuses_it(
    env_factory: Any, local_runtime: Any, tmp_path: Path, attack: Any
) -> None:
    # The operator allows tmp_path, which holds the runtime's state and workspace.
    env = await env_factory(
        runtime=local_runtime, images=ImagesConfig(allowed_paths=[str(tmp_path)])
    )
    for name in ("sandboxes", "state"):
        attack.tried(f"rootfs: allowed parent's {name}")
        assert_not_allowed(await refused(env, BETA_TOKEN, f"rootfs:{tmp_path / name}"))
        attack.held(f"rootfs: allowed parent's {name}")
    attack.tried("rootfs: the allowed folder above the runtime state")
    assert_not_allowed(await refused(env, BETA_TOKEN, f"rootfs:{tmp_path}"))
    attack.held("rootfs: the allowed folder above the runtime state")


@pytest.mark.parametrize(
    "image",
    [
        "rootfs:/proc/self/root",
        "rootfs:/proc/1/root",
        "rootfs:/proc/self/cwd",
        "rootfs:/",
        "rootfs:/etc",
        "oci-archive:/proc/self/root/etc/passwd",
        "docker-archive:/etc/shadow",
    ],
)
async def test_host_paths_outside_the_allow_list_are_refused(
    service: Any, image: str, attack: Any
) -> None:
    attack.tried(image)
    for token in (service.token, BETA_TOKEN):
        assert_not_allowed(await refused(service, token, image))
    attack.held(image)


async def test_dot_dot_out_of_the_allowed_folder_is_refused(
    service: Any, allowed_dir: Path, attack: Any
) -> None:
    attack.tried("rootfs:<allowed>/../..")
    error = await refused(service, BETA_TOKEN, f"rootfs:{allowed_dir}/../..")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    attack.held("rootfs:<allowed>/../..")


async def test_symlinks_in_the_allowed_folder_to_forbidden_places_are_refused(
    service: Any, local_runtime: Any, allowed_dir: Path, state_folder: StateFolder, attack: Any
) -> None:
    links = {
        "to-root": "/",
        "to-proc-root": "/proc/self/root",
        "to-workspace": local_runtime.config.workspace_dir,
        "to-state": str(state_folder.root),
        "to-outside": str(state_folder.root.parent),
    }
    for name, target in links.items():
        (allowed_dir / name).symlink_to(target)
        attack.tried(f"symlink {name}")
        assert_not_allowed(await refused(service, BETA_TOKEN, f"rootfs:{allowed_dir / name}"))
        attack.held(f"symlink {name}")


async def test_bind_mounts_of_forbidden_places_in_the_allowed_folder_are_refused(
    service: Any, local_runtime: Any, allowed_dir: Path, attack: Any
) -> None:
    sources = {
        "bind-workspace": local_runtime.config.workspace_dir,
        "bind-state": local_runtime.config.state_dir,
        "bind-root": "/",
        "bind-proc": "/proc",
    }
    mounted: list[Path] = []
    try:
        for name, source in sources.items():
            target = allowed_dir / name
            target.mkdir()
            subprocess.run(["mount", "--bind", source, str(target)], check=True)
            mounted.append(target)
            attack.tried(f"bind mount {name}")
            assert_not_allowed(await refused(service, BETA_TOKEN, f"rootfs:{target}"))
            attack.held(f"bind mount {name}")
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", "-l", str(target)], check=True)


async def test_an_allowed_rootfs_works_and_a_symlink_inside_it_too(
    service: Any, allowed_dir: Path
) -> None:
    (allowed_dir / "current").symlink_to(allowed_dir / "busybox")
    for image in (f"rootfs:{allowed_dir / 'busybox'}", f"rootfs:{allowed_dir / 'current'}"):
        sandbox = await create_as(service, BETA_TOKEN, image)
        request = api.WaitSandboxRequest(sandbox_id=sandbox.id)
        request.timeout.FromSeconds(60)
        waited = await service.stub.WaitSandbox(request, metadata=service.md(BETA_TOKEN))
        assert waited.sandbox.state == READY, waited.sandbox
        assert waited.sandbox.spec.image == image  # the request's form, as the tenant wrote it


async def test_a_symlink_swapped_after_the_request_is_refused_by_the_runtime(
    env_factory: Any, local_runtime: Any, allowed_dir: Path, attack: Any
) -> None:
    # One sandbox at a time: the second waits in the queue, checked, while its path changes.
    env = await env_factory(
        runtime=local_runtime,
        images=ImagesConfig(allowed_paths=[str(allowed_dir)]),
        admission=AdmissionConfig(max_sandboxes_per_tenant=1),
    )
    first = await env.ready(image=f"rootfs:{allowed_dir / 'busybox'}", timeout_s=60)
    swapped = allowed_dir / "swapped"
    shutil.copytree(allowed_dir / "busybox", swapped, symlinks=True)
    queued = await env.create(image=f"rootfs:{swapped}", timeout_s=60)
    assert queued.state == env_pb2.SANDBOX_STATE_PENDING and queued.queue_position == 1
    attack.tried("swap an allowed rootfs for a symlink to the workspace while queued")
    shutil.rmtree(swapped)
    swapped.symlink_to(local_runtime.config.workspace_dir)
    await env.stub.DeleteSandbox(api.DeleteSandboxRequest(sandbox_id=first.id), metadata=env.md())
    done = await env.wait(queued.id, timeout_s=60)
    assert done.state == FAILED, done
    assert done.failure.reason == "IMAGE_NOT_ALLOWED", done.failure
    assert await local_runtime.list_sandboxes() == []
    attack.held("swap an allowed rootfs for a symlink to the workspace while queued")


async def test_the_host_image_needs_the_operators_permission(service: Any, attack: Any) -> None:
    attack.tried("host image without permission")
    error = await refused(service, BETA_TOKEN, "host")
    assert_not_allowed(error, "images.tenants.beta.allow_host")
    attack.held("host image without permission")


async def test_an_allowed_host_sandbox_sees_nothing_of_the_service(  # noqa: PLR0917
    service: Any,
    local_runtime: Any,
    allowed_dir: Path,
    state_folder: StateFolder,
    etcd: EmbeddedEtcd,
    tmp_path: Path,
    attack: Any,
) -> None:
    other = await service.ready(image=f"rootfs:{allowed_dir / 'busybox'}", timeout_s=60)
    sandbox = await service.ready(image="host", timeout_s=60)
    # The control: a file beside the state folder, on the same mount, shows.
    control = await run(service, sandbox.id, f"cat {state_folder.control}")
    assert control.stdout == b"visible", control
    late = state_folder.root / "logs" / "late.log"  # made after the sandbox started
    late.parent.mkdir()
    late.write_text(state_folder.token)
    targets = {
        "state folder etcd db": state_folder.etcd_db,
        "profile token": state_folder.profile,
        "the service's secrets key": tmp_path / "secrets.key",  # tests/conftest.py's
        "a file made after the start": late,
        "etcd data dir": etcd.data_dir / "member" / "snap" / "db",
        "another sandbox's state file": Path(local_runtime.config.state_dir) / f"{other.id}.json",
        "another sandbox's agent log": Path(local_runtime.config.workspace_dir)
        / other.id
        / "agent.log",
    }
    for name, path in targets.items():
        attack.tried(f"host image reads {name}")
        assert path.exists(), path
        shown = await run(service, sandbox.id, f"cat {path}; ls -a {path.parent}")
        assert state_folder.token.encode() not in shown.stdout, (name, shown)
        assert other.id.encode() not in shown.stdout, (name, shown)
        assert b"SECRET" not in shown.stdout, (name, shown)
        assert (tmp_path / "secrets.key").read_bytes().strip() not in shown.stdout, name
        attack.held(f"host image reads {name}")
    attack.tried("host image writes into the masked state folder")
    wrote = await run(service, sandbox.id, f"echo x > {state_folder.root}/planted")
    assert wrote.status.exit_code != 0 and not (state_folder.root / "planted").exists()
    attack.held("host image writes into the masked state folder")
    attack.tried("host image reads the service's /proc entry")
    service_proc = await run(service, sandbox.id, f"cat /proc/{os.getpid()}/environ")
    assert service_proc.status.exit_code != 0 and service_proc.stdout == b"", service_proc
    attack.held("host image reads the service's /proc entry")


async def test_runtime_state_dirs_are_refused_when_the_runtime_is_asked_directly(
    local_runtime: Any, allowed_dir: Path, attack: Any
) -> None:
    from orchard.env.images import ImageTrust
    from orchard.env.runtime.base import RuntimeFailure, RuntimeSandboxSpec

    trust = ImageTrust(tenant="beta", allow_host=False, allowed_paths=(str(allowed_dir),))
    (allowed_dir / "state-link").symlink_to(local_runtime.config.state_dir)
    for image in ("host", f"rootfs:{allowed_dir / 'state-link'}", "rootfs:/proc/self/root"):
        attack.tried(f"runtime.create {image}")
        spec = RuntimeSandboxSpec(
            sandbox_id=f"t-{uuid.uuid4().hex[:8]}", image=image, image_trust=trust
        )
        with pytest.raises(RuntimeFailure) as caught:
            await local_runtime.create(spec)
        assert caught.value.reason.value == "IMAGE_NOT_ALLOWED", caught.value.message
        attack.held(f"runtime.create {image}")
    await asyncio.sleep(0)
    assert await local_runtime.list_sandboxes() == []


def test_the_sandbox_setup_refuses_a_layer_path_swapped_for_a_symlink(tmp_path: Path) -> None:
    """The last check before the overlay mount: the runtime hands over resolved paths, so a
    path that resolves elsewhere now was changed after the runtime's check."""
    from orchard.env.runtime.local import sandbox_init

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "image").symlink_to(tmp_path / "elsewhere")
    plan = {
        "root": str(tmp_path / "root"),
        "lower_dirs": [str(tmp_path / "image")],
        "upper_dir": str(tmp_path / "upper"),
        "work_dir": str(tmp_path / "work"),
    }
    with pytest.raises(sandbox_init.SetupError) as caught:
        sandbox_init.build_root(plan)
    assert caught.value.reason == "IMAGE_NOT_ALLOWED"
    assert not (tmp_path / "root").exists()  # refused before anything was mounted or made
