"""The SDK and the command line against the REAL environment service: ``orchard up --detach``
starts an embedded etcd and ``orchard-env`` with the local runtime (needs root), and
``orchard down`` stops them. Nothing here is a double."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchard.sdk import (
    EgressRule,
    ExecExit,
    ExecStdout,
    FailedPrecondition,
    FileNotFound,
    InvalidArgument,
    PatchFailed,
    RetryPolicy,
    SandboxClient,
    SandboxNotFound,
    SandboxState,
    Unauthenticated,
)
from orchard.sdk.cli.host_probe import remove_cgroup_parent

pytestmark = [pytest.mark.root, pytest.mark.slow]

CLI = [sys.executable, "-m", "orchard.sdk.cli"]
ROOT = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _log_tails(state: Path, chars: int = 3000) -> str:
    """The end of every log in an ``orchard up`` state folder."""
    return "\n".join(
        f"--- {log}:\n{log.read_text(errors='replace')[-chars:]}"
        for log in sorted((state / "logs").glob("*.log"))
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``orchard up --detach`` in a private state dir; yields its environment and components."""
    if os.geteuid() != 0:
        pytest.fail("the local runtime needs root: run the tests as root")
    from orchard.core.etcd import find_etcd_binary

    try:
        find_etcd_binary()
    except FileNotFoundError as exc:
        pytest.fail(f"{exc} (`make setup` installs etcd)")
    from orchard.tasks.gui.browser_dir import LAUNCHER, build_browser_dir

    # The browser folder `make gui-browser` builds (built here when missing).
    browser = Path(os.environ.get("ORCHARD_GUI_BROWSER") or ROOT / ".cache" / "gui-browser")
    if not (browser / LAUNCHER).exists():
        build_browser_dir(browser)
    state = tmp_path_factory.mktemp("state")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("ORCHARD_") or k in ("ORCHARD_ETCD_BINARY", "ORCHARD_INAGENT_BUNDLE")
    }
    env["ORCHARD_STATE_DIR"] = str(state)
    # A private cgroup parent and run dir, removed at the end: the test leaves nothing behind.
    tag = uuid.uuid4().hex[:8]
    cgroup_parent, run_dir = f"orchard-sdk-test-{tag}", f"/run/orchard-sdk-test-{tag}"
    private = [
        "--set",
        f"runtime.cgroup_parent={cgroup_parent}",
        "--set",
        f"runtime.run_dir={run_dir}",
    ]
    up = subprocess.run(
        [
            *CLI,
            "up",
            "--detach",
            "--json",
            "--listen",
            f"127.0.0.1:{_free_port()}",
            "--reward-listen",
            f"127.0.0.1:{_free_port()}",
            "--rollout-listen",
            f"127.0.0.1:{_free_port()}",
            "--trainer-listen",
            f"127.0.0.1:{_free_port()}",
            "--gui-browser",
            str(browser),
            *private,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # A service that dies is a failure, with what `orchard up` printed and its logs' tails.
    assert up.returncode == 0, (
        f"orchard up failed (status {up.returncode}):\n{up.stderr[-4000:]}\n{_log_tails(state)}"
    )
    started = json.loads(up.stdout)
    try:
        yield {"env": env, "state": state, "browser": browser.absolute(), **started}
    finally:
        down = subprocess.run(
            [*CLI, "down"], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert down.returncode == 0, down.stderr
        for component in started["components"]:
            deadline = time.monotonic() + 10
            while _alive(component["pid"]) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(component["pid"]), component
        remove_cgroup_parent(cgroup_parent)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def client(service: dict[str, Any]) -> Iterator[SandboxClient]:
    profile = Path(service["profile"])
    with SandboxClient(profile=profile, retry=RetryPolicy(initial_backoff=0.05)) as client:
        yield client


def test_up_wrote_a_private_profile(service: dict[str, Any]) -> None:
    profile = Path(service["profile"])
    assert profile.stat().st_mode & 0o777 == 0o600
    data = json.loads(profile.read_text())
    assert data["token"] and data["tenant"] == "local"
    names = [c["name"] for c in service["components"]]
    assert names == [
        "etcd",
        "orchard-env",
        "orchard-reward",
        "orchard-rollout",
        "orchard-trainer",
        "orchard up",
    ]
    assert data["token"] not in (service["state"] / "env.yaml").read_text()
    assert data["token"] not in (service["state"] / "reward.yaml").read_text()


def test_up_serves_the_scripted_credit_judge(service: dict[str, Any]) -> None:
    """Recipes name the reward service's scripted judge; `orchard up` configures it."""
    import grpc

    from orchard.reward.v1 import reward_service_pb2, reward_service_pb2_grpc
    from orchard.types.v1 import trajectory_pb2

    [reward] = [c for c in service["components"] if c["name"] == "orchard-reward"]
    trajectory = trajectory_pb2.Trajectory(id="t", task_id="x")
    for index, command in enumerate(["cat a.py", "sed -i 's/a/b/' a.py", "echo done"]):
        turn = trajectory.turns.add(index=index, input_text="x")
        turn.tool_calls.add(name="bash", arguments_json=json.dumps({"command": command}))
    with grpc.insecure_channel(reward["address"].removeprefix("http://")) as channel:
        stub = reward_service_pb2_grpc.RewardServiceStub(channel)
        request = reward_service_pb2.AssignCreditRequest(trajectory=trajectory, judge="scripted")
        reply = stub.AssignCredit(request, timeout=30)
    assert reply.credit.estimator == "judge:scripted-judge"
    assert len(reply.credit.step_values) == 3


def test_a_host_sandbox_sees_nothing_of_the_stack(
    client: SandboxClient, service: dict[str, Any]
) -> None:
    state = Path(service["state"])
    token = json.loads(Path(service["profile"]).read_text())["token"]
    secret = f"sk-{uuid.uuid4().hex}"
    with client.create(image="host", heartbeat_timeout=30, env={"API_KEY": secret}) as sb:
        assert sb.exec(["sh", "-c", "printf %s $API_KEY"]).check().stdout == secret.encode()
        # The state folder (etcd data, profile, configs, logs, the secrets key) is an empty
        # read-only directory inside; its parent shows as usual.
        seen = sb.exec(["sh", "-c", f"ls -a {state}; cat {state}/profile.json; ls {state.parent}"])
        assert seen.stdout.split()[:2] == [b".", b".."] and token.encode() not in seen.stdout
        assert state.name.encode() in seen.stdout
        assert not sb.exec(["sh", "-c", f"touch {state}/planted"]).ok
        # spec.env values are sealed in etcd: not in its files on disk.
        for path in (state / "etcd").rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes(), path
    key = state / "secrets.key"
    assert key.stat().st_mode & 0o777 == 0o600


def test_up_runs_the_rollout_and_trainer_services(service: dict[str, Any]) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from orchard.rollout.v1 import rollout_service_pb2, rollout_service_pb2_grpc
    from orchard.trainer.v1 import trainer_service_pb2, trainer_service_pb2_grpc

    address = {c["name"]: c["address"] for c in service["components"]}
    with grpc.insecure_channel(address["orchard-rollout"]) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        jobs = rollout_service_pb2_grpc.RolloutServiceStub(channel).ListRolloutJobs(
            rollout_service_pb2.ListRolloutJobsRequest(), timeout=10
        )
        assert list(jobs.jobs) == []  # its own etcd: the stack's, empty
    with grpc.insecure_channel(address["orchard-trainer"]) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as caught:
            trainer_service_pb2_grpc.TrainerServiceStub(channel).GetTrainingJob(
                trainer_service_pb2.GetTrainingJobRequest(job_id="none"), timeout=10
            )
        assert caught.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)


def test_up_offers_the_browser_harnesses_with_a_browser_folder(
    client: SandboxClient, service: dict[str, Any]
) -> None:
    """`--gui-browser` (what `orchard up` finds on its own in a checkout after `make
    gui-browser`): orchard-rollout offers the browser harnesses, running the folder in the host
    image, and the local tenant may give sandboxes user namespaces (Chromium's own sandbox)."""
    import grpc

    from orchard.rollout.v1 import rollout_service_pb2, rollout_service_pb2_grpc

    folder = service["browser"]
    harnesses = ["builtin:browser", "builtin:browser-text"]
    assert service["gui"] == {"harnesses": harnesses, "browser_dir": str(folder), "tenant": "local"}
    address = {c["name"]: c["address"] for c in service["components"]}
    with grpc.insecure_channel(address["orchard-rollout"]) as channel:
        listed = rollout_service_pb2_grpc.RolloutServiceStub(channel).ListHarnesses(
            rollout_service_pb2.ListHarnessesRequest(), timeout=10
        )
    assert set(harnesses) <= {h.name for h in listed.harnesses}
    with client.create(image="host", heartbeat_timeout=30, user_namespaces=True) as sb:
        assert sb.exec(["unshare", "--user", "--map-root-user", "true"]).ok
        assert sb.exec(["test", "-x", f"{folder}/bin/orchard-browser"]).ok


def test_up_runs_the_reward_service_against_its_env_service(service: dict[str, Any]) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from orchard.reward.v1 import reward_service_pb2, reward_service_pb2_grpc

    reward = next(c for c in service["components"] if c["name"] == "orchard-reward")
    with grpc.insecure_channel(reward["address"]) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        # A bad request is refused by the service itself (it got as far as validation).
        with pytest.raises(grpc.RpcError) as caught:
            reward_service_pb2_grpc.RewardServiceStub(channel).ScoreTests(
                reward_service_pb2.ScoreTestsRequest(), timeout=10
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_sandbox_round_trip(client: SandboxClient, tmp_path: Path) -> None:
    with client.create(image="host", labels={"suite": "sdk-real"}, heartbeat_timeout=30) as sb:
        assert sb.state is SandboxState.READY and sb.info.runtime == "local"
        result = sb.exec(["sh", "-c", "echo $X; exit 5"], env={"X": "hello"}, timeout=30)
        assert (result.exit_code, result.stdout) == (5, b"hello\n")
        events = list(sb.exec_stream("echo a; echo b"))
        assert b"".join(e.data for e in events if isinstance(e, ExecStdout)) == b"a\nb\n"
        assert isinstance(events[-1], ExecExit) and events[-1].exit_code == 0
        sb.write_file("/workspace/notes.txt", "one\ntwo\n")
        assert sb.read_file("/workspace/notes.txt") == b"one\ntwo\n"
        with pytest.raises(FileNotFound):
            sb.read_file("/workspace/missing")
        source = tmp_path / "tree"
        (source / "sub").mkdir(parents=True)
        (source / "sub" / "x.py").write_text("print('x')\n")
        (source / "empty").mkdir()
        sb.upload(source, "/workspace/tree")
        assert sb.exec(["python3", "/workspace/tree/sub/x.py"]).check().stdout == b"x\n"
        sb.download("/workspace/tree", tmp_path / "back")
        assert (tmp_path / "back" / "sub" / "x.py").read_text() == "print('x')\n"
        assert (tmp_path / "back" / "empty").is_dir()
        sb.write_file("/workspace/repo/hello.txt", "hello\nworld\n")
        diff = "--- a/hello.txt\n+++ b/hello.txt\n@@ -1,2 +1,2 @@\n hello\n-world\n+orchard\n"
        sb.apply_diff(diff, cwd="/workspace/repo")
        assert sb.read_file("/workspace/repo/hello.txt") == b"hello\norchard\n"
        with pytest.raises(PatchFailed):
            sb.apply_diff(diff, cwd="/workspace/repo")
        assert [i.id for i in client.list("suite=sdk-real")] == [sb.id]
    with pytest.raises(SandboxNotFound):
        client.get(sb.id)


# http.server's own bind asks DNS for the name of 0.0.0.0, which a sandbox cannot reach.
SERVE = """
import functools, http.server, socketserver
class Server(http.server.ThreadingHTTPServer):
    def server_bind(self):
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "site", 8080
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory="/srv")
server = Server(("0.0.0.0", 8080), handler)
open("/srv/listening", "w").close()
server.serve_forever()
"""


def test_one_sandbox_reaches_another_through_the_sdk(client: SandboxClient) -> None:
    fetch = (
        "import sys, urllib.request\n"
        "try:\n"
        "    print(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode())\n"
        "except OSError:\n"
        "    print('unreachable')\n"
    )
    with client.create(image="host", ingress_ports=[8080], heartbeat_timeout=30) as site:
        assert site.info.ingress_ports == (8080,) and site.info.network_address
        site.write_file("/srv/index.html", "the site\n")
        site.write_file("/srv/serve.py", SERVE)
        site.exec(
            "setsid python3 /srv/serve.py </dev/null >/dev/null 2>&1 & "
            "for i in $(seq 100); do [ -e /srv/listening ] && exit 0; sleep 0.05; done; exit 1"
        ).check()
        url = f"http://{site.info.network_address}:8080/index.html"
        rule = EgressRule.to_sandbox(site.id, 8080, expire_at=time.time() + 120)
        with client.create(image="host", egress=[rule], heartbeat_timeout=30) as browser:
            assert browser.info.egress == (rule,)
            browser.write_file("/tmp/fetch.py", fetch)
            got = browser.exec(["python3", "/tmp/fetch.py", url]).check()
            assert got.stdout == b"the site\n\n"
            assert browser.update_egress([]).egress == ()
            gone = browser.exec(["python3", "/tmp/fetch.py", url]).check()
            assert gone.stdout == b"unreachable\n"
        with pytest.raises(FailedPrecondition):
            client.create(image="host", egress=[EgressRule.to_sandbox(site.id, 9999)])


def test_heartbeats_keep_a_sandbox_alive(client: SandboxClient) -> None:
    kept = client.create(image="host", heartbeat_timeout=3)
    dropped = client.create(image="host", heartbeat_timeout=2, keep_alive=False)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                client.get_info(dropped.id)
            except SandboxNotFound:
                break
            time.sleep(0.5)
        else:
            pytest.fail("a sandbox without heartbeats was not reaped")
        assert kept.exec(["true"]).ok
        assert kept.heartbeat_error is None
    finally:
        kept.delete()


def test_errors_from_the_real_service(client: SandboxClient, service: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        client.create(image="host", labels={"Bad Key!": "x"})
    with pytest.raises(SandboxNotFound):
        client.get("sbx-000000000000")
    endpoint = json.loads(Path(service["profile"]).read_text())["endpoint"]
    with SandboxClient(endpoint, token="wrong") as stranger, pytest.raises(Unauthenticated):
        list(stranger.list())


def test_cli_against_the_real_service(service: dict[str, Any]) -> None:
    env = service["env"]

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *argv], env=env, capture_output=True, text=True, timeout=120, check=False
        )

    created = cli("sandbox", "create", "--label", "suite=cli-real", "--memory", "256M", "--json")
    assert created.returncode == 0, created.stderr
    info = json.loads(created.stdout)
    assert info["state"] == "READY" and info["resources"]["memory_bytes"] == 256 << 20
    ran = cli("sandbox", "exec", info["id"], "--", "sh", "-c", "echo real; exit 9")
    assert (ran.returncode, ran.stdout) == (9, "real\n")
    # Options after the id, as the README writes them, are options, not the command.
    timed = cli("sandbox", "exec", info["id"], "--timeout", "5s", "--", "echo", "in-order")
    assert (timed.returncode, timed.stdout) == (0, "in-order\n"), timed.stderr
    # Too little to start: refused by the service up front, named by its flag, exit 2.
    for flag, value in (("--memory", "1K"), ("--pids", "1")):
        tiny = cli("sandbox", "create", flag, value)
        assert tiny.returncode == 2, tiny.stderr
        last = tiny.stderr.strip().splitlines()[-1]
        assert f"argument {flag}:" in last and "below" in last, tiny.stderr
        assert "Traceback" not in tiny.stderr and "fork server" not in tiny.stderr
    listed = json.loads(cli("sandbox", "ls", "--label", "suite=cli-real", "--json").stdout)
    assert [item["id"] for item in listed] == [info["id"]]
    assert cli("sandbox", "rm", info["id"]).returncode == 0
    gone = cli("sandbox", "get", info["id"])
    assert gone.returncode == 1 and gone.stderr.count("\n") == 1


def test_up_runs_one_artifact_store_that_confines_the_trainer(service: dict[str, Any]) -> None:
    """The trainer and rollout share the store `orchard up` records; a job naming a file of the
    host outside it is refused (PERMISSION_DENIED), a missing one inside it NOT_FOUND."""
    import grpc

    from orchard.core.errors import error_info
    from orchard.trainer.v1 import trainer_service_pb2 as api
    from orchard.trainer.v1 import trainer_service_pb2_grpc

    state = Path(service["state"])
    store = (state / "artifacts").absolute().as_uri()
    assert json.loads((state / "up.json").read_text())["artifacts"] == store
    for name in ("trainer", "rollout"):
        assert f"root: {store}" in (state / f"{name}.yaml").read_text(), name
    address = {c["name"]: c["address"] for c in service["components"]}
    with grpc.insecure_channel(address["orchard-trainer"]) as channel:
        stub = trainer_service_pb2_grpc.TrainerServiceStub(channel)
        for dataset, code, reason in [
            ("file:///etc/passwd", grpc.StatusCode.PERMISSION_DENIED, "ARTIFACT_ACCESS_DENIED"),
            (f"{store}/none.jsonl", grpc.StatusCode.NOT_FOUND, "ARTIFACT_NOT_FOUND"),
        ]:
            spec = api.TrainingJobSpec(
                mode=api.TRAINING_MODE_SFT, model="builtin:tiny", dataset=dataset
            )
            with pytest.raises(grpc.RpcError) as caught:
                stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec), timeout=30)
            assert caught.value.code() == code
            info = error_info(caught.value)
            assert info is not None and info.reason == reason
