"""Request bytes that are not a valid message: INVALID_ARGUMENT, and the agent keeps serving.

Sent through generic channel calls without a serializer, so the bytes go out exactly as given.
Without the agent's guard, grpc.aio answers such a call UNKNOWN ("Unexpected <class
'DecodeError'>") or INTERNAL, which reads like a server bug.
"""

from __future__ import annotations

import grpc
import pytest

from orchard.core.errors import error_info
from orchard.inagent.v1 import inagent_service_pb2 as pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as pb_grpc

SERVICE = "/orchard.inagent.v1.AgentService/"
CORRUPT = b"\xff\xff\xff\xff"
# ExecRequest{command: Command{argv: ["\xff"]}}: well-formed wire format, bad UTF-8 in a string.
BAD_UTF8 = b"\x0a\x03\x0a\x01\xff"


def check(error: grpc.RpcError, words: str) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "not a valid protobuf message" in error.details()
    assert words in error.details()
    info = error_info(error)
    assert info is not None and info.reason == "MALFORMED_REQUEST"


@pytest.mark.parametrize(
    ("method", "raw", "words"),
    [
        ("Exec", CORRUPT, "Wire format was corrupt"),
        ("Exec", BAD_UTF8, "bad UTF-8"),
        ("StatFile", b"\x0a\x02\xc3\x28", "bad UTF-8"),
        ("GetAgentInfo", CORRUPT, "GetAgentInfoRequest"),
    ],
)
def test_unary_request(channel: grpc.Channel, method: str, raw: bytes, words: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary(SERVICE + method)(raw, timeout=5)
    check(caught.value, words)


@pytest.mark.parametrize("method", ["ExecStream", "ReadFile"])
def test_server_streaming_request(channel: grpc.Channel, method: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(channel.unary_stream(SERVICE + method)(CORRUPT, timeout=5))
    check(caught.value, "Wire format was corrupt")


def test_client_streaming_request(channel: grpc.Channel, tmp_path: object) -> None:
    header = pb.WriteFileRequest(
        header=pb.WriteFileHeader(path=f"{tmp_path}/x")
    ).SerializeToString()
    with pytest.raises(grpc.RpcError) as caught:
        channel.stream_unary(SERVICE + "WriteFile")(iter([header, CORRUPT]), timeout=5)
    check(caught.value, "WriteFileRequest")


def test_agent_still_serves(channel: grpc.Channel) -> None:
    for _ in range(3):
        with pytest.raises(grpc.RpcError):
            channel.unary_unary(SERVICE + "Exec")(CORRUPT, timeout=5)
    stub = pb_grpc.AgentServiceStub(channel)
    assert stub.GetAgentInfo(pb.GetAgentInfoRequest(), timeout=5).version == "0.1.0"


def test_unknown_method_is_unimplemented(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary(SERVICE + "Nope")(b"", timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
