"""The TypeScript/Node client (clients/node) against a real orchard-env: it is built from protos/
here, then its own tests (`node --test`) create, wait, exec, upload, download and delete a
sandbox and decode the ErrorInfo of refused calls, with no Python on the client side.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.root, pytest.mark.slow]

CLIENT = Path(__file__).resolve().parents[2] / "clients" / "node"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found on PATH (make setup installs it)")
    return path


@pytest.fixture(scope="module")
def built_client() -> Path:
    """The client compiled from the current protos/ and sources (dist/)."""
    if not (CLIENT / "node_modules" / ".package-lock.json").is_file():
        pytest.fail("clients/node has no node_modules: run `make setup` (npm ci)")
    done = subprocess.run(
        [_tool("npm"), "run", "--silent", "build"],
        cwd=CLIENT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"npm run build failed:\n{done.stdout}\n{done.stderr}"
    return CLIENT


def test_node_client_against_a_real_env(built_client: Path, env_stack: Any) -> None:
    env = {**os.environ, "ORCHARD_ENDPOINT": env_stack.endpoint, "ORCHARD_TOKEN": env_stack.token}
    done = subprocess.run(
        [_tool("node"), "--test", "--test-reporter=spec", "test/"],
        cwd=built_client,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    report = f"{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, report
    assert re.search(r"\bpass 3\b", report), report  # every Node test ran and passed


def test_package_version_matches_its_changelog() -> None:
    version = json.loads((CLIENT / "package.json").read_text())["version"]
    lock = json.loads((CLIENT / "package-lock.json").read_text())
    heading = re.search(r"^## (\S+)", (CLIENT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert heading is not None, "clients/node/CHANGELOG.md has no `## <version>` entry"
    assert heading.group(1) == version == lock["version"]
