"""The blocking client: :class:`SandboxClient` and its sandbox handle :class:`Sandbox`.

It runs :class:`~orchard.sdk.aio.AsyncSandboxClient` on a private event-loop thread, so both
clients share one implementation of retries, error mapping, transfers and heartbeats, and the
heartbeats keep going while your thread blocks. Example::

    from orchard.sdk import SandboxClient

    with SandboxClient() as client:                     # endpoint/token from env or profile
        with client.create(image="host", heartbeat_timeout=60) as sandbox:
            sandbox.write_file("/workspace/hello.py", "print('hello')\\n")
            print(sandbox.exec(["python3", "/workspace/hello.py"]).check().stdout_text)
        # the sandbox is deleted here

Ctrl-C during a call cancels it (an interrupted ``exec`` kills the command).
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Iterator, Mapping, Sequence

from orchard.sdk._loop import LoopThread
from orchard.sdk.aio import AsyncSandbox, AsyncSandboxClient, TransferProgress
from orchard.sdk.connection import ConnectionSettings
from orchard.sdk.retry import RetryPolicy
from orchard.sdk.types import (
    EgressRule,
    ExecEvent,
    ExecResult,
    FileInfo,
    Resources,
    SandboxInfo,
    SandboxState,
)

__all__ = ["Sandbox", "SandboxClient"]


class SandboxClient:
    """A blocking connection to the environment service.

    Arguments as for :class:`~orchard.sdk.aio.AsyncSandboxClient`: ``endpoint`` and ``token``
    default to ``$ORCHARD_ENDPOINT``/``$ORCHARD_TOKEN``, then the profile ``orchard up`` writes;
    ``tls``, ``tls_ca_file`` (default ``$ORCHARD_TLS_CA``), ``allow_insecure`` and
    ``direct_agent`` (exec straight on each sandbox's agent) as there.
    Use it as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        token: str | None = None,
        profile: str | os.PathLike[str] | None = None,
        retry: RetryPolicy | None = None,
        timeout: float = 30.0,
        tls: bool | None = None,
        tls_ca_file: str | os.PathLike[str] | None = None,
        allow_insecure: bool = False,
        direct_agent: bool = False,
    ) -> None:
        # Resolve (and fail on a bad configuration) before starting a thread.
        self._async = AsyncSandboxClient(
            endpoint,
            token=token,
            profile=profile,
            retry=retry,
            timeout=timeout,
            tls=tls,
            tls_ca_file=tls_ca_file,
            allow_insecure=allow_insecure,
            direct_agent=direct_agent,
        )
        self._loop = LoopThread()

    @property
    def settings(self) -> ConnectionSettings:
        """The resolved endpoint and token, and where they came from."""
        return self._async.settings

    @property
    def endpoint(self) -> str:
        return self._async.endpoint

    @property
    def async_client(self) -> AsyncSandboxClient:
        """The async client underneath (its coroutines run only on this client's loop)."""
        return self._async

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every handle's heartbeats (sandboxes are not deleted), close the channel and
        the loop thread. Idempotent."""
        if not self._loop_closed:
            self._loop.run(self._async.close())
            self._loop.close()

    @property
    def _loop_closed(self) -> bool:
        return self._loop._closed

    def create(
        self,
        image: str = "host",
        *,
        labels: Mapping[str, str] | None = None,
        resources: Resources | None = None,
        heartbeat_timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        working_dir: str = "",
        owner_id: str = "",
        egress: Sequence[EgressRule] = (),
        ingress_ports: Sequence[int] = (),
        user_namespaces: bool = False,
        raw_sockets: bool = False,
        wait: bool = True,
        wait_timeout: float | None = 600.0,
        keep_alive: bool = True,
        request_id: str | None = None,
    ) -> Sandbox:
        """Create a sandbox and (by default) wait until it is READY; see
        :meth:`AsyncSandboxClient.create <orchard.sdk.aio.AsyncSandboxClient.create>`::

            with client.create(image="host", labels={"task": "t1"}, heartbeat_timeout=60) as sb:
                sb.exec("echo hi", check=True)
        """
        creation = self._async.create(
            image,
            labels=labels,
            resources=resources,
            heartbeat_timeout=heartbeat_timeout,
            env=env,
            working_dir=working_dir,
            owner_id=owner_id,
            egress=egress,
            ingress_ports=ingress_ports,
            user_namespaces=user_namespaces,
            raw_sockets=raw_sockets,
            wait=wait,
            wait_timeout=wait_timeout,
            keep_alive=keep_alive,
            request_id=request_id,
        )

        async def create() -> AsyncSandbox:
            return await creation

        return Sandbox(self, self._loop.run(create()))

    def get(self, sandbox_id: str, *, keep_alive: bool = False) -> Sandbox:
        """A handle to an existing sandbox; ``keep_alive=True`` heartbeats it while open.

        Raises :class:`~orchard.sdk.errors.SandboxNotFound`.
        """
        return Sandbox(self, self._loop.run(self._async.get(sandbox_id, keep_alive=keep_alive)))

    def get_info(self, sandbox_id: str) -> SandboxInfo:
        """The sandbox as the service describes it now. Raises ``SandboxNotFound``."""
        return self._loop.run(self._async.get_info(sandbox_id))

    def list(
        self,
        label_selector: str | Mapping[str, str] = "",
        *,
        states: Sequence[SandboxState] = (),
        page_size: int = 100,
    ) -> Iterator[SandboxInfo]:
        """Every matching sandbox of the caller's tenant, fetched a page at a time::

        for info in client.list("task=demo"):
            print(info.id, info.state.value)
        """
        return self._loop.iterate(
            self._async.list(label_selector, states=states, page_size=page_size)
        )

    def list_page(
        self,
        label_selector: str | Mapping[str, str] = "",
        *,
        states: Sequence[SandboxState] = (),
        page_size: int = 100,
        page_token: str = "",
    ) -> tuple[builtins.list[SandboxInfo], str]:
        """One page of :meth:`list` and the token of the next ("" after the last)."""
        return self._loop.run(
            self._async.list_page(
                label_selector, states=states, page_size=page_size, page_token=page_token
            )
        )

    def delete(self, sandbox_id: str) -> None:
        """Delete a sandbox; succeeds when it is already gone."""
        self._loop.run(self._async.delete(sandbox_id))


class Sandbox:
    """A blocking handle to one sandbox; ``with`` deletes it on exit.

    :meth:`close` only stops the background heartbeats and leaves the sandbox running.
    """

    def __init__(self, client: SandboxClient, handle: AsyncSandbox) -> None:
        self.client = client
        self._handle = handle
        self._loop = client._loop

    @property
    def id(self) -> str:
        """The sandbox id, e.g. ``"sbx-8f3c2a1d9e7b"``."""
        return self._handle.id

    @property
    def info(self) -> SandboxInfo:
        """The sandbox as last seen (see :meth:`refresh`)."""
        return self._handle.info

    @property
    def state(self) -> SandboxState:
        return self._handle.state

    @property
    def heartbeat_error(self) -> Exception | None:
        """Why background heartbeats failed last (e.g. ``SandboxNotFound``), or None."""
        return self._handle.heartbeat_error

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.state.value}>"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.delete()

    def refresh(self) -> SandboxInfo:
        """Fetch the current description into :attr:`info` and return it."""
        return self._loop.run(self._handle.refresh())

    def wait(self, timeout: float | None = 600.0) -> SandboxInfo:
        """Wait until READY; raises ``SandboxFailed`` or ``DeadlineExceeded``."""
        return self._loop.run(self._handle.wait(timeout))

    def update_egress(self, egress: Sequence[EgressRule]) -> SandboxInfo:
        """Replace what the sandbox may reach; see ``AsyncSandbox.update_egress``."""
        return self._loop.run(self._handle.update_egress(egress))

    def heartbeat(self) -> float:
        """Renew the lease now; returns the new expiry as a Unix time."""
        return self._loop.run(self._handle.heartbeat())

    def close(self) -> None:
        """Stop background heartbeats; the sandbox runs until its lease expires."""
        if not self.client._loop_closed:
            self._loop.run(self._handle.close())

    def delete(self) -> None:
        """Stop heartbeats and delete the sandbox (idempotent)."""
        self._loop.run(self._handle.delete())

    def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        clear_env: bool = False,
        output_limit: int | None = None,
        check: bool = False,
    ) -> ExecResult:
        """Run a command to completion (argv list, or a string for ``/bin/sh -c``)::

        result = sandbox.exec(["ls", "-l"], cwd="/workspace", timeout=10)
        print(result.exit_code, result.stdout_text)
        sandbox.exec("make test", check=True)   # raises CommandFailed unless it exits 0
        """
        return self._loop.run(
            self._handle.exec(
                command,
                timeout=timeout,
                stdin=stdin,
                env=env,
                cwd=cwd,
                clear_env=clear_env,
                output_limit=output_limit,
                check=check,
            )
        )

    def exec_stream(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        clear_env: bool = False,
    ) -> Iterator[ExecEvent]:
        """Run a command and iterate over its events (``ExecStarted``, ``ExecStdout``,
        ``ExecStderr``, ``ExecExit``) as they happen; breaking out kills the command::

            for event in sandbox.exec_stream("pip install -e ."):
                if isinstance(event, ExecStdout):
                    sys.stdout.buffer.write(event.data)
        """
        return self._loop.iterate(
            self._handle.exec_stream(
                command, timeout=timeout, stdin=stdin, env=env, cwd=cwd, clear_env=clear_env
            )
        )

    def write_file(
        self,
        path: str,
        data: bytes | str,
        *,
        mode: int = 0o644,
        make_parents: bool = True,
        no_overwrite: bool = False,
    ) -> FileInfo:
        """Write ``data`` to ``path`` atomically; returns the new file's info."""
        return self._loop.run(
            self._handle.write_file(
                path, data, mode=mode, make_parents=make_parents, no_overwrite=no_overwrite
            )
        )

    def read_file(self, path: str, *, offset: int = 0, limit: int = 0) -> bytes:
        """The content of ``path`` (from ``offset``, at most ``limit`` bytes; 0 = all)."""
        return self._loop.run(self._handle.read_file(path, offset=offset, limit=limit))

    def stat(self, path: str, *, follow_symlinks: bool = False) -> FileInfo:
        """Describe ``path``; raises ``FileNotFound``."""
        return self._loop.run(self._handle.stat(path, follow_symlinks=follow_symlinks))

    def exists(self, path: str) -> bool:
        """True when ``path`` exists."""
        return self._loop.run(self._handle.exists(path))

    def list_files(self, path: str) -> list[FileInfo]:
        """Entries of a directory, sorted by name."""
        return self._loop.run(self._handle.list_files(path))

    def upload(
        self,
        local_path: str | os.PathLike[str],
        remote_path: str,
        *,
        progress: TransferProgress | None = None,
    ) -> int:
        """Copy a local file or tree to ``remote_path`` (which becomes the copy); returns bytes
        written. ``progress(done, total)`` is called as bytes go."""
        return self._loop.run(self._handle.upload(local_path, remote_path, progress=progress))

    def download(
        self,
        remote_path: str,
        local_path: str | os.PathLike[str],
        *,
        progress: TransferProgress | None = None,
    ) -> int:
        """Copy a sandbox file or tree to ``local_path`` (which becomes the copy); returns
        bytes read."""
        return self._loop.run(self._handle.download(remote_path, local_path, progress=progress))

    def apply_diff(
        self, diff: str | bytes, *, cwd: str | None = None, strip: int = 1
    ) -> ExecResult:
        """Apply a unified diff at ``cwd`` with ``git apply`` or ``patch``; raises
        :class:`~orchard.sdk.errors.PatchFailed` with the tool's output when it does not apply.
        """
        return self._loop.run(self._handle.apply_diff(diff, cwd=cwd, strip=strip))
