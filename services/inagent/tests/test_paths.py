"""Path checks and display, without a server."""

from __future__ import annotations

import grpc
import pytest

from orchard.core.errors import OrchardError
from orchard.inagent.paths import NAME_MAX, PATH_MAX, check_path, display, resolve


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("", "is empty"),
        ("a\0b", "NUL byte at offset 1"),
        ("/" + "a" * PATH_MAX, "the limit is 4095 (PATH_MAX)"),
        ("/tmp/" + "n" * (NAME_MAX + 1), "component of 256 bytes"),
    ],
)
def test_bad_paths_are_invalid_argument(path: str, words: str) -> None:
    with pytest.raises(OrchardError) as caught:
        check_path(path)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.reason.reason == "INVALID_PATH"
    assert words in caught.value.message


def test_limits_are_inclusive() -> None:
    assert check_path("/" + "n" * NAME_MAX) == b"/" + b"n" * NAME_MAX
    longest = "/".join(["x" * 200] * 30)[: PATH_MAX - 1]
    assert len(check_path(longest)) == PATH_MAX - 1


def test_multibyte_names_count_bytes() -> None:
    with pytest.raises(OrchardError, match="component of 258 bytes"):
        check_path("é" * 129)  # 258 bytes in UTF-8, 129 characters


def test_resolve_joins_relative_paths_and_normalizes() -> None:
    assert resolve(b"a/../b/./c", b"/srv/app") == b"/srv/app/b/c"
    assert resolve(b"/etc//hosts", b"/srv/app") == b"/etc/hosts"


def test_display_escapes_bytes_that_are_not_utf8() -> None:
    assert display("plain é".encode()) == ("plain é", b"")
    assert display(b"bad\xff\xfename") == ("bad\\xff\\xfename", b"bad\xff\xfename")
