"""JSON log lines: one object per line with the fixed fields, extras and exception text."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from orchard.core.logging import configure_logging


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buffer = io.StringIO()
    configure_logging("toy", "DEBUG", stream=buffer)
    try:
        yield buffer
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_fields_and_extras(stream: io.StringIO) -> None:
    logging.getLogger("orchard.toy").info(
        "sandbox %s ready", "sb-1", extra={"sandbox_id": "sb-1", "elapsed_s": 0.5}
    )
    [entry] = lines(stream)
    assert entry["msg"] == "sandbox sb-1 ready"
    assert entry["level"] == "INFO"
    assert entry["logger"] == "orchard.toy"
    assert entry["service"] == "toy"
    assert entry["sandbox_id"] == "sb-1" and entry["elapsed_s"] == 0.5
    assert str(entry["ts"]).endswith("Z") and "T" in str(entry["ts"])


def test_exception_text_and_unencodable_values(stream: io.StringIO) -> None:
    try:
        raise ValueError("bad thing")
    except ValueError:
        logging.getLogger("x").exception("failed", extra={"obj": object(), "text": "é\n"})
    [entry] = lines(stream)
    assert "ValueError: bad thing" in str(entry["exc"])
    assert str(entry["obj"]).startswith("<object")
    assert entry["text"] == "é\n"


def test_level_and_reconfigure(stream: io.StringIO) -> None:
    configure_logging("toy", "warning", stream=stream)
    logging.getLogger("x").info("hidden")
    logging.getLogger("x").warning("shown")
    assert [e["msg"] for e in lines(stream)] == ["shown"]  # one handler, not two


def test_rate_limited_log_lets_a_burst_through_then_counts() -> None:
    import logging

    from orchard.core.logging import RateLimitedLog

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("test.rate_limited")
    logger.propagate = False
    logger.addHandler(Collect())
    logger.setLevel(logging.INFO)
    now = [0.0]
    limited = RateLimitedLog(logger, burst=3, interval_s=30.0, clock=lambda: now[0])
    passed = [limited.log(logging.INFO, "a", "line %d", i) for i in range(1000)]
    assert passed.count(True) == 3 and lines == ["line 0", "line 1", "line 2"]
    assert limited.log(logging.INFO, "b", "other key")  # buckets are per key
    now[0] += 10.0  # one token back (3 per 30 s)
    assert limited.log(logging.INFO, "a", "again")
    assert lines[-2:] == ["suppressed 997 similar lines", "again"]
    assert not limited.log(logging.INFO, "a", "too soon")
