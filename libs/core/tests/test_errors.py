"""Errors raised by handlers reach a real client as a status code with ErrorInfo, all RPC kinds."""

from __future__ import annotations

import errno
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from orchard.core.errors import (
    ERROR_DOMAIN,
    ErrorReason,
    OrchardError,
    Reason,
    error_info,
    from_os_error,
    rich_status,
)
from orchard.core.etcd import EtcdTimeout
from orchard.core.server import GrpcServer, ServiceBinding

SERVICE = "orchard.test.v1.Faulty"


class ToyReason(ErrorReason):
    """A per-service reason table, as a service would declare its own."""

    WIDGET_JAMMED = (grpc.StatusCode.FAILED_PRECONDITION, "The widget is jammed.")


def fail(request: bytes) -> None:
    """Raise what the request names; return for anything else."""
    if request == b"not-found":
        raise OrchardError(Reason.NOT_FOUND, "no sandbox 'sb-1'", metadata={"sandbox_id": "sb-1"})
    if request == b"jammed":
        raise OrchardError(ToyReason.WIDGET_JAMMED, "widget 7 is jammed")
    if request == b"enoent":
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/missing.txt")
    if request == b"eacces":
        raise PermissionError(errno.EACCES, "Permission denied", "/etc/shadow")
    if request == b"store-timeout":
        raise EtcdTimeout("etcd at 10.0.0.2:2379: Range: deadline exceeded")
    if request == b"boom":
        raise RuntimeError("secret internal detail")


async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    fail(request)
    return request


async def server_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"first"
    fail(request)
    yield b"second"


async def server_stream_writes(request: bytes, context: grpc.aio.ServicerContext) -> None:
    await context.write(b"first")
    fail(request)


async def client_stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    last = b""
    async for request in requests:
        last = request
    fail(last)
    return last


async def bidi(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    async for request in requests:
        fail(request)
        yield request


def faulty_service() -> ServiceBinding:
    identity = None  # bytes in, bytes out: no (de)serializers
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, identity, identity),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream, identity, identity),
        "ServerStreamWrites": grpc.unary_stream_rpc_method_handler(
            server_stream_writes, identity, identity
        ),
        "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream, identity, identity),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi, identity, identity),
    }
    return ServiceBinding.generic(grpc.method_handlers_generic_handler(SERVICE, handlers))


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    async with (
        GrpcServer("test", [faulty_service()]) as server,
        grpc.aio.insecure_channel(server.addresses[0]) as channel,
    ):
        yield channel


async def call(channel: grpc.aio.Channel, kind: str, request: bytes) -> list[bytes]:
    """Make one call of the given kind and return every response received."""
    method = f"/{SERVICE}/{kind}"
    if kind == "Unary":
        return [await channel.unary_unary(method)(request)]
    if kind in ("ServerStream", "ServerStreamWrites"):
        return [r async for r in channel.unary_stream(method)(request)]
    if kind == "ClientStream":
        return [await channel.stream_unary(method)(iter([b"warmup", request]))]
    return [r async for r in channel.stream_stream(method)(iter([b"warmup", request]))]


KINDS = ["Unary", "ServerStream", "ServerStreamWrites", "ClientStream", "Bidi"]


@pytest.mark.parametrize("kind", KINDS)
async def test_orchard_error_becomes_status_with_error_info(
    channel: grpc.aio.Channel, kind: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(channel, kind, b"not-found")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details() == "no sandbox 'sb-1'"
    info = error_info(caught.value)
    assert info is not None
    assert (info.reason, info.domain) == ("NOT_FOUND", ERROR_DOMAIN)
    assert dict(info.metadata) == {"sandbox_id": "sb-1"}


@pytest.mark.parametrize("kind", KINDS)
async def test_unexpected_exception_is_internal_without_traceback(
    channel: grpc.aio.Channel, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR), pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(channel, kind, b"boom")
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    details = caught.value.details() or ""
    assert "secret" not in details and "Traceback" not in details
    info = error_info(caught.value)
    assert info is not None and info.reason == "INTERNAL"
    incident = info.metadata["incident"]
    assert incident in details
    logged = [r for r in caplog.records if getattr(r, "incident", None) == incident]
    assert logged and logged[0].exc_info is not None  # the traceback stays in the server log


@pytest.mark.parametrize("kind", KINDS)
async def test_a_state_store_that_does_not_answer_is_unavailable_not_internal(
    channel: grpc.aio.Channel, kind: str
) -> None:
    """An etcd read that timed out (a busy store, or a process starved past its deadline) is
    retryable: UNAVAILABLE, never an INTERNAL incident a client gives up on."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(channel, kind, b"store-timeout")
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "state store" in (caught.value.details() or "")
    assert "10.0.0.2" not in (caught.value.details() or "")
    info = error_info(caught.value)
    assert info is not None and info.reason == "UNAVAILABLE"


async def test_service_reason_table(channel: grpc.aio.Channel) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(channel, "Unary", b"jammed")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(caught.value)
    assert info is not None and info.reason == "WIDGET_JAMMED"


@pytest.mark.parametrize(
    ("request_bytes", "code", "reason", "path"),
    [
        (b"enoent", grpc.StatusCode.NOT_FOUND, "NOT_FOUND", "/data/missing.txt"),
        (b"eacces", grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED", "/etc/shadow"),
    ],
)
async def test_os_error_maps_by_errno(
    channel: grpc.aio.Channel, request_bytes: bytes, code: grpc.StatusCode, reason: str, path: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(channel, "Unary", request_bytes)
    assert caught.value.code() == code
    info = error_info(caught.value)
    assert info is not None and info.reason == reason
    assert info.metadata["path"] == path
    assert path in (caught.value.details() or "")


async def test_success_passes_through(channel: grpc.aio.Channel) -> None:
    for kind in KINDS:
        responses = await call(channel, kind, b"fine")
        assert responses[-1] in (b"fine", b"second", b"first")


def test_sync_client_reads_error_info() -> None:
    """error_info works with the sync API's RpcError too."""
    import asyncio
    import threading

    ready = threading.Event()
    stop = threading.Event()
    address: list[str] = []

    async def serve() -> None:
        async with GrpcServer("test", [faulty_service()]) as server:
            address.append(server.addresses[0])
            ready.set()
            await asyncio.to_thread(stop.wait)

    thread = threading.Thread(target=asyncio.run, args=(serve(),))
    thread.start()
    try:
        assert ready.wait(10)
        with grpc.insecure_channel(address[0]) as sync_channel:
            with pytest.raises(grpc.RpcError) as caught:
                sync_channel.unary_unary(f"/{SERVICE}/Unary")(b"not-found", timeout=5)
            info = error_info(caught.value)
            assert info is not None and info.reason == "NOT_FOUND"
            status = rich_status(caught.value)
            assert status is not None and status.code == grpc.StatusCode.NOT_FOUND.value[0]
    finally:
        stop.set()
        thread.join(10)


def test_error_info_absent_for_plain_status() -> None:
    class Plain(grpc.RpcError):  # type: ignore[misc]
        def trailing_metadata(self) -> Any:
            return ()

    assert error_info(Plain()) is None


@pytest.mark.parametrize(
    ("number", "reason"),
    [
        (errno.ENOENT, Reason.NOT_FOUND),
        (errno.EPERM, Reason.PERMISSION_DENIED),
        (errno.ENOSPC, Reason.RESOURCE_EXHAUSTED),
        (errno.EISDIR, Reason.IS_A_DIRECTORY),
        (errno.ENOTDIR, Reason.NOT_A_DIRECTORY),
        (errno.EINVAL, Reason.INVALID_ARGUMENT),
        (errno.EEXIST, Reason.ALREADY_EXISTS),
        (errno.EIO, Reason.FAILED_PRECONDITION),
        (errno.ENOLINK, Reason.FAILED_PRECONDITION),  # not in the table: never INTERNAL
        (errno.ESPIPE, Reason.INVALID_ARGUMENT),
    ],
)
def test_errno_table(number: int, reason: Reason) -> None:
    error = from_os_error(OSError(number, "text", "/p"))
    assert error.reason is reason
    assert error.metadata == {"errno": errno.errorcode[number], "path": "/p"}


def test_reason_codes() -> None:
    assert Reason.OUTPUT_LIMIT.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert Reason.INVALID_PATH.code == grpc.StatusCode.INVALID_ARGUMENT
    assert Reason.INVALID_PATH.reason == "INVALID_PATH"
    assert all(member.description for member in Reason)


def test_os_error_with_a_bytes_path_reads_as_text() -> None:
    error = from_os_error(OSError(errno.ENOENT, "No such file or directory", b"/data/caf\xe9/x"))
    assert error.reason is Reason.NOT_FOUND
    assert error.metadata["path"] == "/data/caf\\xe9/x"
    assert "b'" not in str(error)
    assert "/data/caf\\xe9/x" in str(error)


def test_statuses_quoting_huge_input_fit_in_the_trailers() -> None:
    from grpc_status import rpc_status

    key = "k" * 100_000
    error = OrchardError(
        Reason.INVALID_ARGUMENT, f"spec.labels[{key!r}]: bad", metadata={"field": key}
    )
    status = error.to_status()
    details = dict(status.trailing_metadata)["grpc-status-details-bin"]
    assert len(status.details) < 1200 and len(details) < 2000
    parsed = rpc_status.status_pb2.Status.FromString(details)
    assert parsed.message.endswith("characters)") and "100020 characters" in parsed.message


def test_os_error_paths_are_quoted_short() -> None:
    error = from_os_error(OSError(errno.ENAMETOOLONG, "File name too long", "/a" * 40_000))
    assert error.reason is Reason.INVALID_PATH
    assert len(error.message) < 400 and len(error.metadata["path"]) < 300
