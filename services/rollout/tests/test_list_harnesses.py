"""ListHarnesses on the REAL rollout gRPC server (its job store in a real etcd): every harness
the service drives, with the system prompt and the tool declarations its model sees, so a
client (a recipe) needs none of the service's code to know them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc

from orchard.core.config import ServerConfig
from orchard.core.etcd import EmbeddedEtcd
from orchard.rollout.config import RolloutConfig
from orchard.rollout.harnesses.bash_react import (
    bash_react_harness,
    generic_tool_harness,
    shell_harness,
)
from orchard.rollout.main import RolloutApplication
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.rollout.v1 import rollout_service_pb2_grpc


async def test_list_harnesses_declares_each_harness_as_its_model_sees_it(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    config = RolloutConfig(
        server=ServerConfig(listen=["127.0.0.1:0"]),
        artifacts={"root": (tmp_path / "artifacts").as_uri()},
        etcd={"endpoints": [etcd.endpoint], "namespace": f"harnesses-{os.urandom(4).hex()}/"},
    )
    async with RolloutApplication(config).server() as server:
        await server.set_serving()
        async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
            stub = rollout_service_pb2_grpc.RolloutServiceStub(channel)
            reply = await stub.ListHarnesses(api.ListHarnessesRequest(), timeout=10)

    by_name = {h.name: h for h in reply.harnesses}
    assert [h.name for h in reply.harnesses] == ["builtin:bash", "builtin:swe", "builtin:tools"]
    for name, made in (
        ("builtin:swe", shell_harness()),
        ("builtin:bash", bash_react_harness()),
        ("builtin:tools", generic_tool_harness()),
    ):
        listed = by_name[name]
        # exactly what the harness sends the model, in its order
        assert json.loads(listed.tools_json) == [tool.schema() for tool in made.tools]
        assert listed.system_prompt == made.system_prompt
        assert listed.description and "\n" not in listed.description
    swe_tools = json.loads(by_name["builtin:swe"].tools_json)
    assert [t["function"]["name"] for t in swe_tools] == ["bash", "submit"]
    assert swe_tools[0]["type"] == "function"
    assert swe_tools[0]["function"]["parameters"]["required"] == ["command"]
    assert json.loads(by_name["builtin:tools"].tools_json) == []  # tasks declare its tools
