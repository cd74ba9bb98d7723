"""The fuzz target: a real ``orchard-env`` process over the real ``local`` runtime receives, for
``ORCHARD_FUZZ_SECONDS`` (default 60), requests hypothesis builds from the EnvService message
descriptors (random field values, huge strings, deep paths, unicode, negative and extreme
numbers, label and env maps, out-of-range durations) and raw byte garbage, with a tenant's
token. What must hold: no INTERNAL, UNKNOWN or DATA_LOSS status and no UNAVAILABLE or
RESOURCE_EXHAUSTED without the service's ErrorInfo; no traceback in the service's log; health
SERVING after the run; the runtime's sandboxes are those the records name, and nothing is left
once the tenant deletes what it made. The numbers (requests, requests/s, statuses) go to the
terminal summary and to ``bench/results/fuzz.json``."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from orchard.core.errors import error_info
from orchard.env.v1 import env_pb2, env_service_pb2
from orchard.env.v1 import env_service_pb2 as api
from orchard.types.v1 import exec_pb2

pytestmark = [pytest.mark.root, pytest.mark.slow]

SERVICE = env_service_pb2.DESCRIPTOR.services_by_name["EnvService"]
TOKEN = "fuzz-token"
METADATA = (("authorization", f"Bearer {TOKEN}"),)
FUZZ_SECONDS = float(os.environ.get("ORCHARD_FUZZ_SECONDS", "60"))
CALL_TIMEOUT_S = 3.0
RESULTS = Path(__file__).resolve().parents[4] / "bench" / "results" / "fuzz.json"
ENV_BINARY = str(Path(sys.executable).parent / "orchard-env")
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}
# Statuses the service itself returns with an ErrorInfo; without one they came from elsewhere
# (a crashed handler, the transport, metadata over gRPC's limit).
NEED_ERROR_INFO = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}

# -- strategies from the descriptors ---------------------------------------------------------

_TEXT = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40)
_NASTY_STRINGS = [
    "",
    ".",
    "..",
    "/",
    "../" * 300,
    "/" + "a/" * 1500,
    "a" * 100_000,
    "x" * 1_000_000,
    "\x00",
    "a\x00b",
    "\u202e\u0301\U0001f600",
    "%s%n%x",
    "${HOME}$(id)`id`",
    "sbx-" + "0" * 12,
    "own-" + "0" * 12,
    "-1",
    "\n\r\t",
    "/proc/1/mem",
    "/proc/self/root/../../../../etc/shadow",
]
_STRINGS = st.one_of(_TEXT, st.sampled_from(_NASTY_STRINGS))
_INTS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


class Targets:
    """Ids of live resources the fuzzer aims at (besides random ones), updated as it runs."""

    def __init__(self) -> None:
        self.target = ""  # the READY sandbox exec and file calls aim at
        self.sandbox_ids: list[str] = []  # every sandbox created
        self.owner_ids: list[str] = []
        self.images: list[str] = ["host"]

    def pick(self, values: Callable[[], list[str]]) -> st.SearchStrategy[str]:
        return st.integers(0, 1 << 16).map(lambda i: _nth(values(), i))


def _nth(values: list[str], index: int) -> str:
    return values[index % len(values)] if values else ""


def _int(field: FieldDescriptor) -> st.SearchStrategy[int]:
    low, high = _INTS[field.type]
    edges = [low, high, 0, 1, -1 if low < 0 else 2, 64, 1000, 1 << 20]
    return st.one_of(
        st.sampled_from([e for e in edges if low <= e <= high]), st.integers(low, high)
    )


def _aimed(known: st.SearchStrategy[str], one_in: int) -> st.SearchStrategy[str]:
    """A live id once in ``one_in`` draws, anything else otherwise."""
    return st.integers(1, one_in).flatmap(lambda n: known if n == 1 else _STRINGS)


def _string(field: FieldDescriptor, targets: Targets) -> st.SearchStrategy[str]:
    # Deletes hit a live target rarely, so the other calls find it alive most of the time.
    deleting = field.containing_type.name.startswith("Delete")
    if field.name == "sandbox_id" and deleting:
        return _aimed(targets.pick(lambda: targets.sandbox_ids), 20)
    if field.name == "sandbox_id":
        return _aimed(targets.pick(lambda: [targets.target]), 2)
    if field.name == "owner_id":
        return _aimed(targets.pick(lambda: targets.owner_ids), 20 if deleting else 2)
    if field.name == "image":
        return st.one_of(targets.pick(lambda: targets.images), _STRINGS)
    return _STRINGS


def _scalar(field: FieldDescriptor, targets: Targets) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_STRING:
        return _string(field, targets)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=4096), st.just(b"\0" * (1 << 20)))
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if field.type == FieldDescriptor.TYPE_ENUM:
        known = [value.number for value in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    return _int(field)


def _value(field: FieldDescriptor, targets: Targets, depth: int) -> st.SearchStrategy[Any]:
    if field.message_type is exec_pb2.Command.DESCRIPTOR:
        # Half plain shell commands, so exec reaches the agent and runs something.
        simple = _STRINGS.map(lambda script: exec_pb2.Command(shell=script))
        return st.one_of(simple, message(field.message_type, targets, depth + 1))
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message(field.message_type, targets, depth + 1)
    return _scalar(field, targets)


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _field(field: FieldDescriptor, targets: Targets, depth: int) -> st.SearchStrategy[Any]:
    if _is_map(field):
        key, value = (field.message_type.fields_by_name[n] for n in ("key", "value"))
        return st.dictionaries(_scalar(key, targets), _value(value, targets, depth), max_size=6)
    if field.is_repeated:
        return st.lists(_value(field, targets, depth), max_size=5)
    return _value(field, targets, depth)


def _fill(descriptor: Descriptor, values: dict[str, Any]) -> Message:
    from google.protobuf import message_factory

    made: Message = message_factory.GetMessageClass(descriptor)()
    for name, value in values.items():
        field = descriptor.fields_by_name[name]
        if _is_map(field):
            target = getattr(made, name)
            for key, item in value.items():
                if isinstance(item, Message):
                    target[key].CopyFrom(item)
                else:
                    target[key] = item
        elif field.is_repeated:
            getattr(made, name).extend(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(made, name).CopyFrom(value)
        else:
            setattr(made, name, value)
    return made


_ALWAYS = ("sandbox_id", "owner_id", "command", "path")
_ENDINGS = ("Request", "Header")


def message(descriptor: Descriptor, targets: Targets, depth: int = 0) -> st.SearchStrategy[Any]:
    """Messages of ``descriptor`` with any subset of fields set to fuzzed values."""
    if depth > 4:
        return st.just(_fill(descriptor, {}))
    fields = {f.name: _field(f, targets, depth) for f in descriptor.fields}
    # What names the target is always set, so most requests get past the first check.
    always = {name for name in _ALWAYS if name in fields and descriptor.name.endswith(_ENDINGS)}
    return st.fixed_dictionaries({name: fields.pop(name) for name in always}, optional=fields).map(
        lambda v: _fill(descriptor, v)
    )


def write_stream(targets: Targets) -> st.SearchStrategy[list[Message]]:
    """WriteFile streams: mostly header then data, also headers later, no header, nothing."""
    one = message(api.WriteFileRequest.DESCRIPTOR, targets)
    header = message(api.WriteFileHeader.DESCRIPTOR, targets).map(
        lambda h: api.WriteFileRequest(header=h)
    )
    return st.one_of(
        st.tuples(header, st.lists(one, max_size=4)).map(lambda t: [t[0], *t[1]]),
        st.lists(one, max_size=4),
    )


# -- sending -------------------------------------------------------------------------------


class Fuzzer:
    """Sends requests over one channel and keeps the histogram and the bad answers."""

    def __init__(self, channel: grpc.Channel, targets: Targets) -> None:
        self.channel = channel
        self.targets = targets
        self.statuses: collections.Counter[str] = collections.Counter()
        self.by_method: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.bad: list[str] = []
        self.wrong: collections.Counter[str] = collections.Counter()
        self.sent = 0
        self.garbage = 0

    def _callable(self, method: MethodDescriptor, raw: bool) -> Any:
        path = f"/{SERVICE.full_name}/{method.name}"
        serialize = None if raw else _serialize
        kind = (method.client_streaming, method.server_streaming)
        factory = {
            (False, False): self.channel.unary_unary,
            (False, True): self.channel.unary_stream,
            (True, False): self.channel.stream_unary,
        }[kind]
        return factory(path, request_serializer=serialize, response_deserializer=None)

    def send(self, method: MethodDescriptor, request: Any, raw: bool) -> None:
        call = self._callable(method, raw)
        code = grpc.StatusCode.OK
        detail = ""
        try:
            if method.server_streaming:
                for _ in call(request, metadata=METADATA, timeout=CALL_TIMEOUT_S):
                    pass
            elif method.client_streaming:
                call(iter(request), metadata=METADATA, timeout=CALL_TIMEOUT_S)
            else:
                reply = call(request, metadata=METADATA, timeout=CALL_TIMEOUT_S)
                self._learn(method, reply)
        except grpc.RpcError as exc:
            code = exc.code()
            detail = f"{exc.details()!s:.300}"
            if code in NEED_ERROR_INFO and error_info(exc) is None:
                self._bad(method, request, f"{code.name} without ErrorInfo", detail, raw)
            elif code in NEVER:
                self._bad(method, request, code.name, detail, raw)
        self.sent += 1
        self.garbage += raw
        self.statuses[code.name] += 1
        self.by_method[method.name][code.name] += 1

    def _bad(
        self, method: MethodDescriptor, request: Any, what: str, detail: str, raw: bool
    ) -> None:
        self.wrong[f"{what} ({'raw garbage' if raw else 'structured'})"] += 1
        if len(self.bad) < 200:
            shown = request if isinstance(request, bytes) else str(request)
            self.bad.append(f"{method.name} {what}: {detail} <- {shown!r:.300}")

    def _learn(self, method: MethodDescriptor, reply: bytes) -> None:
        """Aim later requests at what this one created."""
        if method.name == "CreateSandbox":
            sandbox = api.CreateSandboxResponse.FromString(reply).sandbox
            self.targets.sandbox_ids.append(sandbox.id)
        elif method.name == "CreateOwner":
            self.targets.owner_ids.append(api.CreateOwnerResponse.FromString(reply).owner.id)


def _serialize(request: Message) -> bytes:
    return request.SerializeToString()


# -- the real service ----------------------------------------------------------------------


class EnvProcess:
    """``orchard-env`` with the local runtime on private folders and cgroups."""

    def __init__(self, base: Path, etcd_endpoint: str, busybox_root: Path) -> None:
        self.base = base
        self.run_dir = tempfile.mkdtemp(prefix="orc-")  # the agent socket path must stay short
        self.cgroup_parent = f"orchard-test-{uuid.uuid4().hex[:8]}"
        self.address = f"unix:{self.run_dir}/env.sock"
        self.runtime = {
            "type": "local",
            "state_dir": str(base / "state"),
            "workspace_dir": str(base / "sandboxes"),
            "image_cache_dir": str(base / "images"),
            "run_dir": self.run_dir,
            "cgroup_parent": self.cgroup_parent,
            "start_timeout_s": 30,
        }
        config = {
            "server": {"listen": [self.address], "grace_period_s": 1},
            "etcd": {"endpoints": [etcd_endpoint], "prefix": f"test-fuzz/{uuid.uuid4().hex[:8]}/"},
            "auth": {"tenants": {"fuzz": {"tokens": [TOKEN]}}},
            "runtime": self.runtime,
            # As operator: the host image and the busybox root for every tenant.
            "images": {"allow_host": True, "allowed_paths": [str(busybox_root.parent)]},
            "secrets": {"key_file": str(base / "secrets.key")},
            # Bounded: creations past these are RESOURCE_EXHAUSTED (with ErrorInfo).
            "admission": {"max_sandboxes_per_tenant": 4, "max_queued": 4},
            "reconcile_interval_s": 5,
        }
        self.config_path = base / "env.json"
        self.config_path.write_text(json.dumps(config))
        self.log = base / "env.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.busybox_image = f"rootfs:{busybox_root}"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_ENV_")}
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [ENV_BINARY, "--config", str(self.config_path)], stderr=log, env=env
            )

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_serving(self, channel: grpc.Channel, timeout_s: float = 30) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.alive(), f"orchard-env exited:\n{self.log_tail()}"
            with contextlib.suppress(grpc.RpcError):
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            assert time.monotonic() < deadline, f"orchard-env never served:\n{self.log_tail()}"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def runtime_ids(self) -> set[str]:
        """Sandboxes the runtime holds anything of: state, folders, cgroups."""
        found: set[str] = set()
        for key in ("state_dir", "workspace_dir", "run_dir"):
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(self.runtime[key]):
                    if entry.name.startswith("sbx-"):
                        found.add(entry.name.removesuffix(".json"))
        # Sandbox ids only: pooled sandboxes ("_shell-...") wait there while the service runs.
        for parent in self.cgroup_dirs():
            found.update(
                entry.name
                for entry in os.scandir(parent)
                if entry.is_dir() and entry.name.startswith("sbx-")
            )
        return found

    def cgroup_dirs(self) -> list[str]:
        """This process's cgroup parents, wherever the hierarchies put them."""
        found = []
        mounts = [
            line.split()[4]
            for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if " - cgroup" in line
        ]
        own = {
            line.split(":", 2)[2].strip()
            for line in Path("/proc/self/cgroup").read_text().splitlines()
        }
        for mount in mounts:
            for prefix in own | {"/"}:
                candidate = os.path.normpath(f"{mount}/{prefix}/{self.cgroup_parent}")
                if os.path.isdir(candidate) and candidate not in found:
                    found.append(candidate)
        return found

    def delete_all(self) -> None:
        """Delete every sandbox and owner of the tenant (a failed run may have left some: a
        stopped service keeps its sandboxes for the next start)."""
        if not self.alive():
            return
        with grpc.insecure_channel(self.address) as channel, contextlib.suppress(grpc.RpcError):
            stub = _stub(channel)
            for sandbox in _records(stub):
                stub.DeleteSandbox(
                    api.DeleteSandboxRequest(sandbox_id=sandbox.id), metadata=METADATA, timeout=60
                )

    def remove_leftovers(self) -> None:
        import shutil

        for parent in self.cgroup_dirs():
            for child in Path(parent).iterdir():
                if child.is_dir():
                    with contextlib.suppress(OSError):
                        child.rmdir()  # only empty ones: a live process keeps its cgroup
            with contextlib.suppress(OSError):
                os.rmdir(parent)
        shutil.rmtree(self.run_dir, ignore_errors=True)


@pytest.fixture
def env_process(tmp_path: Path, etcd: Any, busybox_root: Path) -> Iterator[EnvProcess]:
    process = EnvProcess(tmp_path, etcd.endpoint, busybox_root)
    process.start()
    try:
        yield process
    finally:
        process.delete_all()
        process.stop()
        process.remove_leftovers()


def _stub(channel: grpc.Channel) -> Any:
    from orchard.env.v1 import env_service_pb2_grpc

    return env_service_pb2_grpc.EnvServiceStub(channel)


def _ready_sandbox(stub: Any, image: str) -> str:
    reply = stub.CreateSandbox(
        api.CreateSandboxRequest(spec=env_pb2.SandboxSpec(image=image)), metadata=METADATA
    )
    wait = api.WaitSandboxRequest(sandbox_id=reply.sandbox.id)
    wait.timeout.FromSeconds(60)
    sandbox = stub.WaitSandbox(wait, metadata=METADATA, timeout=70).sandbox
    assert sandbox.state == env_pb2.SANDBOX_STATE_READY, sandbox
    return str(sandbox.id)


def _records(stub: Any) -> list[env_pb2.Sandbox]:
    found: list[env_pb2.Sandbox] = []
    token = ""
    while True:
        page = stub.ListSandboxes(
            api.ListSandboxesRequest(page_size=1000, page_token=token), metadata=METADATA
        )
        found += page.sandboxes
        token = page.next_page_token
        if not token:
            return found


def _settle(stub: Any) -> list[env_pb2.Sandbox]:
    """The records once no creation is in flight (PENDING ones waited for)."""
    for sandbox in _records(stub):
        if sandbox.state == env_pb2.SANDBOX_STATE_PENDING:
            wait = api.WaitSandboxRequest(sandbox_id=sandbox.id)
            wait.timeout.FromSeconds(60)
            with contextlib.suppress(grpc.RpcError):
                stub.WaitSandbox(wait, metadata=METADATA, timeout=70)
    return _records(stub)


def _live(records: list[env_pb2.Sandbox]) -> set[str]:
    """The sandboxes that should hold runtime resources."""
    return {s.id for s in records if s.state != env_pb2.SANDBOX_STATE_FAILED}


def _converged(
    observe: Callable[[], tuple[set[str], set[str]]], timeout_s: float = 20
) -> tuple[set[str], set[str]]:
    """``observe()`` once both sets are equal, or its last answer after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        records, runtime = observe()
        if records == runtime or time.monotonic() > deadline:
            return records, runtime
        time.sleep(0.2)


def _tidy(stub: Any, keep: set[str]) -> None:
    """Delete the tenant's sandboxes except ``keep``, so creations are not all refused."""
    for sandbox in _records(stub):
        if sandbox.id not in keep:
            stub.DeleteSandbox(api.DeleteSandboxRequest(sandbox_id=sandbox.id), metadata=METADATA)


def test_fuzzed_requests_never_break_the_service(
    env_process: EnvProcess, summary: list[str]
) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(env_process.address) as channel:
        env_process.wait_serving(channel)
        stub = _stub(channel)
        targets = Targets()
        targets.images = ["host", env_process.busybox_image, "rootfs:/", "rootfs:/proc/self/root"]
        targets.target = _ready_sandbox(stub, env_process.busybox_image)
        targets.sandbox_ids.append(targets.target)
        owner = stub.CreateOwner(api.CreateOwnerRequest(), metadata=METADATA).owner.id
        targets.owner_ids.append(owner)
        fuzzer = Fuzzer(channel, targets)
        methods = list(SERVICE.methods)
        structured = {
            m.name: (
                write_stream(targets) if m.client_streaming else message(m.input_type, targets)
            )
            for m in methods
        }

        @settings(
            max_examples=50,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(data=st.data())
        def batch(data: st.DataObject) -> None:
            method = data.draw(st.sampled_from(methods))
            if data.draw(st.integers(0, 4)) == 0:
                garbage = data.draw(st.binary(max_size=2048))
                fuzzer.send(method, [garbage] if method.client_streaming else garbage, raw=True)
            else:
                fuzzer.send(method, data.draw(structured[method.name]), raw=False)

        started = time.monotonic()
        while time.monotonic() - started < FUZZ_SECONDS:
            batch()
            assert env_process.alive(), f"orchard-env exited:\n{env_process.log_tail()}"
            _tidy(stub, {targets.target})
            if targets.target not in {s.id for s in _records(stub)}:
                targets.target = _ready_sandbox(stub, env_process.busybox_image)
                targets.sandbox_ids.append(targets.target)
        elapsed = time.monotonic() - started

        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        # Expired leases (1 s heartbeats, owners) are reaped in the background: compare until
        # the two agree or a bound passes.
        live, runtime_before = _converged(lambda: (_live(_settle(stub)), env_process.runtime_ids()))
        for sandbox in _records(stub):
            stub.DeleteSandbox(api.DeleteSandboxRequest(sandbox_id=sandbox.id), metadata=METADATA)
        for owner_id in targets.owner_ids:
            stub.DeleteOwner(api.DeleteOwnerRequest(owner_id=owner_id), metadata=METADATA)
        left, left_runtime = _converged(
            lambda: ({s.id for s in _records(stub)}, env_process.runtime_ids())
        )
        left_records = sorted(left)

    log = env_process.log.read_text(errors="replace")
    report = {
        "seconds": round(elapsed, 1),
        "requests": fuzzer.sent,
        "garbage_requests": fuzzer.garbage,
        "requests_per_s": round(fuzzer.sent / elapsed, 1),
        "statuses": dict(fuzzer.statuses.most_common()),
        "by_method": {name: dict(c.most_common()) for name, c in sorted(fuzzer.by_method.items())},
        "wrong": dict(fuzzer.wrong.most_common()),
        "wrong_examples": fuzzer.bad[:20],
        "log_bytes": len(log.encode()),
        "log_tracebacks": sum("Traceback" in line for line in log.splitlines()),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    summary.append(
        f"fuzz: {fuzzer.sent} requests ({fuzzer.garbage} raw garbage) in {elapsed:.0f} s, "
        f"{report['requests_per_s']}/s; statuses {report['statuses']}; "
        f"wrong {report['wrong']}; log {report['log_bytes']} bytes, "
        f"{report['log_tracebacks']} tracebacks ({RESULTS.name})"
    )

    problems = []
    if health.status != health_pb2.HealthCheckResponse.SERVING:
        problems.append(f"health {health.status} after the run")
    if fuzzer.wrong:
        problems.append(f"wrong statuses {dict(fuzzer.wrong)}, e.g.\n" + "\n".join(fuzzer.bad[:10]))
    if runtime_before != live:
        problems.append(f"runtime holds {sorted(runtime_before)}, records name {sorted(live)}")
    if left_records or left_runtime:
        problems.append(f"left after deleting all: {left_records} {sorted(left_runtime)}")
    if report["log_tracebacks"]:
        problems.append(f"{report['log_tracebacks']} tracebacks in the service log")
    assert problems == [], "\n".join(problems)


# -- what the fuzzer found, kept as plain tests ---------------------------------------------


async def test_a_refused_upload_reports_its_status_not_internal(
    isolated: Any, busybox_image: str
) -> None:
    """The agent refused the header while megabytes were still on their way: its status raced
    the sender's writes and about one call in six ended as INTERNAL "Internal error from Core"
    (both hops stream). The agent now reads the rest before it answers."""
    sandbox = await isolated.ready(image=busybox_image, timeout_s=60)
    header = api.WriteFileHeader(sandbox_id=sandbox.id, path="bad\0path")
    chunk = api.WriteFileRequest(data=b"\0" * (1 << 20))
    codes: collections.Counter[str] = collections.Counter()
    for _ in range(60):

        async def messages() -> Any:
            yield api.WriteFileRequest(header=header)
            for _ in range(4):
                yield chunk

        try:
            await isolated.stub.WriteFile(messages(), metadata=isolated.md(), timeout=30)
        except grpc.aio.AioRpcError as exc:
            codes[exc.code().name] += 1
    assert codes == {"INVALID_ARGUMENT": 60}, codes


async def test_out_of_range_durations_and_timestamps_are_invalid_argument(env: Any) -> None:
    """Values a Duration or Timestamp cannot hold pass the wire but not the JSON the records
    are stored as: INTERNAL before, INVALID_ARGUMENT now."""
    too_long = env_pb2.SandboxSpec(image="host")
    too_long.heartbeat_timeout.nanos = 2**31 - 1
    far = env_pb2.EgressRule(destination="10.0.0.1")
    far.expire_time.seconds = 2**62
    bad_nanos = env_pb2.EgressRule(destination="10.0.0.1")
    bad_nanos.expire_time.nanos = -5
    owner = api.CreateOwnerRequest()
    owner.heartbeat_timeout.nanos = 2**31 - 1
    calls = [
        ("CreateSandbox", api.CreateSandboxRequest(spec=too_long)),
        ("CreateOwner", owner),
    ]
    for rule in (far, bad_nanos):
        spec = env_pb2.SandboxSpec(
            image="host", network_policy=env_pb2.NetworkPolicy(egress=[rule])
        )
        calls.append(("CreateSandbox", api.CreateSandboxRequest(spec=spec)))
    for name, request in calls:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await getattr(env.stub, name)(request, metadata=env.md())
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, caught.value)
    sandbox = await env.ready()
    for rule in (far, bad_nanos):
        update = api.UpdateNetworkPolicyRequest(
            sandbox_id=sandbox.id, network_policy=env_pb2.NetworkPolicy(egress=[rule])
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await env.stub.UpdateNetworkPolicy(update, metadata=env.md())
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
