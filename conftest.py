"""Fixtures shared by every test in the workspace."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchard.core.etcd import EmbeddedEtcd, find_etcd_binary


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked ``root`` fail without root: the machines that run them (every developer's,
    CI) are root, so a missing privilege is a broken setup, never a reason to skip."""
    if item.get_closest_marker("root") is not None and os.geteuid() != 0:
        pytest.fail("this test needs root (namespaces, mounts, cgroups): run the tests as root")


@pytest.fixture(scope="session")
def etcd() -> Iterator[EmbeddedEtcd]:
    """One real etcd server for the whole session; tests isolate themselves by key namespace
    and must not compact it or kill it (start their own `EmbeddedEtcd` for that)."""
    try:
        find_etcd_binary()
    except FileNotFoundError as e:
        pytest.fail(f"{e} (`make setup` installs etcd)")
    with EmbeddedEtcd() as server:
        yield server


# Extensions for the test certificates; a config of our own, so the system's openssl.cnf
# cannot add or change any.
_OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
[dn]
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,IP:::1,DNS:localhost
[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = clientAuth
"""


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Test certificates made now with the ``openssl`` command (`make setup` installs it), keyed by
    file name: ``ca.crt``; ``server.crt``/``server.key`` (127.0.0.1, ::1, localhost) and
    ``client.crt``/``client.key``, both signed by that CA; ``other-ca.crt``, an unrelated CA."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the openssl command is needed to make test certificates: `make setup`")
    folder = tmp_path_factory.mktemp("tls")
    config = folder / "openssl.cnf"
    config.write_text(_OPENSSL_CONFIG)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=folder, check=True, capture_output=True, timeout=30)

    def key(name: str) -> None:
        run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", name)

    for ca in ("ca", "other-ca"):
        key(f"{ca}.key")
        run(
            "req", "-x509", "-new", "-key", f"{ca}.key", "-subj", f"/CN=Orchard test {ca}",
            "-days", "2", "-config", "openssl.cnf", "-extensions", "ca", "-out", f"{ca}.crt",
        )  # fmt: skip
    for serial, leaf in enumerate(("server", "client"), start=2):
        key(f"{leaf}.key")
        run(
            "req", "-new", "-key", f"{leaf}.key", "-subj", f"/CN=orchard-test-{leaf}",
            "-config", "openssl.cnf", "-out", f"{leaf}.csr",
        )  # fmt: skip
        run(
            "x509", "-req", "-in", f"{leaf}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-set_serial", str(serial), "-days", "2", "-extfile", "openssl.cnf",
            "-extensions", leaf, "-out", f"{leaf}.crt",
        )  # fmt: skip
    names = ("ca.crt", "other-ca.crt", "server.crt", "server.key", "client.crt", "client.key")
    return {name: folder / name for name in names}
