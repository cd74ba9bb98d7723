"""A local stack: an embedded etcd, ``orchard-env`` with the local runtime, and optionally the
services built on it (``orchard-reward``), each a child process with its own config and log.

``orchard up`` runs one in the foreground; ``orchard bench env`` and integration tests run
private ones in temporary directories. All start it the same way::

    with LocalStack(state_dir, listen="127.0.0.1:7100", token=token,
                    services={"reward": "127.0.0.1:7200"}) as stack:
        ...  # stack.endpoint serves; stack.processes["reward"].address, .pid, .log

``start()`` returns once every service answers health SERVING; ``stop()`` stops them in reverse
order (SIGTERM, then SIGKILL) and then etcd, and is safe to call more than once.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from orchard.sdk.errors import OrchardSDKError

__all__ = [
    "ENV_TOKEN_VARIABLE",
    "SERVICES",
    "TENANT",
    "LocalStack",
    "ServiceProcess",
    "StackError",
    "tail",
]

TENANT = "local"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


class StackError(OrchardSDKError):
    """The stack could not start; the message says what and where its log is."""


class LocalStack:
    """etcd (data under ``state_dir/etcd``) and orchard-env (config ``state_dir/env.yaml``, log
    ``state_dir/logs/env.log``, runtime state under ``state_dir/runtime``).

    ``runtime`` overrides keys of the local runtime's settings (e.g. a private
    ``cgroup_parent`` and ``run_dir``); ``settings`` are extra ``--set KEY=VALUE`` strings for
    orchard-env. ``services`` names the services to start after it, each with its listen
    address (see :data:`SERVICES`); they reach orchard-env with the stack's token.
    The stack's tenant may use the ``host`` image, which hides the whole state dir, etcd's
    files and ``host_masked_paths`` (e.g. a profile kept elsewhere); ``spec.env`` values are
    sealed in etcd with the key ``state_dir/secrets.key`` (made on first start, mode 0600).
    ``stop_event``, when set while starting, aborts the start with KeyboardInterrupt.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        listen: str,
        token: str,
        runtime: Mapping[str, Any] | None = None,
        settings: Sequence[str] = (),
        stop_event: threading.Event | None = None,
        etcd_data_dir: Path | None = None,
        services: Mapping[str, str] | None = None,
        service_settings: Mapping[str, Mapping[str, Any]] | None = None,
        host_masked_paths: Sequence[Path] = (),
    ) -> None:
        unknown = sorted(set(services or {}) - set(SERVICES))
        if unknown:
            raise StackError(f"unknown service(s) {unknown}: choose from {sorted(SERVICES)}")
        self.state_dir = state_dir
        self.listen = listen
        self.token = token
        self.runtime_overrides = dict(runtime or {})
        self.settings = list(settings)
        self.stop_event = stop_event or threading.Event()
        self.etcd_data_dir = etcd_data_dir or state_dir / "etcd"
        self.host_masked_paths = list(host_masked_paths)
        """Hidden from `host` sandboxes besides the state dir and etcd's files (the profile)."""
        self.etcd: Any = None
        self.extra_services = dict(services or {})
        self.service_settings = {k: dict(v) for k, v in (service_settings or {}).items()}
        """Per service, top-level config sections merged over what the stack writes (e.g.
        {"rollout": {"server": {"metrics_address": ...}, "policies": {...}}})."""
        self.processes: dict[str, ServiceProcess] = {}
        """The running services by name ("env" first), in start order."""

    @property
    def artifacts_url(self) -> str:
        """The stack's artifact store, a ``file://`` folder in the state dir: models, datasets,
        checkpoints and published weights, by URL (recorded in ``up.json``)."""
        return (self.state_dir / "artifacts").absolute().as_uri()

    # -- what runs ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return self.listen

    @property
    def env_process(self) -> subprocess.Popen[bytes] | None:
        env = self.processes.get("env")
        return env.process if env is not None else None

    @property
    def env_pid(self) -> int:
        env = self.processes.get("env")
        return env.pid if env is not None else 0

    @property
    def etcd_pid(self) -> int:
        return int(self.etcd.pid or 0) if self.etcd is not None else 0

    @property
    def etcd_endpoint(self) -> str:
        return str(self.etcd.endpoint) if self.etcd is not None else ""

    @property
    def etcd_log(self) -> str:
        # EmbeddedEtcd keeps its log beside its temporary working files.
        return str(self.etcd._log_path) if self.etcd is not None else ""

    def runtime_settings(self) -> dict[str, Any]:
        """The local runtime's settings as written to env.yaml."""
        runtime = self.state_dir / "runtime"
        return {
            "type": "local",
            "state_dir": str(runtime / "state"),
            "workspace_dir": str(runtime / "sandboxes"),
            **self.runtime_overrides,
        }

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        from orchard.core.etcd import EmbeddedEtcd, EmbeddedEtcdError  # noqa: PLC0415

        try:
            self.etcd = EmbeddedEtcd(data_dir=self.etcd_data_dir)
            self.etcd.start()
        except (EmbeddedEtcdError, FileNotFoundError) as exc:
            self.etcd = None
            raise StackError(f"etcd did not start: {exc}") from None
        try:
            env = ServiceProcess("env", self.listen, self._env_config(), self.state_dir)
            self.processes["env"] = env
            env.start(self.settings, self.stop_event)
            for name in [n for n in SERVICES if n in self.extra_services]:
                address = self.extra_services[name]
                config = SERVICES[name](self, address)
                for section, value in self.service_settings.get(name, {}).items():
                    current = config.get(section)
                    merged = {**current, **value} if isinstance(current, dict) else value
                    config[section] = merged
                process = ServiceProcess(
                    name, address, config, self.state_dir, environ={ENV_TOKEN_VARIABLE: self.token}
                )
                self.processes[name] = process
                process.start((), self.stop_event)
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        """Whether every service still runs."""
        return bool(self.processes) and all(p.alive() for p in self.processes.values())

    def exited(self) -> ServiceProcess | None:
        """A service that has exited, if any."""
        return next((p for p in self.processes.values() if not p.alive()), None)

    def stop(self) -> None:
        """Stop the services in reverse order, then etcd (idempotent)."""
        while self.processes:
            _, process = self.processes.popitem()
            process.stop()
        etcd, self.etcd = self.etcd, None
        if etcd is not None:
            etcd.stop()

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- helpers -----------------------------------------------------------------------------

    def _env_config(self) -> dict[str, Any]:
        """The orchard-env configuration; it holds the token's digest, never the token."""
        return {
            "server": {"listen": [self.listen]},
            "etcd": {"endpoints": [self.etcd_endpoint]},
            "auth": {
                "tenants": {
                    TENANT: {
                        "tokens": ["sha256:" + hashlib.sha256(self.token.encode()).hexdigest()]
                    }
                }
            },
            "runtime": self.runtime_settings(),
            # The person running the stack is the operator: the host image is theirs, and it
            # hides everything of the stack's (etcd data, profile and token, logs, configs,
            # checkpoints, the secrets key).
            "images": {
                "tenants": {TENANT: {"allow_host": True}},
                "host_masked_paths": [str(path) for path in self._private_paths()],
            },
            "secrets": {"key_file": str(self.state_dir / "secrets.key")},
        }

    def _private_paths(self) -> list[Path]:
        paths = [self.state_dir, self.etcd_data_dir, *self.host_masked_paths]
        if self.etcd_log:
            paths.append(Path(self.etcd_log).parent)  # etcd's working directory
        return paths


ENV_TOKEN_VARIABLE = "ORCHARD_STACK_ENV_TOKEN"
"""Where services of the stack find the token for orchard-env (never in a config file)."""


def _reward_config(stack: LocalStack, address: str) -> dict[str, Any]:
    return {
        "server": {"listen": [address]},
        "env": {"endpoint": stack.listen, "token_env": ENV_TOKEN_VARIABLE},
        # The default model judge, and the scripted judge recipes name "scripted" (credit and
        # the scripted rubric grader).
        "judges": {"default": {}, "scripted": {"kind": "scripted"}},
    }


def _rollout_config(stack: LocalStack, address: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "server": {"listen": [address]},
        "etcd": {"endpoints": [stack.etcd_endpoint]},
        "env": {"endpoint": stack.listen, "token_env": ENV_TOKEN_VARIABLE},
        # the store recipes put task files in and the trainer publishes weights to
        "artifacts": {"root": stack.artifacts_url},
    }
    reward = stack.extra_services.get("reward")
    if reward:
        config["reward"] = {"endpoint": reward}
    return config


def _trainer_config(stack: LocalStack, address: str) -> dict[str, Any]:
    return {
        "server": {"listen": [address]},
        "etcd": {"endpoints": [stack.etcd_endpoint]},
        # Models and datasets by URL from the stack's one artifact store; checkpoints and
        # published weights go there too (the rollout's engines read them from it).
        "artifacts": {"root": stack.artifacts_url},
        "weights": {"scratch_dir": str(stack.state_dir / "trainer-scratch")},
    }


SERVICES: dict[str, Callable[[LocalStack, str], dict[str, Any]]] = {
    "reward": _reward_config,
    "rollout": _rollout_config,
    "trainer": _trainer_config,
}
"""Services a stack can run beside orchard-env, by name: how to configure each for it (in
start order: rollout after reward, whose address it is given)."""

SUBCOMMANDS: dict[str, tuple[str, ...]] = {"trainer": ("serve",)}
"""Arguments a service's command takes before its flags (``orchard-trainer serve``)."""

SETTING_VARIABLES: dict[str, tuple[str, ...]] = {"rollout": ("ORCHARD_GUI_BROWSER_DIR",)}
"""Variables besides ``ORCHARD_<NAME>_*`` a service takes settings from, kept from it like
those: the browser folder comes with the user namespaces it needs (``orchard up``), or not."""


class ServiceProcess:
    """One ``orchard-<name>`` child process: its config in ``state_dir/<name>.yaml``, its log
    in ``state_dir/logs/<name>.log``; serving once its gRPC health says SERVING."""

    def __init__(
        self,
        name: str,
        address: str,
        config: Mapping[str, Any],
        state_dir: Path,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.program = f"orchard-{name}"
        self.address = address
        self.config = dict(config)
        self.config_path = state_dir / f"{name}.yaml"
        self.log = state_dir / "logs" / f"{name}.log"
        self.environ = dict(environ or {})
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.returncode if self.process is not None else None

    def start(self, settings: Sequence[str], stop_event: threading.Event) -> None:
        """Start it and wait until it serves; StackError says why not, with its log."""
        import yaml  # noqa: PLC0415

        self.log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.config_path.chmod(0o600)
        command = [*_command(self.program, f"orchard.{self.name}.main")]
        command += [*SUBCOMMANDS.get(self.name, ()), "--config", str(self.config_path)]
        for setting in settings:
            command += ["--set", setting]
        # Its settings come from its config file only, not from this shell's ORCHARD_<NAME>_*
        # (nor SETTING_VARIABLES).
        prefix = f"ORCHARD_{self.name.upper()}_"
        unset = SETTING_VARIABLES.get(self.name, ())
        environ = {
            k: v for k, v in os.environ.items() if not k.startswith(prefix) and k not in unset
        }
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**environ, **self.environ},
                # Ctrl-C in the terminal reaches the parent only; it stops the children in order.
                start_new_session=True,
            )
        self._wait_serving(stop_event)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            _terminate(process)
            self.process = process  # keep its exit status readable

    def _wait_serving(self, stop_event: threading.Event) -> None:
        import grpc  # noqa: PLC0415
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

        process = self.process
        assert process is not None  # set by start() just before
        deadline = time.monotonic() + START_TIMEOUT_S
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if process.poll() is not None:
                    raise StackError(
                        f"{self.program} exited with status {process.returncode} while "
                        f"starting; see {self.log}:\n{tail(self.log)}"
                    )
                if stop_event.is_set():
                    raise KeyboardInterrupt
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise StackError(
                        f"{self.program} did not serve at {self.address} within "
                        f"{START_TIMEOUT_S:.0f} s; see {self.log}:\n{tail(self.log)}"
                    )
                time.sleep(0.1)


def _command(program: str, module: str) -> list[str]:
    script = Path(sys.executable).parent / program
    if script.exists():
        return [str(script)]
    found = shutil.which(program)
    return [found] if found else [sys.executable, "-m", module]


def _terminate(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def tail(log: Path, lines: int = 20) -> str:
    """The last lines of a log file ("" when unreadable)."""
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return ""
