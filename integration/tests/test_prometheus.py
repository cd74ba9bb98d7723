"""A real Prometheus server scrapes the services and answers PromQL about them.

The Prometheus binary is the distribution's package (`make setup` installs it); it scrapes the
environment service's /metrics every half second while the test creates sandboxes and runs
commands through the SDK, and the test then asks it, over its HTTP API, the questions the
report and the dashboards ask: how many sandboxes are in each state, how many commands ran and
how long they took.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from orchard.sdk import SandboxClient

from .conftest import private_stack

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Prometheus:
    """A Prometheus server process with a scrape configuration of our own."""

    def __init__(self, folder: Path, targets: dict[str, str]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is not installed: run `make setup` (tools/setup-system.sh)")
        self.port = _free_port()
        jobs = [
            {"job_name": job, "static_configs": [{"targets": [address]}]}
            for job, address in targets.items()
        ]
        config = {"global": {"scrape_interval": "500ms", "scrape_timeout": "400ms"}}
        config["scrape_configs"] = jobs  # type: ignore[assignment]
        (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = folder / "prometheus.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={folder / 'prometheus.yml'}",
                    f"--storage.tsdb.path={folder / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        pytest.fail(f"prometheus not ready after 30 s: {self.log.read_text()[-2000:]}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": promql}
        )
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, promql: str, timeout: float = 20.0) -> float:
        """The single value of an instant query, once Prometheus has one."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if result:
                return float(result[0]["value"][1])
            if time.monotonic() > deadline:
                raise AssertionError(f"no value for {promql} after {timeout} s")
            time.sleep(0.25)

    def wait_for(self, promql: str, expected: float, timeout: float = 20.0) -> float:
        """Waits until the query gives ``expected`` (scrapes lag by an interval)."""
        deadline = time.monotonic() + timeout
        value = float("nan")
        while time.monotonic() < deadline:
            result = self.query(promql)
            if result:
                value = float(result[0]["value"][1])
                if value == expected:
                    return value
            time.sleep(0.25)
        raise AssertionError(f"{promql} = {value}, expected {expected}")

    def targets_up(self) -> dict[str, float]:
        return {r["metric"]["job"]: float(r["value"][1]) for r in self.query("up")}

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory, env_stack: Any) -> Iterator[Prometheus]:
    server = Prometheus(
        tmp_path_factory.mktemp("prometheus"), {"orchard-env": env_stack.metrics_address}
    )
    try:
        yield server
    finally:
        server.stop()


def test_prometheus_scrapes_the_env_service_and_answers_promql(
    env_stack: Any, prometheus: Prometheus
) -> None:
    prometheus.wait_for('up{job="orchard-env"}', 1.0)

    with SandboxClient(env_stack.endpoint, token=env_stack.token) as client:
        sandboxes = [client.create(labels={"test": "prometheus"}) for _ in range(2)]
        try:
            for sandbox in sandboxes:
                for i in range(3):
                    assert sandbox.exec(f"echo {i}").exit_code == 0
            # Two READY sandboxes while they live: the gauge the leak alert watches.
            prometheus.wait_for('sum(orchard_env_sandboxes{state="READY"})', 2.0)
            prometheus.wait_for('sum(orchard_env_exec_seconds_count{code="OK"})', 6.0)
            p50 = prometheus.value(
                "histogram_quantile(0.5, sum by (le) (orchard_env_exec_seconds_bucket))"
            )
            assert 0 < p50 < 5.0
        finally:
            for sandbox in sandboxes:
                sandbox.delete()

    prometheus.wait_for('sum(orchard_env_sandboxes{state="READY"})', 0.0)
    assert prometheus.value("sum(orchard_env_create_seconds_count)") == 2.0
    assert prometheus.targets_up() == {"orchard-env": 1.0}


# -- every service ----------------------------------------------------------------------------

SCRIPT = {
    "model": "scripted",
    "plans": [
        {
            "match": "marker file",
            "solve_rate": 0.5,
            "solution": [
                {
                    "thought": "I create it.",
                    "tool": "bash",
                    "arguments": {"command": "touch /tmp/m"},
                },
                {"thought": "Done.", "tool": "submit", "arguments": {}},
            ],
            "failure": [{"thought": "Nothing to do.", "tool": "submit", "arguments": {}}],
        }
    ],
}


@pytest.fixture(scope="module")
def scripted_policy() -> Iterator[str]:
    """The scripted policy on loopback, served from a thread of its own."""
    import asyncio
    import threading

    from orchard.rollout.scripted_policy import PolicyScript, ScriptedPolicyServer

    loop = asyncio.new_event_loop()
    server = ScriptedPolicyServer(PolicyScript.from_json(SCRIPT), seed=1)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=30)
    try:
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


@dataclass(frozen=True)
class Everything:
    addresses: dict[str, str]
    metrics: dict[str, str]
    prometheus: Prometheus


@pytest.fixture(scope="module")
def everything(
    tmp_path_factory: pytest.TempPathFactory, scripted_policy: str
) -> Iterator[Everything]:
    names = ("reward", "rollout", "trainer")
    addresses = {name: f"127.0.0.1:{_free_port()}" for name in names}
    metrics = {name: f"127.0.0.1:{_free_port()}" for name in names}
    settings: dict[str, dict[str, Any]] = {
        name: {"server": {"metrics_address": metrics[name]}} for name in names
    }
    settings["rollout"]["policies"] = {
        "scripted": {"kind": "openai", "base_url": scripted_policy, "model": "scripted"}
    }
    settings["rollout"]["default_policy"] = "scripted"
    with private_stack(tmp_path_factory, addresses, settings) as env:
        targets = {"orchard-env": env.metrics_address}
        targets.update({f"orchard-{name}": metrics[name] for name in names})
        server = Prometheus(tmp_path_factory.mktemp("prometheus-all"), targets)
        try:
            yield Everything({"env": env.endpoint, **addresses}, metrics, server)
        finally:
            server.stop()


def test_prometheus_scrapes_every_service_and_answers_rollout_progress(
    everything: Everything,
) -> None:
    import grpc

    from orchard.rollout.v1 import rollout_service_pb2 as api
    from orchard.rollout.v1 import rollout_service_pb2_grpc

    prometheus = everything.prometheus
    deadline = time.monotonic() + 30
    while set(prometheus.targets_up().values()) != {1.0} or len(prometheus.targets_up()) < 4:
        assert time.monotonic() < deadline, prometheus.targets_up()
        time.sleep(0.25)
    assert set(prometheus.targets_up()) == {
        "orchard-env", "orchard-reward", "orchard-rollout", "orchard-trainer"
    }  # fmt: skip

    tasks = [
        api.RolloutTask(
            id=f"marker-{i}",
            image="host",
            instruction="Create the marker file /tmp/m, then submit.",
            scorer_json=json.dumps({"check": {"command": "test -f /tmp/m"}}),
        )
        for i in range(2)
    ]
    spec = api.RolloutJobSpec(
        tasks=tasks,
        harnesses=["builtin:bash"],
        sampler=api.SamplerConfig(kind=api.SAMPLER_KIND_FIXED_N, group_size=2),
        budget=api.RolloutBudget(max_steps=4),
        concurrency=2,
    )
    with grpc.insecure_channel(everything.addresses["rollout"]) as channel:
        stub = rollout_service_pb2_grpc.RolloutServiceStub(channel)
        job = stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec), timeout=30).job
        deadline = time.monotonic() + 120
        while job.state == api.ROLLOUT_JOB_STATE_RUNNING:
            assert time.monotonic() < deadline, job
            time.sleep(0.5)
            job = stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=job.id), timeout=10).job
    assert job.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, job.error
    assert job.rollouts_done == 4

    # Rollout progress, as the dashboard asks it; the scrape lags by an interval.
    prometheus.wait_for("sum(orchard_rollout_rollouts_started_total)", 4.0)
    prometheus.wait_for("sum(orchard_rollout_rollouts_finished_total)", 4.0)
    prometheus.wait_for(
        "(sum(orchard_rollout_groups_emitted_total) or vector(0))"
        " + (sum(orchard_rollout_groups_dropped_total) or vector(0))",
        2.0,
    )
    tool_p50 = prometheus.value(
        'histogram_quantile(0.5, sum by (le) (orchard_rollout_step_seconds_bucket{part="tool"}))'
    )
    assert 0 < tool_p50 < 60
    # The sandboxes those rollouts ran in, and their commands, from the env service (scraped on
    # its own schedule, so it may lag the rollout service's numbers by an interval).
    prometheus.wait_for("sum(orchard_env_create_seconds_count) >= bool 4", 1.0)
    prometheus.wait_for('sum(orchard_env_exec_seconds_count{code="OK"}) >= bool 4', 1.0)
    # The reward and trainer services export their own families.
    assert prometheus.query('{__name__=~"orchard_trainer_.*"}')
    assert prometheus.query('{__name__=~"orchard_reward_.*"}')
