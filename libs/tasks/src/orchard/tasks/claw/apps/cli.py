"""The command-line front end: ``mail``, ``calendar``, ``contacts``, ``notes`` and ``docs``,
one subcommand per operation, JSON on stdout.

Exit codes: 0 done; 2 bad arguments; 3 not found; 75 a transient failure (nothing changed: run
the same command again); 1 anything else. Errors go to stderr as ``<app>: error: <what>``.
A value of ``-`` for a text argument (``--body -``) is read from stdin.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from .ops import APPS, OPERATIONS, Operation, call
from .store import ClawError

__all__ = ["main", "parser"]

_DESCRIPTIONS = {
    "mail": "Your mailbox: read, search, send, reply, forward, draft, delete, move messages.",
    "calendar": "Your calendar: list, create, update, cancel events; find free time.",
    "contacts": "Your address book: search, show, add, update contacts.",
    "notes": "Your notes: list, read, write, search, delete.",
    "docs": "Your documents: spreadsheets (.csv) by cell, documents (.md) by section.",
}


def _add(sub: argparse._SubParsersAction[argparse.ArgumentParser], op: Operation) -> None:
    command = sub.add_parser(op.name, help=op.summary, description=op.summary)
    for param in op.params:
        kwargs: dict[str, Any] = {"help": param.help}
        if param.choices:
            kwargs["choices"] = param.choices
        if param.type == "boolean":
            command.add_argument(f"--{param.name}", action="store_true", **kwargs)
            continue
        if param.type == "integer":
            kwargs["type"] = int
        if param.type == "list":
            kwargs["action"] = "append"
            kwargs["help"] += " (repeat, or separate with commas)"
        if param.positional:
            kwargs["nargs"] = None if param.required else "?"
            command.add_argument(param.name, metavar=param.name.upper(), **kwargs)
        else:
            command.add_argument(
                f"--{param.name}",
                dest=param.name,
                required=param.required,
                metavar=param.name.upper(),
                **kwargs,
            )


def parser(app: str) -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog=app, description=_DESCRIPTIONS[app])
    sub = top.add_subparsers(dest="operation", required=True, metavar="COMMAND")
    for (owner, _), op in OPERATIONS.items():
        if owner == app:
            _add(sub, op)
    return top


def main(app: str, argv: Sequence[str] | None = None) -> int:
    if app not in APPS:
        print(f"unknown app {app!r}; the apps are {', '.join(APPS)}", file=sys.stderr)
        return 2
    args = vars(parser(app).parse_args(argv))
    name = args.pop("operation")
    args = {k: v for k, v in args.items() if v is not None and v is not False}
    for key, value in args.items():
        if value == "-":
            args[key] = sys.stdin.read()
    try:
        result = call(app, name, args, via="cli")
    except ClawError as exc:
        print(f"{app}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    json.dump(result, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0
