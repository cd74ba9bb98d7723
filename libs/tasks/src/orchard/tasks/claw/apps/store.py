"""The state folder of the Claw apps: JSON files, a notes folder, a documents folder, the
seeded faults and an append-only audit log, all under one folder.

Layout (``$CLAW_HOME``, default ``/srv/claw``)::

    config.json     the owner (name, email), the current time, the working day
    mail.json       {"messages": [...], "next_id": n}
    calendar.json   {"events": [...], "next_id": n}
    contacts.json   {"contacts": [...], "next_id": n}
    notes/          the notes, text files (``*.md``)
    docs/           spreadsheets (``*.csv``) and documents (``*.md`` with ``## Section`` heads)
    faults.json     {"faults": [{"app", "op", "times", "message"}]}: transient failures to come
    audit.log       one JSON object per call of any app, from either front end

Every call takes an exclusive lock on the folder, so the command-line tools and the MCP server
can run at once; JSON files are replaced atomically.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_HOME",
    "ClawError",
    "Invalid",
    "NotFound",
    "Store",
    "Transient",
]

DEFAULT_HOME = "/srv/claw"
HOME_ENV = "CLAW_HOME"


class ClawError(Exception):
    """A call failed; ``kind`` is what a caller branches on, the message what a person reads."""

    kind = "error"
    exit_code = 1


class NotFound(ClawError):
    kind = "not_found"
    exit_code = 3


class Invalid(ClawError):
    kind = "invalid"
    exit_code = 2


class Transient(ClawError):
    """The service is briefly unavailable; nothing changed, and the same call may succeed."""

    kind = "transient"
    exit_code = 75  # EX_TEMPFAIL


class Store:
    """One app call's view of the state folder (open it with :meth:`open`)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self._dirty: dict[str, Any] = {}
        self._cache: dict[str, Any] = {}

    @classmethod
    def home_path(cls, home: str | os.PathLike[str] | None = None) -> Path:
        return Path(home or os.environ.get(HOME_ENV) or DEFAULT_HOME)

    @classmethod
    @contextlib.contextmanager
    def open(cls, home: str | os.PathLike[str] | None = None) -> Iterator[Store]:
        """The store, locked for the call; what it changed is written when the block ends
        without an exception."""
        path = cls.home_path(home)
        if not (path / "config.json").is_file():
            raise ClawError(
                f"no Claw state at {path} (config.json is missing): set {HOME_ENV} to the "
                "state folder"
            )
        with (path / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            store = cls(path)
            yield store
            store.flush()

    # -- JSON documents ----------------------------------------------------------------------

    def load(self, name: str) -> Any:
        """The JSON document ``name`` (``mail``, ``calendar``, ...), read once per call."""
        if name not in self._cache:
            path = self.home / f"{name}.json"
            try:
                self._cache[name] = json.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                self._cache[name] = {}
        return self._cache[name]

    def mark(self, name: str) -> None:
        """``name`` changed: write it back at the end of the call."""
        self._dirty[name] = self._cache[name]

    def discard(self) -> None:
        """Forget what this call changed (it failed)."""
        self._dirty.clear()

    def flush(self) -> None:
        for name, data in self._dirty.items():
            write_atomic(self.home / f"{name}.json", json.dumps(data, indent=1) + "\n")
        self._dirty.clear()

    def next_id(self, name: str, prefix: str) -> str:
        data = self.load(name)
        number = int(data.get("next_id", 1))
        data["next_id"] = number + 1
        self.mark(name)
        return f"{prefix}{number}"

    @property
    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = self.load("config")
        return config

    def now(self) -> _dt.datetime:
        """The state's clock: the configured time, one minute later for each call logged."""
        start = _dt.datetime.fromisoformat(str(self.config.get("now", "2026-03-16T09:00")))
        return start + _dt.timedelta(minutes=self._audit_count())

    # -- folders of files --------------------------------------------------------------------

    def folder(self, name: str) -> Path:
        path = self.home / name
        path.mkdir(exist_ok=True)
        return path

    def file_in(self, folder: str, relative: str) -> Path:
        """``relative`` inside ``folder``, refused when it would lead outside it."""
        base = self.folder(folder).resolve()
        if not relative or relative.startswith("/"):
            raise Invalid(f"{relative!r} must be a relative path inside {folder}/")
        path = (base / relative).resolve()
        if base not in path.parents:
            raise Invalid(f"{relative!r} leads outside {folder}/")
        return path

    # -- faults and the audit log ------------------------------------------------------------

    def take_fault(self, app: str, op: str) -> str | None:
        """The message of a seeded fault for this call, used up by it; None when none is due."""
        data = self.load("faults")
        for fault in data.get("faults", []):
            due = int(fault.get("times", 1)) > 0
            if due and fault.get("app") == app and fault.get("op") in (op, "*"):
                fault["times"] = int(fault.get("times", 1)) - 1
                self.mark("faults")
                return str(fault.get("message") or f"{app} is temporarily unavailable")
        return None

    def _audit_count(self) -> int:
        try:
            with (self.home / "audit.log").open("rb") as handle:
                return sum(1 for _ in handle)
        except FileNotFoundError:
            return 0

    def audit(self, entry: dict[str, Any]) -> None:
        """Append one call to the audit log (O_APPEND: entries are never rewritten)."""
        entry = {"seq": self._audit_count() + 1, **entry}
        line = (json.dumps(entry, sort_keys=True) + "\n").encode("utf-8")
        fd = os.open(self.home / "audit.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
