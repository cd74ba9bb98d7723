"""Output capping and the stream queue, without a server."""

from __future__ import annotations

import asyncio

from orchard.inagent.process import OutputCap, OutputQueue, ProcessResult, Stream


def test_cap_keeps_the_first_bytes_and_counts_all() -> None:
    cap = OutputCap(5)
    assert bytes(cap.accept(memoryview(b"abc"))) == b"abc"
    assert bytes(cap.accept(memoryview(b"defg"))) == b"de"
    assert bytes(cap.accept(memoryview(b"hij"))) == b""
    assert (cap.kept, cap.total, cap.truncated) == (5, 10, True)


def test_cap_exactly_full_is_not_truncated() -> None:
    cap = OutputCap(3)
    cap.accept(memoryview(b"abc"))
    assert not cap.truncated
    cap.accept(memoryview(b""))
    assert not cap.truncated


def _result() -> ProcessResult:
    return ProcessResult(0, None, False, 0.0, b"", b"", 0, 0, False, False)


async def test_queue_merges_adjacent_chunks_of_one_stream_in_order() -> None:
    queue = OutputQueue()
    queue.push(Stream.STDOUT, memoryview(b"a"))
    queue.push(Stream.STDOUT, memoryview(b"b"))
    queue.push(Stream.STDERR, memoryview(b"c"))
    queue.push(Stream.STDOUT, memoryview(b"d"))
    result = _result()
    queue.finish(result)
    assert await queue.get() == (Stream.STDOUT, b"ab")
    assert await queue.get() == (Stream.STDERR, b"c")
    assert await queue.get() == (Stream.STDOUT, b"d")
    assert await queue.get() is result


async def test_queue_get_waits_for_data() -> None:
    queue = OutputQueue()
    getter = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0.01)
    assert not getter.done()
    queue.push(Stream.STDERR, memoryview(b"x"))
    assert await asyncio.wait_for(getter, 1) == (Stream.STDERR, b"x")
