"""A local environment stack: an embedded etcd and ``orchard-env`` with the local runtime.

``orchard up`` runs one in the foreground; ``orchard bench env`` runs a private one in a
temporary directory. Both start it the same way::

    with LocalStack(state_dir, listen="127.0.0.1:7100", token=token) as stack:
        ...  # stack.endpoint serves; stack.env_pid, stack.etcd_pid, stack.env_log

``start()`` returns once the service answers health SERVING; ``stop()`` stops orchard-env
(SIGTERM, then SIGKILL) and then etcd, and is safe to call more than once.
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from orchard.sdk.errors import OrchardSDKError

__all__ = ["TENANT", "LocalStack", "StackError", "tail"]

TENANT = "local"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


class StackError(OrchardSDKError):
    """The stack could not start; the message says what and where its log is."""


class LocalStack:
    """etcd (data under ``state_dir/etcd``) and orchard-env (config ``state_dir/env.yaml``, log
    ``state_dir/logs/env.log``, runtime state under ``state_dir/runtime``).

    ``runtime`` overrides keys of the local runtime's settings (e.g. a private
    ``cgroup_parent`` and ``run_dir``); ``settings`` are extra ``--set KEY=VALUE`` strings.
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
    ) -> None:
        self.state_dir = state_dir
        self.listen = listen
        self.token = token
        self.runtime_overrides = dict(runtime or {})
        self.settings = list(settings)
        self.stop_event = stop_event or threading.Event()
        self.etcd_data_dir = etcd_data_dir or state_dir / "etcd"
        self.env_log = state_dir / "logs" / "env.log"
        self.etcd: Any = None
        self.env_process: subprocess.Popen[bytes] | None = None

    # -- what runs ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return self.listen

    @property
    def env_pid(self) -> int:
        return self.env_process.pid if self.env_process is not None else 0

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

        self.env_log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            self.etcd = EmbeddedEtcd(data_dir=self.etcd_data_dir)
            self.etcd.start()
        except (EmbeddedEtcdError, FileNotFoundError) as exc:
            self.etcd = None
            raise StackError(f"etcd did not start: {exc}") from None
        try:
            config = self._write_env_config()
            self.env_process = _start_env(config, self.settings, self.env_log)
            self._wait_serving()
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        return self.env_process is not None and self.env_process.poll() is None

    def stop(self) -> None:
        """Stop orchard-env, then etcd (idempotent)."""
        process, self.env_process = self.env_process, None
        if process is not None:
            _terminate(process)
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

    def _write_env_config(self) -> Path:
        """The orchard-env configuration; it holds the token's digest, never the token."""
        import yaml  # noqa: PLC0415

        config = {
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
        }
        path = self.state_dir / "env.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)
        return path

    def _wait_serving(self) -> None:
        import grpc  # noqa: PLC0415
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

        process = self.env_process
        assert process is not None  # set by start() just before
        deadline = time.monotonic() + START_TIMEOUT_S
        with grpc.insecure_channel(self.listen) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if process.poll() is not None:
                    raise StackError(
                        f"orchard-env exited with status {process.returncode} while starting; "
                        f"see {self.env_log}:\n{tail(self.env_log)}"
                    )
                if self.stop_event.is_set():
                    raise KeyboardInterrupt
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise StackError(
                        f"orchard-env did not serve at {self.listen} within "
                        f"{START_TIMEOUT_S:.0f} s; see {self.env_log}:\n{tail(self.env_log)}"
                    )
                time.sleep(0.1)


def _env_command() -> list[str]:
    script = Path(sys.executable).parent / "orchard-env"
    if script.exists():
        return [str(script)]
    found = shutil.which("orchard-env")
    return [found] if found else [sys.executable, "-m", "orchard.env.main"]


def _start_env(config: Path, settings: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    command = [*_env_command(), "--config", str(config)]
    for setting in settings:
        command += ["--set", setting]
    # Its own settings come from the config file only, not from this shell's ORCHARD_ENV_*.
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_ENV_")}
    with log.open("ab") as out:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environ,
            # Ctrl-C in the terminal reaches the parent only; it stops the children in order.
            start_new_session=True,
        )


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
