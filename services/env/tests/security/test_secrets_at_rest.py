"""Secrets in specs are not stored in clear: `spec.env` values are sealed in every etcd record
(read raw from etcd here), commands still see them, the owning tenant reads them back, and a
replica holding another key refuses to start on the same prefix."""

from __future__ import annotations

import stat
import uuid
from pathlib import Path
from typing import Any

import pytest

from orchard.core.etcd import EmbeddedEtcd, EtcdStore
from orchard.env.config import SecretsConfig
from orchard.env.v1 import env_service_pb2 as api
from orchard.types.v1 import exec_pb2

pytestmark = [pytest.mark.root, pytest.mark.slow]


async def raw_values(etcd: EmbeddedEtcd, prefix: str) -> list[tuple[bytes, bytes]]:
    """Every key and value under the prefix, as etcd holds them."""
    store = EtcdStore([etcd.endpoint])
    await store.connect()
    try:
        result = await store.get_prefix(prefix)
        return [(kv.key, kv.value) for kv in result.kvs]
    finally:
        await store.close()


async def echo_env(env: Any, sandbox_id: str, name: str) -> bytes:
    command = exec_pb2.Command(shell=f'printf %s "${name}"')
    command.timeout.FromSeconds(30)
    request = api.ExecRequest(sandbox_id=sandbox_id, command=command)
    result = (await env.stub.Exec(request, metadata=env.md(), timeout=60)).result
    assert result.status.exit_code == 0, result
    return bytes(result.stdout)


async def test_env_values_are_sealed_in_etcd_and_open_for_commands(
    isolated: Any, etcd: EmbeddedEtcd, prefix: str, tmp_path: Path, attack: Any
) -> None:
    secret = f"sk-{uuid.uuid4().hex}"
    sandbox = await isolated.ready(timeout_s=60, env={"API_KEY": secret, "PLAIN": "x"})
    assert await echo_env(isolated, sandbox.id, "API_KEY") == secret.encode()

    attack.tried("read spec.env from the raw etcd record")
    values = await raw_values(etcd, prefix)
    record = [v for k, v in values if k.endswith(f"/{sandbox.id}".encode())]
    assert record and b"API_KEY" in record[0] and b"orchard-sealed:v1:" in record[0], values
    for key, value in values:
        assert secret.encode() not in value, key
    attack.held("read spec.env from the raw etcd record")

    # The owning tenant reads its own values back (Get, List, Wait).
    got = await isolated.stub.GetSandbox(
        api.GetSandboxRequest(sandbox_id=sandbox.id), metadata=isolated.md()
    )
    assert got.sandbox.spec.env["API_KEY"] == secret
    listed = await isolated.stub.ListSandboxes(api.ListSandboxesRequest(), metadata=isolated.md())
    assert [s.spec.env["API_KEY"] for s in listed.sandboxes] == [secret]
    # A fork carries the sealed value over and its commands see it too.
    forks = await isolated.stub.ForkSandbox(
        api.ForkSandboxRequest(sandbox_id=sandbox.id, count=1), metadata=isolated.md()
    )
    fork = await isolated.wait(forks.sandboxes[0].id, timeout_s=60)
    assert await echo_env(isolated, fork.id, "API_KEY") == secret.encode()
    for key, value in await raw_values(etcd, prefix):
        assert secret.encode() not in value, key

    key_file = Path(tmp_path / "secrets.key")  # the tests' configuration (tests/conftest.py)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


async def test_a_replica_with_another_key_refuses_to_start(
    env_factory: Any, tmp_path: Path
) -> None:
    await env_factory()  # records the key of tmp_path/secrets.key for the prefix
    with pytest.raises(RuntimeError, match="same key file"):
        await env_factory(secrets=SecretsConfig(key_file=str(tmp_path / "other" / "secrets.key")))


async def test_a_missing_key_is_an_error_when_generating_is_off(
    env_factory: Any, tmp_path: Path
) -> None:
    missing = tmp_path / "absent.key"
    with pytest.raises(RuntimeError, match="does not exist"):
        await env_factory(secrets=SecretsConfig(key_file=str(missing), generate_key=False))
    assert not missing.exists()
