"""``orchard.inagent.v1.AgentService``: the gRPC face of the exec and file machinery.

Handlers raise :class:`~orchard.core.errors.OrchardError` or ``OSError``; the server's error
interceptor turns both into status codes with an ``ErrorInfo`` reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator

import grpc
from google.protobuf import duration_pb2

from orchard.core.errors import OrchardError, Reason
from orchard.inagent.commands import CommandSpec, ExecLimits, prepare_command
from orchard.inagent.decoding import register_guarded
from orchard.inagent.files import AtomicWriter, FileReader, list_files, stat_file
from orchard.inagent.paths import display
from orchard.inagent.process import OutputQueue, ProcessResult, ProcessSupervisor, Stream
from orchard.inagent.reasons import AgentReason
from orchard.inagent.v1 import inagent_service_pb2 as pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as pb_grpc
from orchard.inagent.version import __version__
from orchard.types.v1 import exec_pb2

__all__ = ["SERVICE_NAME", "AgentServicer", "identity_proof"]

SERVICE_NAME = "orchard.inagent.v1.AgentService"
NONCE_BYTES = (16, 64)
"""Shortest and longest nonce ProveIdentity accepts."""
MAX_SANDBOX_ID_BYTES = 253

log = logging.getLogger(__name__)


def _duration(seconds: float) -> duration_pb2.Duration:
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=round((seconds - whole) * 1e9))


def identity_proof(key: bytes, nonce: bytes, sandbox_id: str) -> bytes:
    """HMAC-SHA256(key, nonce || sandbox_id): the answer to ProveIdentity (see the proto)."""
    return hmac.new(key, nonce + sandbox_id.encode(), hashlib.sha256).digest()


def exit_status(result: ProcessResult) -> exec_pb2.ExitStatus:
    """The contract's ExitStatus for a finished command."""
    status = exec_pb2.ExitStatus()
    fill_exit_status(status, result)
    return status


def fill_exit_status(status: exec_pb2.ExitStatus, result: ProcessResult) -> None:
    """Write ``result`` into ``status`` in place (a message passed to a constructor is copied)."""
    status.timed_out = result.timed_out
    whole = int(result.duration_s)
    status.duration.seconds = whole
    status.duration.nanos = round((result.duration_s - whole) * 1e9)
    status.stdout_bytes = result.stdout_bytes
    status.stderr_bytes = result.stderr_bytes
    status.stdout_truncated = result.stdout_truncated
    status.stderr_truncated = result.stderr_truncated
    if result.signal is not None:
        status.signal = result.signal
    else:
        status.exit_code = result.exit_code or 0


class AgentServicer(pb_grpc.AgentServiceServicer):
    """Runs commands and moves files for the environment service."""

    def __init__(
        self,
        *,
        supervisor: ProcessSupervisor,
        working_dir: bytes,
        base_env: dict[str, str],
        limits: ExecLimits,
        shell: str = "/bin/sh",
        identity_key: bytes | None = None,
    ) -> None:
        self.supervisor = supervisor
        self._identity_key = identity_key or None
        self.working_dir = working_dir
        self.base_env = base_env
        self.limits = limits
        self.shell = shell
        self.started_at = time.monotonic()

    def register(self, server: grpc.aio.Server) -> None:
        """Add this service to ``server``, malformed requests answered INVALID_ARGUMENT."""
        register_guarded(pb_grpc.add_AgentServiceServicer_to_server, self, server)

    def _prepare(self, command: exec_pb2.Command) -> CommandSpec:
        return prepare_command(
            command,
            working_dir=self.working_dir,
            base_env=self.base_env,
            limits=self.limits,
            shell=self.shell,
        )

    # --- exec

    async def Exec(
        self, request: pb.ExecRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExecResponse:
        return await self.run(request)

    async def run(self, request: pb.ExecRequest) -> pb.ExecResponse:
        """Exec's work, for gRPC and the exec lane alike; cancelling it kills the command's
        process group."""
        command = await self.supervisor.spawn_when_possible(self._prepare(request.command))
        result = await command.wait()
        response = pb.ExecResponse()
        fill_exit_status(response.result.status, result)
        response.result.stdout = result.stdout
        response.result.stderr = result.stderr
        return response

    async def ExecStream(
        self, request: pb.ExecStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ExecStreamResponse]:
        queue = OutputQueue()
        command = await self.supervisor.spawn_when_possible(self._prepare(request.command), queue)
        try:
            yield pb.ExecStreamResponse(
                event=exec_pb2.ExecEvent(started=exec_pb2.ExecStarted(pid=command.pid))
            )
            while True:
                item = await queue.get()
                if isinstance(item, ProcessResult):
                    yield pb.ExecStreamResponse(event=exec_pb2.ExecEvent(exit=exit_status(item)))
                    return
                stream, data = item
                event = (
                    exec_pb2.ExecEvent(stdout=data)
                    if stream is Stream.STDOUT
                    else exec_pb2.ExecEvent(stderr=data)
                )
                yield pb.ExecStreamResponse(event=event)
        finally:
            command.kill()  # a no-op once done; otherwise the call ended early (cancelled)

    # --- files

    async def WriteFile(
        self,
        request_iterator: AsyncIterator[pb.WriteFileRequest],
        context: grpc.aio.ServicerContext,
    ) -> pb.WriteFileResponse:
        writer: AtomicWriter | None = None
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("payload")
                if writer is None:
                    if kind != "header":
                        raise OrchardError(
                            Reason.INVALID_ARGUMENT,
                            "the first WriteFile message must carry the header",
                            metadata={"field": "header"},
                        )
                    header = message.header
                    writer = AtomicWriter.create(
                        header.path,
                        self.working_dir,
                        mode=header.mode,
                        make_parents=header.make_parents,
                        no_overwrite=header.no_overwrite,
                    )
                elif kind == "header":
                    raise OrchardError(
                        Reason.INVALID_ARGUMENT,
                        "only the first WriteFile message may carry a header",
                        metadata={"field": "header"},
                    )
                else:
                    writer.write(message.data)
            if writer is None:
                raise OrchardError(
                    Reason.INVALID_ARGUMENT,
                    "the WriteFile stream ended without a header",
                    metadata={"field": "header"},
                )
            info, sha256 = await writer.commit()
            return pb.WriteFileResponse(info=info, sha256=sha256)
        except (OrchardError, OSError):
            await _drain(request_iterator)
            raise
        finally:
            if writer is not None:
                writer.discard()

    async def ReadFile(
        self, request: pb.ReadFileRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ReadFileResponse]:
        reader = FileReader.open(
            request.path,
            self.working_dir,
            offset=request.offset,
            limit=request.limit,
            chunk_bytes=request.chunk_size,
        )
        try:
            yield pb.ReadFileResponse(info=reader.info, data=reader.read_chunk())
            while data := reader.read_chunk():
                yield pb.ReadFileResponse(data=data)
        finally:
            reader.close()

    async def ListFiles(
        self, request: pb.ListFilesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListFilesResponse:
        entries, token = list_files(
            request.path,
            self.working_dir,
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return pb.ListFilesResponse(entries=entries, next_page_token=token)

    async def StatFile(
        self, request: pb.StatFileRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatFileResponse:
        info = stat_file(request.path, self.working_dir, follow_symlinks=request.follow_symlinks)
        return pb.StatFileResponse(info=info)

    # --- info

    async def GetAgentInfo(
        self, request: pb.GetAgentInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetAgentInfoResponse:
        return pb.GetAgentInfoResponse(
            version=__version__,
            pid=os.getpid(),
            working_dir=display(self.working_dir)[0],
            default_timeout=_duration(self.limits.default_timeout_s),
            default_output_limit_bytes=self.limits.default_output_limit_bytes,
            max_output_limit_bytes=self.limits.max_output_limit_bytes,
            uptime=_duration(time.monotonic() - self.started_at),
        )

    # --- identity

    async def ProveIdentity(
        self, request: pb.ProveIdentityRequest, context: grpc.aio.ServicerContext
    ) -> pb.ProveIdentityResponse:
        low, high = NONCE_BYTES
        if not low <= len(request.nonce) <= high:
            raise OrchardError(
                Reason.INVALID_ARGUMENT,
                f"nonce: {len(request.nonce)} bytes; send {low} to {high} fresh random bytes",
                metadata={"field": "nonce"},
            )
        if not request.sandbox_id or len(request.sandbox_id.encode()) > MAX_SANDBOX_ID_BYTES:
            raise OrchardError(
                Reason.INVALID_ARGUMENT,
                f"sandbox_id: empty or longer than {MAX_SANDBOX_ID_BYTES} bytes",
                metadata={"field": "sandbox_id"},
            )
        if self._identity_key is None:
            raise OrchardError(
                AgentReason.AGENT_KEY_MISSING,
                "this agent was started without ORCHARD_AGENT_KEY: it holds no sandbox key to "
                "prove its identity with",
            )
        proof = identity_proof(self._identity_key, request.nonce, request.sandbox_id)
        return pb.ProveIdentityResponse(proof=proof, version=__version__)


# A status sent while the caller still streams races the caller's writes, and the caller may
# then see INTERNAL ("Internal error from Core") instead of it: a failed WriteFile first reads
# and drops what the caller still sends, within these bounds.
DRAIN_BYTES = 64 << 20
DRAIN_SECONDS = 5.0


async def _drain(messages: AsyncIterator[pb.WriteFileRequest]) -> None:
    """Read the rest of a request stream, up to the bounds; best effort before a status."""
    read = 0
    with contextlib.suppress(Exception):  # the status that follows is what the caller needs
        async with asyncio.timeout(DRAIN_SECONDS):
            async for message in messages:
                read += len(message.data)
                if read > DRAIN_BYTES:
                    return
