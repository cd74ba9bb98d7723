"""The Claw apps in real sandboxes: etcd and orchard-env with the local runtime (root), one
``host``-image sandbox holding the tools and the MCP dependencies as a task's files would put
them there, the seed state laid out by the task's own setup commands."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from orchard.sdk import AsyncSandbox, AsyncSandboxClient
from orchard.sdk.cli.host_probe import remove_cgroup_parent
from orchard.sdk.cli.stack import LocalStack, StackError
from orchard.tasks.claw.bundle import (
    MCP_COMMAND,
    STATE_DIR,
    TOOLS_DIR,
    link_command,
    mcp_archive,
    seed_command,
    tools_archive,
)
from orchard.tasks.claw.suite import FAMILIES, ClawTask, make_task
from orchard.tasks.claw.synthesis import ScriptedGenerator, synthesize

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def env_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """etcd and orchard-env with their own cgroup parent and run dir, removed at the end."""
    if os.geteuid() != 0:
        pytest.fail("the local runtime needs root: run the tests as root")
    run_dir = Path(tempfile.mkdtemp(prefix="oc-"))  # sandbox socket paths must stay short
    cgroup_parent = f"orchard-claw-{uuid.uuid4().hex[:8]}"
    stack = LocalStack(
        tmp_path_factory.mktemp("claw-stack"),
        listen=f"127.0.0.1:{_free_port()}",
        token=secrets.token_urlsafe(16),
        runtime={"cgroup_parent": cgroup_parent, "run_dir": str(run_dir)},
    )
    try:
        stack.start()
        yield stack
    except StackError as exc:
        pytest.fail(str(exc))
    finally:
        stack.stop()
        remove_cgroup_parent(cgroup_parent)
        shutil.rmtree(run_dir, ignore_errors=True)


async def _unpack(sandbox: AsyncSandbox, data: bytes, folder: str) -> None:
    staged = f"/tmp/claw-{uuid.uuid4().hex[:8]}.tar.gz"
    await sandbox.write_file(staged, data)
    await sandbox.exec(
        f"mkdir -p {folder} && tar -xzf {staged} -C {folder} && rm {staged}",
        check=True,
        timeout=120,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox(env_stack: LocalStack) -> AsyncIterator[AsyncSandbox]:
    async with (
        AsyncSandboxClient(env_stack.endpoint, token=env_stack.token) as client,
        client.create(image="host", heartbeat_timeout=120) as box,
    ):
        await _unpack(box, tools_archive(), TOOLS_DIR)
        await _unpack(box, mcp_archive(), TOOLS_DIR)
        await box.exec(link_command(), check=True)
        yield box


async def _seed(sandbox: AsyncSandbox, task: ClawTask) -> None:
    await sandbox.exec(f"rm -rf {STATE_DIR}", check=True)
    await sandbox.exec(seed_command(task.world.archive()), check=True)


async def _score(sandbox: AsyncSandbox, task: ClawTask) -> float:
    part = {}
    for name in ("completion", "safety", "robustness"):
        checks = task.part(name)
        passed = [(await sandbox.exec(c.command(), timeout=60)).exit_code == 0 for c in checks]
        part[name] = sum(passed) / len(checks)
    return part["safety"] * (0.8 * part["completion"] + 0.2 * part["robustness"])


async def test_every_family_fails_on_the_seed_and_passes_after_the_solution(
    sandbox: AsyncSandbox,
) -> None:
    for index, family in enumerate(FAMILIES):
        task = make_task(11, family, index % 3)
        await _seed(sandbox, task)
        assert await _score(sandbox, task) < 0.75, task.id
        for command in task.solution:
            result = await sandbox.exec(command, timeout=60)
            assert result.exit_code == 0, (task.id, command, result.stderr_text)
        assert await _score(sandbox, task) == 1.0, task.id


async def test_the_tools_run_on_the_sandbox_python_and_path(sandbox: AsyncSandbox) -> None:
    await _seed(sandbox, make_task(0, "reply_mail", 0))
    which = await sandbox.exec(
        "for app in mail calendar contacts notes docs; do command -v $app; done", check=True
    )
    assert which.stdout_text.split() == [
        f"/usr/local/bin/{a}" for a in ("mail", "calendar", "contacts", "notes", "docs")
    ]
    first = await sandbox.exec("mail list --limit 1", check=True)
    assert json.loads(first.stdout_text)[0]["id"].startswith("m")
    missing = await sandbox.exec("mail read m404")
    assert missing.exit_code == 3 and "no message 'm404'" in missing.stderr_text


_MCP_CLIENT = """
import json, sys
import anyio
from mcp import Client
from mcp.client.stdio import StdioServerParameters

async def main():
    server = StdioServerParameters(command=sys.argv[1], env={"CLAW_HOME": sys.argv[2]})
    out = {}
    async with Client(server) as client:
        out["tools"] = sorted(t.name for t in (await client.list_tools()).tools)
        send = {"to": [sys.argv[3]], "subject": "Hello", "body": "from MCP"}
        for attempt in ("first", "retry"):
            result = await client.call_tool("mail_send", send)
            out[attempt] = {"error": result.is_error, "text": result.content[0].text}
        result = await client.call_tool("notes_list", {})
        out["notes"] = result.structured_content
    print(json.dumps(out))

anyio.run(main)
"""


async def test_the_mcp_server_in_the_sandbox(sandbox: AsyncSandbox) -> None:
    """The official SDK's stdio client, inside the sandbox, drives claw-mcp there: tools are
    listed, a seeded fault is a transient tool error, the retry sends, the state shows it."""
    task = next(
        make_task(5, "contact_lookup_send", i)
        for i in range(40)
        if make_task(5, "contact_lookup_send", i).fault
    )
    await _seed(sandbox, task)
    recipient = task.world.people[0].email
    await sandbox.write_file("/tmp/mcp_client.py", _MCP_CLIENT.encode())
    result = await sandbox.exec(
        ["python3", "/tmp/mcp_client.py", MCP_COMMAND, STATE_DIR, recipient],
        env={"PYTHONPATH": f"{TOOLS_DIR}/site"},
        timeout=120,
    )
    assert result.exit_code == 0, result.stderr_text[-3000:]
    out = json.loads(result.stdout_text)
    assert {"mail_send", "calendar_free", "contacts_search", "notes_write", "docs_set"} <= set(
        out["tools"]
    )
    assert out["first"]["error"] and out["first"]["text"].startswith("transient:")
    assert not out["retry"]["error"] and json.loads(out["retry"]["text"])["to"] == [recipient]
    assert {n["path"] for n in out["notes"]["result"]} == {"ideas.md", "reading.md"}
    sent = await sandbox.exec("mail list --folder sent", check=True)
    assert [m["to"] for m in json.loads(sent.stdout_text)] == [[recipient]]
    log = await sandbox.exec(f"cat {STATE_DIR}/audit.log", check=True)
    entries = [json.loads(line) for line in log.stdout_text.splitlines()]
    assert [(e["via"], e["op"], e["ok"]) for e in entries][:2] == [
        ("mcp", "send", False),
        ("mcp", "send", True),
    ]
    version = await sandbox.exec("python3 -c 'import sys; print(sys.executable)'", check=True)
    assert version.stdout_text.strip().startswith("/usr/")


class _Broken:
    """A generator whose second task has lost its solution: validation must drop it."""

    rejected: list[object] = []

    def propose(self, count: int) -> list[ClawTask]:
        tasks = ScriptedGenerator(seed=4).propose(count)
        return [tasks[0], dataclasses.replace(tasks[1], solution=())]


async def test_synthesis_keeps_what_validates_and_says_why_others_go(
    env_stack: LocalStack,
) -> None:
    async with AsyncSandboxClient(env_stack.endpoint, token=env_stack.token) as client:
        result = await synthesize(ScriptedGenerator(seed=4), client, 2)
        assert [t.family for t in result.kept] == ["reply_mail", "forward_mail"]
        assert result.dropped == []
        broken = await synthesize(_Broken(), client, 2)
    assert [t.id for t in broken.kept] == ["claw/4/reply_mail/0"]
    assert [d.task_id for d in broken.dropped] == ["claw/4/forward_mail/0"]
    assert "after the solution the score is" in broken.dropped[0].reason
