"""What the test runs on its client machine of a `machines.Subnet` (the test process itself has
no address on the subnet). Prints one JSON object; exits non-zero with the reason on failure.

    python machine_client.py wait SECONDS ADDRESS...  every address serves gRPC health (an
                                                    ADDRESS ending in "+tls" is checked over
                                                    TLS with /tmp/machine/env-ca.crt)
    python machine_client.py dial ADDRESS           whether a TCP connect succeeds
    python machine_client.py sandbox ENDPOINT       create, exec, write, read, delete a sandbox
                                                    (token in $ORCHARD_TOKEN)
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

CA_FILE = "/tmp/machine/env-ca.crt"


def wait(timeout_s: float, addresses: list[str]) -> dict[str, Any]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    waited: dict[str, float] = {}
    start = time.monotonic()
    for target in addresses:
        address = target.removesuffix("+tls")
        if target.endswith("+tls"):
            with open(CA_FILE, "rb") as handle:
                credentials = grpc.ssl_channel_credentials(root_certificates=handle.read())
            channel = grpc.secure_channel(address, credentials)
        else:
            channel = grpc.insecure_channel(address)
        with channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        waited[address] = round(time.monotonic() - start, 2)
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    print(json.dumps({"serving": waited, "waiting": address}))
                    return {"serving": waited, "waiting": address}
                time.sleep(0.2)
    return {"serving": waited}


def dial(address: str) -> dict[str, Any]:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=3):
            return {"connected": True}
    except OSError as exc:
        return {"connected": False, "error": type(exc).__name__}


def sandbox(endpoint: str) -> dict[str, Any]:
    from orchard.sdk import SandboxClient

    token = os.environ["ORCHARD_TOKEN"]
    with (
        SandboxClient(endpoint, token=token, tls_ca_file=CA_FILE) as client,
        client.create(image="host", heartbeat_timeout=60) as box,
    ):
        box.write_file("/srv/probe.txt", b"written from the client machine\n")
        result = box.exec(["sh", "-c", "cat /srv/probe.txt; hostname -I 2>/dev/null || true"])
        return {
            "sandbox": box.id,
            "exit_code": result.exit_code,
            "stdout": result.stdout.decode(errors="replace"),
            "read_back": box.read_file("/srv/probe.txt").decode(),
        }


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "wait":
        out = wait(float(args[0]), args[1:])
    elif command == "dial":
        out = dial(args[0])
    elif command == "sandbox":
        out = sandbox(args[0])
    else:
        raise SystemExit(f"unknown command {command!r}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
