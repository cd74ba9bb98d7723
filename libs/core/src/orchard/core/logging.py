"""Structured logs: one JSON object per line on stderr, from the standard ``logging`` module.

Each line carries ``ts`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``msg``,
``service``, every field passed through ``extra=`` and, when there is one, ``exc`` (the
formatted exception). Code keeps logging the ordinary way::

    log = logging.getLogger(__name__)
    log.info("sandbox ready", extra={"sandbox_id": sid, "elapsed_s": 0.41})

    {"ts": "2026-12-02T10:00:00.123Z", "level": "INFO", "logger": "orchard.env.sandbox",
     "msg": "sandbox ready", "service": "env", "sandbox_id": "sb-1", "elapsed_s": 0.41}

Call :func:`configure_logging` once, in ``main``. Lines a client can cause at will (a
malformed request, say) go through a :class:`RateLimitedLog`, so a flood of them cannot grow
the log without bound.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import IO, Any

__all__ = ["JsonFormatter", "RateLimitedLog", "configure_logging"]

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRIBUTES = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None)).keys()
) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON; values JSON cannot encode are written as str()."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _utc_timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "service": self.service,
        }
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRIBUTES and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def _utc_timestamp(created: float) -> str:
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


class _OrchardHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler configure_logging installed, so a second call replaces it."""


def configure_logging(
    service: str, level: str | int = "INFO", *, stream: IO[str] | None = None
) -> None:
    """Send all logging as JSON lines to ``stream`` (stderr) at ``level`` and above.

    Replaces the handler of an earlier call and leaves other handlers alone. ``grpc`` and
    ``asyncio`` loggers are kept at WARNING or above, since their INFO lines are noise here.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _OrchardHandler):
            root.removeHandler(handler)
    handler = _OrchardHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    for noisy in ("grpc", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


class RateLimitedLog:
    """A token bucket per key: up to ``burst`` lines at once, refilled at ``burst`` per
    ``interval_s``; lines beyond that are counted, and the next line let through is preceded
    by one ``"suppressed N similar lines"`` line for its key."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 10,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.burst = burst
        self.rate = burst / interval_s
        self.clock = clock
        # key → (tokens left, time of the last refill, lines suppressed since the last one)
        self._buckets: dict[str, tuple[float, float, int]] = {}

    def log(self, level: int, key: str, msg: str, *args: object, **kwargs: Any) -> bool:
        """Log ``msg`` under ``key`` unless its bucket is empty; True when it was logged."""
        now = self.clock()
        tokens, last, suppressed = self._buckets.get(key, (float(self.burst), now, 0))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now, suppressed + 1)
            return False
        if len(self._buckets) > 10_000 and key not in self._buckets:
            self._buckets.clear()  # keys are few in practice; never let them grow unbounded
        self._buckets[key] = (tokens - 1.0, now, 0)
        if suppressed:
            self.logger.log(
                level,
                "suppressed %d similar lines",
                suppressed,
                extra={"suppressed": suppressed, "key": key},
            )
        self.logger.log(level, msg, *args, **kwargs)
        return True
