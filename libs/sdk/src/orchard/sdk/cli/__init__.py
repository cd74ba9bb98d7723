"""The ``orchard`` command line.

::

    orchard up                                   # etcd + environment service, local runtime
    ID=$(orchard sandbox create --label task=demo)
    orchard sandbox exec $ID -- python3 -c 'print(42)'
    orchard sandbox cp ./repo $ID:/workspace/
    orchard sandbox ls --json
    orchard sandbox rm $ID

Exit status: 0 on success, 1 when the service refused or could not be reached, 2 for a command
line that cannot work; ``sandbox exec`` exits with the command's own status (128+N after signal
N, 124 after ``--timeout``, 125 when it could not run the command, 127 when it does not exist).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from orchard.sdk.cli.bench import add_bench_commands
from orchard.sdk.cli.experiment import add_experiment_commands
from orchard.sdk.cli.images import add_images_commands
from orchard.sdk.cli.recipe import add_recipe_commands
from orchard.sdk.cli.sandbox import UsageError, add_sandbox_commands
from orchard.sdk.cli.up import add_up_commands
from orchard.sdk.connection import TLS_CA_ENV, TOKEN_ENV
from orchard.sdk.errors import (
    ConfigurationError,
    OrchardSDKError,
    SandboxNotFound,
    Unauthenticated,
    Unavailable,
)
from orchard.sdk.retry import RetryPolicy
from orchard.sdk.sync import SandboxClient

__all__ = ["build_parser", "main"]

# A person at a terminal should hear about a dead service within a second, not after 10 s.
_CLI_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.1, max_backoff=0.5)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples in epilogs as written."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orchard",
        description="Orchard: sandboxes for training LLM agents.",
        epilog=(
            "commands:\n"
            "  orchard up                      run etcd + the environment service here\n"
            "  orchard down                    stop what `orchard up --detach` started\n"
            "  orchard sandbox create          create a sandbox, print its id\n"
            "  orchard sandbox exec ID -- CMD  run a command, stream its output\n"
            "  orchard sandbox cp SRC DST      copy files in or out (ID:/path)\n"
            "  orchard sandbox ls              list sandboxes\n"
            "  orchard sandbox get ID          show one sandbox\n"
            "  orchard sandbox rm ID...        delete sandboxes\n"
            "  orchard bench env               N sandboxes through create, exec, delete\n"
            "  orchard recipe check FILE       validate a recipe, show its stages\n"
            "  orchard recipe run FILE         train: a recipe's stages, ending in a report\n"
            "  orchard experiment run FILE     a recipe under several settings and seeds\n"
            "  orchard images prepull IMAGE... pull images on cluster nodes ahead of a run\n"
            "\n"
            "example:\n"
            "  orchard up --detach\n"
            "  ID=$(orchard sandbox create --label task=demo --memory 512M)\n"
            "  orchard sandbox exec $ID -- uname -a\n"
            "  orchard sandbox rm $ID\n"
            "\n"
            "`orchard COMMAND --help` explains each command. The connection comes from\n"
            "--endpoint/--token, else $ORCHARD_ENDPOINT/$ORCHARD_TOKEN, else the profile\n"
            "`orchard up` writes."
        ),
        formatter_class=_Formatter,
    )
    parser.add_argument("--endpoint", help="environment service address, e.g. 127.0.0.1:7100")
    parser.add_argument("--token", help=f"bearer token (default: ${TOKEN_ENV} or the profile)")
    parser.add_argument(
        "--tls-ca",
        metavar="FILE",
        help=f"connect with TLS, checking the server against this CA (default: ${TLS_CA_ENV}); "
        "an https:// endpoint uses TLS with the system's roots",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow sending the token in plaintext to a non-loopback address",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_up_commands(subparsers, _Formatter)
    add_sandbox_commands(subparsers, _connect, _Formatter)
    add_bench_commands(subparsers, _Formatter)
    add_recipe_commands(subparsers, _Formatter)
    add_experiment_commands(subparsers, _Formatter)
    add_images_commands(subparsers, _Formatter)
    return parser


def _connect(args: argparse.Namespace) -> SandboxClient:
    return SandboxClient(
        args.endpoint,
        token=args.token,
        retry=_CLI_RETRY,
        tls_ca_file=args.tls_ca,
        allow_insecure=args.insecure,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.run(args)
        return status
    except UsageError as exc:
        parser.error(str(exc))  # exits with status 2
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130
    except BrokenPipeError:
        return 0
    except OrchardSDKError as exc:
        sys.stderr.write(f"orchard: {_explain(exc, args)}\n")
        return 1
    raise AssertionError("unreachable")


def _explain(exc: OrchardSDKError, args: argparse.Namespace) -> str:
    """One line a person can act on."""
    if isinstance(exc, Unavailable) and "endpoint" in exc.metadata:
        where = exc.metadata["endpoint"]
        if args.endpoint:
            return f"cannot reach the environment service at {where}: is it running there?"
        return (
            f"cannot reach the environment service at {where}: run `orchard up` first "
            "(or set $ORCHARD_ENDPOINT)"
        )
    if isinstance(exc, Unauthenticated):
        return f"{exc.message}: check --token / ${TOKEN_ENV}, or the profile `orchard up` wrote"
    if isinstance(exc, SandboxNotFound):
        return f"{exc.message} (it may have been reaped after its --timeout without use)"
    if isinstance(exc, ConfigurationError):
        text = str(exc).replace("or pass endpoint=", "or pass --endpoint")
        text = text.replace("tls_ca_file:", "--tls-ca:")
        return text.replace("allow_insecure=True (orchard --insecure)", "--insecure")
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
