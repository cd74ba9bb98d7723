"""``orchard sandbox create|exec|cp|ls|get|rm``: one function per command."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import posixpath
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from orchard.sdk.cli.output import Progress, print_json, print_table
from orchard.sdk.errors import FileNotFound, InvalidArgument, OrchardSDKError
from orchard.sdk.sync import SandboxClient
from orchard.sdk.types import (
    ExecExit,
    ExecStderr,
    ExecStdout,
    FileType,
    Resources,
    SandboxInfo,
    SandboxState,
)
from orchard.sdk.units import format_duration, parse_duration, parse_size

__all__ = ["add_sandbox_commands"]

Connect = Callable[[argparse.Namespace], SandboxClient]

EXIT_EXEC_FAILED = 125
"""``orchard sandbox exec`` could not run the command (as ``docker exec`` says it)."""
EXIT_NOT_FOUND = 127
EXIT_TIMED_OUT = 124

_REMOTE = re.compile(r"^(?P<id>[A-Za-z0-9][A-Za-z0-9._-]*):(?P<path>.*)$")


def add_sandbox_commands(
    subparsers: Any, connect: Connect, formatter: type[argparse.HelpFormatter]
) -> None:
    """Register ``orchard sandbox ...``; ``connect(args)`` returns a :class:`SandboxClient`."""
    sandbox = subparsers.add_parser(
        "sandbox",
        help="create, use and remove sandboxes",
        description="Create, use and remove sandboxes of the environment service.",
        formatter_class=formatter,
    )
    commands = sandbox.add_subparsers(dest="sandbox_command", metavar="COMMAND", required=True)

    def command(name: str, help_text: str, example: str, run: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = commands.add_parser(
            name,
            help=help_text,
            description=f"{help_text[0].upper()}{help_text[1:]}.",
            epilog=f"example:\n  {example}",
            formatter_class=formatter,
        )
        parser.set_defaults(run=lambda args: run(args, connect))
        return parser

    create = command(
        "create",
        "create a sandbox, wait until it is READY and print its id",
        "orchard sandbox create --image host --label task=demo --memory 512M --cpus 1",
        _create,
    )
    create.add_argument(
        "--image",
        default="host",
        help="root file system: host, rootfs:/dir, oci-archive:/x.tar, docker-archive:/x.tar "
        "(default: host)",
    )
    create.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE", help="repeatable"
    )
    create.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    create.add_argument("--memory", type=_size_flag, help="memory limit, e.g. 512M, 2G")
    create.add_argument("--cpus", type=_cpus_flag, help="CPU limit in cores, e.g. 0.5")
    create.add_argument("--pids", type=_count_flag, help="most processes at once")
    create.add_argument("--disk", type=_size_flag, help="writable layer limit, e.g. 5G")
    create.add_argument("--workdir", default="", help="working directory inside (default: /)")
    create.add_argument(
        "--timeout",
        type=_duration_flag,
        default="10m",
        help="reap the sandbox after this long without use (each exec or cp renews it); "
        "e.g. 90s, 10m, 2h (default: 10m)",
    )
    create.add_argument("--no-wait", action="store_true", help="return at once, in PENDING")
    create.add_argument("--json", action="store_true", help="print the sandbox as JSON")

    run = command(
        "exec",
        "run a command in a sandbox, streaming its output; exits with the command's status",
        "orchard sandbox exec sbx-8f3c2a1d9e7b -- python3 -c 'print(42)'",
        _exec,
    )
    run.add_argument("id", metavar="ID")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARG ...]")
    _exec_options(run)
    # Options after ID (`exec ID --timeout 5s -- CMD`) land in argv: parsed again with these.
    after_id = argparse.ArgumentParser(prog="orchard sandbox exec ID", add_help=False)
    _exec_options(after_id)
    run.set_defaults(exec_options=after_id)

    copy = command(
        "cp",
        "copy files or directories between this machine and a sandbox (ID:/path names a sandbox "
        "path)",
        "orchard sandbox cp ./repo sbx-8f3c2a1d9e7b:/workspace/",
        _cp,
    )
    copy.add_argument("source", metavar="SRC")
    copy.add_argument("destination", metavar="DST")
    copy.add_argument("-q", "--quiet", action="store_true", help="no progress indicator")
    copy.add_argument("--json", action="store_true", help="print what was copied as JSON")

    listing = command(
        "ls",
        "list sandboxes",
        "orchard sandbox ls --label task=demo --state READY",
        _ls,
    )
    listing.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="SELECTOR",
        help="k=v, k!=v, k or !k; repeatable, all must hold",
    )
    listing.add_argument(
        "--state",
        action="append",
        default=[],
        choices=[s.value for s in SandboxState if s is not SandboxState.UNSPECIFIED],
    )
    listing.add_argument("-q", "--quiet", action="store_true", help="print ids only")
    listing.add_argument("--json", action="store_true", help="print a JSON array")

    get = command("get", "show one sandbox", "orchard sandbox get sbx-8f3c2a1d9e7b --json", _get)
    get.add_argument("id", metavar="ID")
    get.add_argument("--json", action="store_true")

    remove = command(
        "rm",
        "delete sandboxes (succeeds for ones already gone)",
        "orchard sandbox rm sbx-8f3c2a1d9e7b sbx-0a1b2c3d4e5f",
        _rm,
    )
    remove.add_argument("ids", nargs="+", metavar="ID")
    remove.add_argument("--json", action="store_true")


# -- commands -----------------------------------------------------------------------------------


def _create(args: argparse.Namespace, connect: Connect) -> int:
    resources = Resources.of(cpus=args.cpus, memory=args.memory, pids=args.pids, disk=args.disk)
    timeout = args.timeout
    with connect(args) as client, _flags_named():
        sandbox = client.create(
            args.image,
            labels=_pairs(args.label, "--label"),
            env=_pairs(args.env, "--env"),
            resources=resources,
            heartbeat_timeout=timeout,
            working_dir=args.workdir,
            wait=not args.no_wait,
            keep_alive=False,
        )
        if args.json:
            print_json(sandbox.info.to_json())
        else:
            print(sandbox.id)
    return 0


def _exec_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout", type=_duration_flag, help="kill the command after this long, e.g. 30s"
    )
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--cwd", help="working directory inside the sandbox")
    parser.add_argument(
        "-i", "--stdin", action="store_true", help="send this process's stdin to the command"
    )
    parser.add_argument("-c", "--shell", metavar="SCRIPT", help="run SCRIPT with /bin/sh -c")
    parser.add_argument(
        "--json", action="store_true", help="print the result as JSON instead of streaming"
    )


def _command_line(args: argparse.Namespace) -> list[str]:
    """The command after ``--``; options between ID and ``--`` are parsed into ``args``."""
    argv = list(args.argv)
    if argv and argv[0] == "--":
        return argv[1:]
    if argv and argv[0].startswith("-"):
        if "--" not in argv:
            raise UsageError(
                f"{argv[0]!r} after the sandbox id: put the command after `--`, as in "
                "orchard sandbox exec ID [OPTIONS] -- CMD [ARG ...]"
            )
        split = argv.index("--")
        parser: argparse.ArgumentParser = args.exec_options
        # Into the same namespace: values given before ID stay (--env appends to them).
        parser.parse_args(argv[:split], namespace=args)
        return argv[split + 1 :]
    return argv


def _exec(args: argparse.Namespace, connect: Connect) -> int:
    argv = _command_line(args)
    if args.shell is not None and argv:
        raise UsageError("give either -c SCRIPT or -- CMD ARGS, not both")
    command: str | list[str] = args.shell if args.shell is not None else argv
    if not command:
        raise UsageError("no command: orchard sandbox exec ID -- CMD [ARG ...]")
    timeout = args.timeout
    stdin = sys.stdin.buffer.read() if args.stdin else None
    options: dict[str, Any] = {
        "timeout": timeout,
        "stdin": stdin,
        "env": _pairs(args.env, "--env"),
        "cwd": args.cwd,
    }
    with connect(args) as client:
        sandbox = client.get(args.id, keep_alive=True)
        try:
            if args.json:
                result = sandbox.exec(command, **options)
                print_json(
                    {
                        "exit_code": result.exit_code,
                        "signal": result.signal,
                        "timed_out": result.timed_out,
                        "duration": result.duration,
                        "stdout": result.stdout_text,
                        "stderr": result.stderr_text,
                        "stdout_truncated": result.stdout_truncated,
                        "stderr_truncated": result.stderr_truncated,
                    }
                )
                return _exit_status(result.exit_code, result.signal, result.timed_out)
            return _stream(sandbox, command, options)
        except FileNotFound as exc:
            if exc.reason == "EXECUTABLE_NOT_FOUND":
                _error(str(exc.message))
                return EXIT_NOT_FOUND
            raise
        finally:
            sandbox.close()


def _stream(sandbox: Any, command: str | list[str], options: dict[str, Any]) -> int:
    out, err = sys.stdout.buffer, sys.stderr.buffer
    sys.stdout.flush()
    for event in sandbox.exec_stream(command, **options):
        if isinstance(event, ExecStdout):
            out.write(event.data)
            out.flush()
        elif isinstance(event, ExecStderr):
            err.write(event.data)
            err.flush()
        elif isinstance(event, ExecExit):
            if event.timed_out:
                _error(f"the command timed out after {format_duration(event.duration)}")
            return _exit_status(event.exit_code, event.signal, event.timed_out)
    _error("the command's output stream ended without an exit status")
    return EXIT_EXEC_FAILED


def _exit_status(exit_code: int | None, signal_number: int | None, timed_out: bool) -> int:
    if timed_out:
        return EXIT_TIMED_OUT
    if signal_number is not None:
        return 128 + signal_number
    return exit_code if exit_code is not None else EXIT_EXEC_FAILED


@dataclass(frozen=True)
class _Location:
    sandbox_id: str | None
    path: str


def _location(text: str) -> _Location:
    if text.startswith(("/", ".", "~")):
        return _Location(None, os.path.expanduser(text))
    match = _REMOTE.match(text)
    if match is None:
        return _Location(None, text)
    path = match.group("path") or "."
    return _Location(match.group("id"), path)


def _cp(args: argparse.Namespace, connect: Connect) -> int:
    source, destination = _location(args.source), _location(args.destination)
    if (source.sandbox_id is None) == (destination.sandbox_id is None):
        raise UsageError("exactly one of SRC and DST must be a sandbox path (ID:/path)")
    progress = Progress(f"{args.source} -> {args.destination}", enabled=None)
    if args.quiet or args.json:
        progress.enabled = False
    with connect(args) as client:
        if destination.sandbox_id is not None:
            local = Path(source.path)
            if not local.exists() and not local.is_symlink():
                raise UsageError(f"{local}: no such file or directory")
            sandbox = client.get(destination.sandbox_id, keep_alive=True)
            try:
                target = destination.path
                if target.endswith("/") or _remote_is_dir(sandbox, target):
                    target = posixpath.join(target, local.resolve().name)
                copied = sandbox.upload(local, target, progress=progress)
            finally:
                progress.finish()
                sandbox.close()
            where = f"{destination.sandbox_id}:{target}"
        else:
            assert source.sandbox_id is not None
            sandbox = client.get(source.sandbox_id, keep_alive=True)
            try:
                local = Path(destination.path)
                if local.is_dir():
                    local = local / posixpath.basename(source.path.rstrip("/") or "/")
                copied = sandbox.download(source.path, local, progress=progress)
            finally:
                progress.finish()
                sandbox.close()
            where = str(local)
    if args.json:
        print_json({"destination": where, "bytes": copied})
    return 0


def _remote_is_dir(sandbox: Any, path: str) -> bool:
    try:
        return bool(sandbox.stat(path, follow_symlinks=True).type is FileType.DIRECTORY)
    except FileNotFound:
        return False


def _ls(args: argparse.Namespace, connect: Connect) -> int:
    selector = ",".join(args.label)
    states = [SandboxState(state) for state in args.state]
    with connect(args) as client:
        sandboxes = list(client.list(selector, states=states))
    if args.json:
        print_json([info.to_json() for info in sandboxes])
    elif args.quiet:
        for info in sandboxes:
            print(info.id)
    else:
        now = datetime.now(UTC)
        print_table(
            ["id", "state", "image", "age", "expires in", "labels"],
            [
                [
                    info.id,
                    info.state.value,
                    info.image,
                    _since(info.create_time, now),
                    _until(info.expire_time, now),
                    ",".join(f"{k}={v}" for k, v in sorted(info.labels.items())),
                ]
                for info in sandboxes
            ],
        )
    return 0


def _get(args: argparse.Namespace, connect: Connect) -> int:
    with connect(args) as client:
        info = client.get_info(args.id)
    if args.json:
        print_json(info.to_json())
        return 0
    for key, value in _describe(info):
        print(f"{key + ':':<16}{value}")
    return 0


def _describe(info: SandboxInfo) -> list[tuple[str, object]]:
    now = datetime.now(UTC)
    rows: list[tuple[str, object]] = [
        ("id", info.id),
        ("state", info.state.value),
        ("image", info.image),
        ("runtime", info.runtime),
        ("labels", ",".join(f"{k}={v}" for k, v in sorted(info.labels.items())) or "-"),
        ("age", _since(info.create_time, now)),
        ("expires in", _until(info.expire_time, now)),
    ]
    if info.failure_reason:
        rows.append(("failure", f"{info.failure_reason}: {info.failure_message}"))
    if info.queue_position:
        rows.append(("queue position", info.queue_position))
    return rows


def _rm(args: argparse.Namespace, connect: Connect) -> int:
    with connect(args) as client:
        for sandbox_id in args.ids:
            client.delete(sandbox_id)
            if not args.json:
                print(sandbox_id)
    if args.json:
        print_json({"deleted": args.ids})
    return 0


# -- helpers ------------------------------------------------------------------------------------


class UsageError(OrchardSDKError):
    """A command line that cannot work; printed with the usage hint, exit status 2."""


# Flag values a request can carry (int64 fields); anything else is refused before any call.
_INT64_MAX = 2**63 - 1
_MAX_CPUS = 1_000_000
_MAX_DURATION_S = 10 * 365 * 86400


def _size_flag(text: str) -> int:
    """A size flag (``--memory``, ``--disk``): 1 byte to 8 EiB, e.g. 512M."""
    try:
        value = parse_size(text)
    except (ValueError, OverflowError):
        value = -1
    if not 1 <= value <= _INT64_MAX:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size from 1 byte to 8 EiB (e.g. 512M, 2G, 1048576)"
        )
    return value


def _cpus_flag(text: str) -> float:
    """``--cpus``: a finite number of cores from 0.001 to 1,000,000."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.001 <= value <= _MAX_CPUS:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of cores from 0.001 to {_MAX_CPUS:,} (e.g. 0.5, 2)"
        )
    return value


def _count_flag(text: str) -> int:
    """``--pids``: a whole number from 1 to 2**63-1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= _INT64_MAX:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1 to 2**63-1")
    return value


def _duration_flag(text: str) -> float:
    """A duration flag: more than 0 s and at most 10 years, e.g. 30s, 10m, 1h30m."""
    try:
        value = parse_duration(text)
    except (ValueError, OverflowError):
        value = -1.0
    if not 0 < value <= _MAX_DURATION_S:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration from 1ms to 10 years (e.g. 30s, 10m, 1h30m)"
        )
    return value


_FLAG_OF_FIELD = {
    "spec.resources.memory_bytes": "--memory",
    "spec.resources.cpu_millis": "--cpus",
    "spec.resources.pids": "--pids",
    "spec.resources.disk_bytes": "--disk",
    "spec.heartbeat_timeout": "--timeout",
    "spec.image": "--image",
    "spec.working_dir": "--workdir",
}


@contextlib.contextmanager
def _flags_named() -> Iterator[None]:
    """A refusal of a spec field is reported as a usage error of the flag that set it."""
    try:
        yield
    except InvalidArgument as exc:
        field = exc.metadata.get("field", "")
        flag = _FLAG_OF_FIELD.get(field)
        if flag is None:
            raise
        problem = exc.message.removeprefix(f"{field}: ")
        raise UsageError(f"argument {flag}: {problem}") from None


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} wants KEY=VALUE, got {item!r}")
        pairs[key] = value
    return pairs


def _since(moment: datetime | None, now: datetime) -> str:
    return format_duration(max((now - moment).total_seconds(), 0)) if moment else "-"


def _until(moment: datetime | None, now: datetime) -> str:
    return format_duration(max((moment - now).total_seconds(), 0)) if moment else "-"


def _error(message: str) -> None:
    sys.stderr.write(f"orchard: {message}\n")
    sys.stderr.flush()
