"""Nothing assumes one host: etcd, orchard-env, orchard-reward, orchard-rollout and
orchard-trainer each run on a machine of their own (`machines`: a network namespace on a subnet
the test makes, a private mount namespace and /tmp, everything else read-only), sharing nothing
but etcd, the gRPC addresses and the artifact store. A client on a sixth machine drives them.

A service that dialed 127.0.0.1 to reach another would find nothing there, and one that opened
a path another service wrote would not find it: both fail the run. The first tests show the
machines are separate in exactly those two ways.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchard.core.etcd.embedded import find_etcd_binary
from orchard.sdk.cli.host_probe import remove_cgroup_parent

from .machines import STORE_MOUNT, Machine, Subnet, subnet

pytestmark = [pytest.mark.root, pytest.mark.timeout(900)]

CLIENT = str(Path(__file__).with_name("machine_client.py"))
BIN = Path(sys.executable).parent
TENANT = "across"
PORTS = {"etcd": 2379, "env": 7100, "reward": 7200, "rollout": 7400, "trainer": 7300}
SERVICES = ("reward", "rollout", "trainer")
"""Started after orchard-env, in this order (orchard-rollout is given orchard-reward's address)."""


@dataclass
class Cluster:
    net: Subnet
    machines: dict[str, Machine]
    token: str
    cgroup_parent: str

    def address(self, name: str) -> str:
        return f"{self.machines[name].address}:{PORTS[name]}"

    @property
    def client(self) -> Machine:
        return self.machines["client"]

    def on_client(self, *args: str, timeout: float = 600) -> dict[str, Any]:
        """Run machine_client.py with ``args`` on the client machine; its JSON answer."""
        result = self.client.run(
            [sys.executable, CLIENT, *args], env={"ORCHARD_TOKEN": self.token}, timeout=timeout
        )
        if result.returncode != 0:
            logs = "\n".join(self.log_tail(name) for name in self.machines if name != "client")
            raise AssertionError(f"{args} failed on the client machine:\n{result.stdout}\n{logs}")
        answer: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
        return answer

    def log_tail(self, name: str, lines: int = 15) -> str:
        """The last `lines` of a machine's log, after its last few warnings and errors (an
        incident's traceback is logged long before the run that met it gives up)."""
        log = self.machines[name].folder / "log"
        if not log.exists():
            return f"-- {name}: no log"
        text = log.read_text(errors="replace").splitlines()
        problems = [line for line in text if '"level": "ERROR"' in line or "Traceback" in line]
        problems += [line for line in text if '"level": "WARNING"' in line][-5:]
        shown = "\n".join(problems[-10:])
        return f"-- {name} warnings and errors:\n{shown}\n-- {name} log:\n" + "\n".join(
            text[-lines:]
        )


def _start(machine: Machine, argv: list[str], env: dict[str, str] | None = None) -> None:
    with (machine.folder / "log").open("ab") as log:
        machine.popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _config(machine: Machine, name: str, config: dict[str, Any]) -> str:
    """Write ``config`` into the machine's folder; the path it has on that machine."""
    (machine.folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return f"/tmp/machine/{name}.yaml"


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"openssl {args[0]} failed: {result.stderr}"


def _certificates(cluster: Cluster) -> None:
    """A CA, and orchard-env's certificate for its address on the subnet (its key stays in
    orchard-env's folder); every machine that calls orchard-env gets the CA."""
    folder = cluster.machines["env"].folder
    ca_key, ca, key, csr, cert = (
        folder / n for n in ("ca.key", "ca.crt", "tls.key", "tls.csr", "tls.crt")
    )
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=across-ca",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=orchard-env",
        "-keyout",
        str(key),
        "-out",
        str(csr),
    )
    ext = folder / "san.cnf"
    ext.write_text(f"subjectAltName=IP:{cluster.machines['env'].address}\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    ca_key.unlink()
    for name, machine in cluster.machines.items():
        if name not in ("env", "etcd"):
            (machine.folder / "env-ca.crt").write_bytes(ca.read_bytes())


def _env_config(cluster: Cluster) -> dict[str, Any]:
    digest = hashlib.sha256(cluster.token.encode()).hexdigest()
    return {
        "server": {
            "listen": [cluster.address("env")],
            "tls_cert_file": "/tmp/machine/tls.crt",
            "tls_key_file": "/tmp/machine/tls.key",
        },
        "etcd": {"endpoints": [f"http://{cluster.address('etcd')}"]},
        "auth": {"tenants": {TENANT: {"tokens": [f"sha256:{digest}"]}}},
        "runtime": {
            "type": "local",
            "state_dir": "/tmp/env/state",
            "workspace_dir": "/tmp/env/sandboxes",
            "run_dir": "/tmp/r",
            "cgroup_parent": cluster.cgroup_parent,
        },
        "images": {"tenants": {TENANT: {"allow_host": True}}},
        "secrets": {"key_file": "/tmp/env/secrets.key"},
    }


STORE_URL = f"file://{STORE_MOUNT}"
TOKEN_VARIABLE = "ORCHARD_ACROSS_ENV_TOKEN"
"""Where the services that call orchard-env find its token (never in a config file)."""


def _service_configs(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """Each service's configuration: addresses on the subnet, state under its own /tmp, the
    shared store for artifacts."""
    etcd = [f"http://{cluster.address('etcd')}"]
    env = {
        "endpoint": cluster.address("env"),
        "token_env": TOKEN_VARIABLE,
        "tls_ca_file": "/tmp/machine/env-ca.crt",
    }
    artifacts = {"root": STORE_URL}
    return {
        "reward": {"server": {"listen": [cluster.address("reward")]}, "env": env},
        "rollout": {
            "server": {"listen": [cluster.address("rollout")]},
            "etcd": {"endpoints": etcd},
            "env": env,
            "reward": {"endpoint": cluster.address("reward")},
            "artifacts": artifacts,
        },
        "trainer": {
            "server": {"listen": [cluster.address("trainer")]},
            "etcd": {"endpoints": etcd},
            "artifacts": artifacts,
            "weights": {"scratch_dir": "/tmp/trainer-scratch"},
        },
    }


def _start_services(cluster: Cluster, names: tuple[str, ...]) -> None:
    etcd, env = cluster.machines["etcd"], cluster.machines["env"]
    url = f"http://{cluster.address('etcd')}"
    _certificates(cluster)
    _start(
        etcd,
        [
            str(find_etcd_binary()),
            "--data-dir=/tmp/etcd",
            f"--listen-client-urls={url}",
            f"--advertise-client-urls={url}",
            "--listen-peer-urls=http://127.0.0.1:2380",
            "--initial-advertise-peer-urls=http://127.0.0.1:2380",
            "--initial-cluster=default=http://127.0.0.1:2380",
        ],
    )
    _start(env, [str(BIN / "orchard-env"), "--config", _config(env, "env", _env_config(cluster))])
    configs = _service_configs(cluster)
    for name in names:
        machine = cluster.machines[name]
        argv = [str(BIN / f"orchard-{name}"), *(["serve"] if name == "trainer" else [])]
        argv += ["--config", _config(machine, name, configs[name])]
        _start(machine, argv, env={TOKEN_VARIABLE: cluster.token})


def _wait_serving(cluster: Cluster, timeout_s: float = 240) -> None:
    """Until every service answers health on the subnet; fails as soon as one has exited."""
    targets = [f"{cluster.address('env')}+tls", *(cluster.address(n) for n in SERVICES)]
    deadline = time.monotonic() + timeout_s
    while True:
        for name, machine in cluster.machines.items():
            if name == "client":
                continue
            for process in machine.processes:
                if process.poll() is not None:
                    pytest.fail(
                        f"{name} exited with {process.returncode}:\n{cluster.log_tail(name)}"
                    )
        answer = cluster.on_client("wait", "10", *targets)
        if "waiting" not in answer:
            return
        if time.monotonic() > deadline:
            logs = "\n".join(cluster.log_tail(n) for n in cluster.machines if n != "client")
            pytest.fail(f"{answer['waiting']} did not serve within {timeout_s} s:\n{logs}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.fail("separate machines need root (network and mount namespaces)")
    root = tmp_path_factory.mktemp("machines")
    store = root / "store"
    store.mkdir()
    cgroup_parent = f"orchard-test-{uuid.uuid4().hex[:8]}"
    with subnet(root, store=store) as net:
        names = ("etcd", "env", *SERVICES, "client")
        machines = {name: net.machine(name) for name in names}
        cluster = Cluster(net, machines, secrets.token_urlsafe(16), cgroup_parent)
        try:
            _start_services(cluster, SERVICES)
            _wait_serving(cluster)
            yield cluster
        finally:
            net.close()
            remove_cgroup_parent(cgroup_parent)


def test_a_machine_reaches_another_only_through_the_subnet(cluster: Cluster) -> None:
    assert cluster.on_client("dial", cluster.address("env"))["connected"]
    # The client's loopback is its own: orchard-env's port there has nothing behind it.
    refused = cluster.on_client("dial", f"127.0.0.1:{PORTS['env']}")
    assert not refused["connected"], refused


def test_a_machine_cannot_open_what_another_wrote(cluster: Cluster) -> None:
    env = cluster.machines["env"]
    seen = env.run(["sh", "-c", "ls /tmp/env/state >/dev/null && echo env-sees-its-state"])
    assert "env-sees-its-state" in seen.stdout, seen.stdout
    other = cluster.client.run(["sh", "-c", "ls /tmp/env 2>&1; touch /etc/orchard-probe 2>&1"])
    assert "No such file or directory" in other.stdout, other.stdout
    assert "Read-only file system" in other.stdout, other.stdout
    shared = cluster.client.run(["sh", "-c", f"echo from-client > {STORE_MOUNT}/probe"])
    assert shared.returncode == 0, shared.stdout
    assert env.run(["cat", f"{STORE_MOUNT}/probe"]).stdout == "from-client\n"


def test_a_sandbox_from_another_machine(cluster: Cluster) -> None:
    answer = cluster.on_client("sandbox", cluster.address("env"))
    assert answer["exit_code"] == 0, answer
    assert answer["read_back"] == "written from the client machine\n"
    assert answer["stdout"].startswith("written from the client machine\n")


RECIPE = {
    "name": "across",
    "output_dir": "/tmp/machine/runs/across",
    # 12 tasks: 5 for SFT, 2 for RL, 5 held out (one per bug family); the repositories travel
    # as archives in the artifact store.
    "tasks": {
        "builtin": {"count": 12, "seed": 3},
        "split": {"sft": 0.34, "rl": 0.33, "evaluate": 0.33},
    },
    "harnesses": ["builtin:swe"],
    "stages": {
        "collect": {"attempts_per_task": 1, "budget": {"max_steps": 8, "wall_clock_s": 120}},
        "sft": {"epochs": 1, "batch_size": 2, "learning_rate": 0.003, "warmup_steps": 1},
        "rl": {
            "steps": 1,
            "groups_per_step": 1,
            "sampler": {"kind": "fixed", "n": 2},
            "budget": {"max_steps": 3, "max_tokens": 256, "wall_clock_s": 120},
        },
        "evaluate": {"attempts_per_task": 1},
    },
}


@pytest.fixture(scope="module")
def recipe_run(cluster: Cluster) -> Path:
    """The reduced recipe, run by `orchard recipe run --stack` on the client machine; the
    folder its outputs are in (the client machine's, read here after the run)."""
    client = cluster.client
    (client.folder / "recipe.yaml").write_text(yaml.safe_dump(RECIPE))
    stack = {
        "env": cluster.address("env"),
        "reward": cluster.address("reward"),
        "rollout": cluster.address("rollout"),
        "trainer": cluster.address("trainer"),
        "etcd": f"http://{cluster.address('etcd')}",
        "artifacts": STORE_URL,
    }
    (client.folder / "stack.json").write_text(json.dumps(stack))
    started = time.monotonic()
    result = client.run(
        [
            str(BIN / "orchard"),
            "recipe",
            "run",
            "/tmp/machine/recipe.yaml",
            "--stack",
            "/tmp/machine/stack.json",
            "--no-progress",
            "--workers",
            "2",
        ],
        env={"ORCHARD_TOKEN": cluster.token},
        timeout=1500,
    )
    wall = time.monotonic() - started
    logs = "\n".join(cluster.log_tail(n, 25) for n in cluster.machines if n != "client")
    assert result.returncode == 0, f"the recipe failed:\n{result.stdout[-6000:]}\n{logs}"
    (client.folder / "wall.txt").write_text(f"{wall:.1f}\n")
    print(f"reduced recipe across machines: {wall:.1f} s")
    return client.folder / "runs" / "across"


def _done(run: Path, stage: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run / stage / "done.json").read_text())
    return data


@pytest.mark.slow
def test_a_reduced_recipe_runs_end_to_end_across_machines(
    recipe_run: Path, cluster: Cluster
) -> None:
    collect = _done(recipe_run, "collect")
    assert collect["rollouts"] == 5 and collect["resolved"] >= 1, collect
    # The trainer rendered the teacher's conversations and curated them on its own machine,
    # reading what the client put in the store and writing the dataset the SFT job trained on.
    assert collect["trajectories"] == collect["rollouts"] - sum(collect["excluded"].values())
    curate = _done(recipe_run, "curate")
    assert curate["dataset"].startswith(f"{STORE_URL}/recipes/datasets/"), curate
    assert (cluster.net.store / curate["dataset"].removeprefix(f"{STORE_URL}/")).is_file()
    sft = _done(recipe_run, "sft")
    assert sft["steps"] >= 1 and sft["samples"] == curate["samples"] >= 1
    location = sft["weights"]["location"]
    # What the trainer published is a URL in the shared store, which the rollout service read
    # (RL sampled that version on its own machine).
    assert location.startswith(f"{STORE_URL}/"), location
    assert (cluster.net.store / location.removeprefix(f"{STORE_URL}/") / "config.json").is_file()
    rl = _done(recipe_run, "rl")
    assert rl["steps"][0]["sampled"] == sft["weights"]["version"]
    evaluate = _done(recipe_run, "evaluate")
    assert set(evaluate["models"]) >= {"base", "sft", "rl"}, evaluate
    assert (recipe_run / "report" / "report.md").is_file()


def test_no_service_is_configured_with_loopback(cluster: Cluster) -> None:
    for name in ("env", *SERVICES):
        text = (cluster.machines[name].folder / f"{name}.yaml").read_text()
        assert "127.0.0.1" not in text and "localhost" not in text, (name, text)
