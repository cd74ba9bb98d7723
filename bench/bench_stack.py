"""A private etcd + orchard-env (local runtime) for a bench script, removed afterwards."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from orchard.sdk.cli.bench import _free_port
from orchard.sdk.cli.host_probe import remove_cgroup_parent
from orchard.sdk.cli.stack import LocalStack


@contextlib.contextmanager
def private_env_stack(name: str, settings: Sequence[str] = ()) -> Iterator[tuple[LocalStack, str]]:
    """The started stack and its token (``settings``: orchard-env's ``KEY=VALUE`` settings);
    its state folder, run folder and cgroup parent (``orchard-<name>-<tag>``) go when the block
    ends. Needs root."""
    tag = secrets.token_hex(3)
    state = Path(tempfile.mkdtemp(prefix=f"orchard-{name}-"))
    run_dir = f"/run/orchard-bench-{tag}"  # short: sandbox socket paths must fit 107 bytes
    cgroup = f"orchard-{name}-{tag}"
    token = secrets.token_urlsafe(24)
    stack = LocalStack(
        state,
        listen=f"127.0.0.1:{_free_port()}",
        token=token,
        runtime={"cgroup_parent": cgroup, "run_dir": run_dir},
        settings=settings,
    )
    try:
        stack.start()
        yield stack, token
    finally:
        stack.stop()
        remove_cgroup_parent(cgroup)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
