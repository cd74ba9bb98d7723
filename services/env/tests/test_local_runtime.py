"""The local runtime beyond the conformance suite: configuration, prerequisites, cgroups,
start failures and their cleanup."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from orchard.env.runtime import create_runtime
from orchard.env.runtime.base import (
    EgressRule,
    FailureReason,
    RuntimeFailure,
    RuntimeNotSupported,
    RuntimeResources,
    RuntimeSandboxSpec,
    RuntimeUnavailable,
    SandboxStatus,
)
from orchard.env.runtime.local import LocalRuntime, LocalRuntimeConfig
from orchard.env.runtime.local import runtime as runtime_module
from orchard.env.runtime.local.cgroups import CgroupV1, select_cgroup_driver
from orchard.env.runtime.local.config import default_agent_bundle

BUNDLE_READY = os.access(os.path.join(default_agent_bundle(), "orchard-inagent"), os.X_OK)
NOBODY = 65534


@pytest.fixture
def config(tmp_path: Path) -> Iterator[LocalRuntimeConfig]:
    run_dir = tempfile.mkdtemp(prefix="orc-")
    try:
        yield LocalRuntimeConfig(
            state_dir=str(tmp_path / "state"),
            workspace_dir=str(tmp_path / "sandboxes"),
            run_dir=run_dir,
            cgroup_parent=f"orchard-test-{uuid.uuid4().hex[:8]}",
        )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_config_is_strict_and_the_factory_builds_it(config: LocalRuntimeConfig) -> None:
    with pytest.raises(ValidationError):
        LocalRuntimeConfig.model_validate({"type": "local", "stat_dir": "/x"})
    with pytest.raises(ValidationError):
        LocalRuntimeConfig.model_validate({"type": "kubernetes"})
    runtime = create_runtime({"type": "local", "state_dir": config.state_dir})
    assert isinstance(runtime, LocalRuntime) and runtime.config.state_dir == config.state_dir
    assert isinstance(create_runtime(config), LocalRuntime)
    with pytest.raises(ValueError, match="unknown runtime type"):
        create_runtime({"type": "nomad"})


def test_importing_the_factory_does_not_import_backends() -> None:
    code = (
        "import sys, orchard.env.runtime\n"
        "assert 'orchard.env.runtime.local' not in sys.modules\n"
        "assert 'pydantic' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_a_missing_bundle_is_unavailable_with_the_fix(config: LocalRuntimeConfig) -> None:
    runtime = LocalRuntime(config.model_copy(update={"agent_bundle": "/nonexistent/bundle"}))
    with pytest.raises(RuntimeUnavailable, match="make inagent-binary"):
        await runtime.start()


async def test_a_long_run_dir_is_unavailable(config: LocalRuntimeConfig) -> None:
    runtime = LocalRuntime(config.model_copy(update={"run_dir": "/run/" + "x" * 60}))
    with pytest.raises(RuntimeUnavailable, match="too long"):
        await runtime.start()


def _start_exit_code(config: LocalRuntimeConfig) -> int:
    """3 when the runtime refuses to start with "needs root", another code otherwise."""
    try:
        asyncio.run(LocalRuntime(config).start())
    except RuntimeUnavailable as exc:
        return 3 if "needs root" in str(exc) else 4
    except BaseException:
        return 5
    return 0


def test_not_root_is_unavailable(config: LocalRuntimeConfig) -> None:
    if os.geteuid() != 0:
        assert _start_exit_code(config) == 3
        return
    # As root: the same start in a forked child that became nobody (the interpreter is loaded
    # already, so nobody needs no access to it).
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 6
        try:
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            code = _start_exit_code(config)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3


@pytest.mark.root
def test_cgroup_driver_matches_the_host(config: LocalRuntimeConfig) -> None:
    driver = select_cgroup_driver(config.cgroup_parent, "auto")
    with open("/proc/self/mountinfo", encoding="utf-8") as file:
        has_v1_memory = any(" - cgroup " in line and "memory" in line for line in file)
    if isinstance(driver, CgroupV1):
        assert has_v1_memory
        assert all(p.endswith(f"/{config.cgroup_parent}") for p in driver.parents)


@pytest.mark.root
def test_remove_tree_stays_inside_the_tree_and_spawns_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "outside"
    (outside / "kept").mkdir(parents=True)
    (outside / "kept" / "file").write_text("host data")
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "file").write_text("x")
    os.mkfifo(tree / "a" / "fifo")
    (tree / "to_dir").symlink_to(outside / "kept")  # a sandbox's symlinks are removed, not followed
    (tree / "a" / "to_file").symlink_to(outside / "kept" / "file")
    # Not a stand-in for anything: it fails the test if the common case starts an `rm`.
    with monkeypatch.context() as patch:
        patch.setattr(runtime_module.subprocess, "run", _no_process)
        runtime_module.remove_tree(str(tree))
    assert not tree.exists()
    assert (outside / "kept" / "file").read_text() == "host data"

    # Another file system mounted inside is never walked into: the delete fails, it stays whole.
    mounted = tmp_path / "tree2" / "m"
    mounted.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mounted)], check=True)
    try:
        (mounted / "file").write_text("other file system")
        with pytest.raises(RuntimeFailure, match="cannot remove"):
            runtime_module.remove_tree(str(tmp_path / "tree2"))
        assert (mounted / "file").read_text() == "other file system"
    finally:
        subprocess.run(["umount", str(mounted)], check=True)
    runtime_module.remove_tree(str(tmp_path / "tree2"))
    assert not (tmp_path / "tree2").exists()


def _no_process(*args: object, **kwargs: object) -> None:
    raise AssertionError(f"remove_tree started a process: {args}")


@pytest.mark.root
class TestWithTheAgent:
    @pytest.fixture(autouse=True)
    def _bundle(self) -> None:
        if not BUNDLE_READY:
            pytest.fail("needs the agent bundle: make inagent-binary")

    async def test_limits_land_in_the_cgroup(self, config: LocalRuntimeConfig) -> None:
        runtime = LocalRuntime(config)
        await runtime.start()
        try:
            resources = RuntimeResources(cpu_millis=500, memory_bytes=300 << 20, pids=77)
            await runtime.create(RuntimeSandboxSpec("limits", "host", resources=resources))
            state = runtime.store.read("limits")
            assert state is not None
            driver = runtime._driver()
            assert driver.tasks(state.cgroup_dirs) >= {state.pid}
            if isinstance(driver, CgroupV1):
                by = {c: f"{p}/limits" for c, p in driver.by_controller.items()}
                assert Path(by["memory"], "memory.limit_in_bytes").read_text() == "314572800\n"
                assert Path(by["pids"], "pids.max").read_text() == "77\n"
                assert Path(by["cpu"], "cpu.cfs_quota_us").read_text() == "50000\n"
            await runtime.delete("limits")
        finally:
            await runtime.close()
            assert runtime.remove_cgroup_parents() == []

    async def test_a_tree_nested_thousands_deep_is_deleted(
        self, config: LocalRuntimeConfig
    ) -> None:
        # A sandbox can nest directories far deeper than a recursive removal follows; its
        # delete must still remove everything (it failed with RecursionError and leaked).
        runtime = LocalRuntime(config)
        await runtime.start()
        try:
            await runtime.create(RuntimeSandboxSpec("deep", "host"))
            state = runtime.store.read("deep")
            assert state is not None
            fd = os.open(state.paths.upper, os.O_RDONLY | os.O_DIRECTORY)
            for _ in range(3000):  # what `mkdir -p a/a/a/...` in the sandbox leaves
                os.mkdir("a", dir_fd=fd)
                inner = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = inner
            os.close(fd)
            await runtime.delete("deep")
            assert not os.path.lexists(state.paths.workspace)
            assert await runtime.list_sandboxes() == []
        finally:
            await runtime.close()
            assert runtime.remove_cgroup_parents() == []

    async def test_start_timeout_fails_and_cleans_up(
        self, config: LocalRuntimeConfig, tmp_path: Path
    ) -> None:
        # An agent forked from the zygote can serve within milliseconds, so a short timeout alone
        # does not make a start slow: the agent is executed through a bundle whose executable
        # first sleeps well past the timeout ("host" images see the real bundle at its path).
        real_agent = os.path.realpath(os.path.join(config.agent_bundle, "orchard-inagent"))
        slow_bundle = tmp_path / "slow-bundle"
        slow_bundle.mkdir()
        wrapper = slow_bundle / "orchard-inagent"
        wrapper.write_text(f'#!/bin/sh\nsleep 5\nexec {real_agent} "$@"\n')
        wrapper.chmod(0o755)
        runtime = LocalRuntime(
            config.model_copy(
                update={
                    "start_timeout_s": 0.5,
                    "agent_launch": "exec",
                    "agent_bundle": str(slow_bundle),
                }
            )
        )
        await runtime.start()
        try:
            with pytest.raises(RuntimeFailure) as caught:
                await runtime.create(RuntimeSandboxSpec("slow", "host"))
            assert caught.value.reason is FailureReason.AGENT_START_TIMEOUT
            assert await runtime.status("slow") is SandboxStatus.ABSENT
            assert await runtime.list_sandboxes() == []
        finally:
            await runtime.close()
            assert runtime.remove_cgroup_parents() == []

    # A forked agent shares the zygote's pages (charged to the zygote's cgroup), so it needs
    # less of the sandbox's own memory to start than an executed one.
    @pytest.mark.parametrize(("launch", "limit"), [("exec", 8 << 20), ("zygote", 3 << 20)])
    async def test_too_little_memory_to_start_is_out_of_memory(
        self, config: LocalRuntimeConfig, launch: str, limit: int
    ) -> None:
        runtime = LocalRuntime(config.model_copy(update={"agent_launch": launch}))
        await runtime.start()
        try:
            with pytest.raises(RuntimeFailure) as caught:
                tiny = RuntimeResources(memory_bytes=limit)
                await runtime.create(RuntimeSandboxSpec("tiny", "host", resources=tiny))
            assert caught.value.reason is FailureReason.OUT_OF_MEMORY
            assert await runtime.list_sandboxes() == []
        finally:
            await runtime.close()
            assert runtime.remove_cgroup_parents() == []

    async def test_refusals_change_nothing(self, config: LocalRuntimeConfig) -> None:
        runtime = LocalRuntime(config)
        await runtime.start()
        try:
            # An IPv6 destination: refused without any name lookup or packet leaving the host.
            rule = EgressRule("2001:db8::/32")
            with pytest.raises(RuntimeNotSupported, match="egress"):
                await runtime.create(RuntimeSandboxSpec("egress", "host", egress=[rule]))
            with pytest.raises(RuntimeFailure, match="not running"):
                await runtime.fork("a", RuntimeSandboxSpec("b", "host"))
            with pytest.raises(ValueError, match="sandbox id"):
                await runtime.create(RuntimeSandboxSpec("../escape", "host"))
            assert await runtime.list_sandboxes() == []
        finally:
            await runtime.close()
            assert runtime.remove_cgroup_parents() == []
