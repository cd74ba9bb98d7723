"""Image references and their resolution (no root needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard.env.images import ImageResolver, parse_image_reference
from orchard.env.runtime.base import FailureReason, RuntimeFailure


@pytest.mark.parametrize(
    ("text", "kind", "path", "tag"),
    [
        ("host", "host", "", ""),
        ("rootfs:/srv/roots/alpine", "rootfs", "/srv/roots/alpine", ""),
        ("rootfs:/srv/a:b", "rootfs", "/srv/a:b", ""),
        ("oci-archive:/images/x.tar:latest", "oci-archive", "/images/x.tar", "latest"),
        ("docker-archive:/images/x.tar", "docker-archive", "/images/x.tar", ""),
    ],
)
def test_references_parse(text: str, kind: str, path: str, tag: str) -> None:
    reference = parse_image_reference(text)
    assert (reference.kind, reference.path, reference.tag) == (kind, path, tag)
    assert str(reference) == text


@pytest.mark.parametrize(
    "text", ["", "ubuntu:22.04", "rootfs:relative/dir", "rootfs:/a/../b", "host:/x", "rootfs:"]
)
def test_bad_references_are_image_invalid(text: str) -> None:
    with pytest.raises(RuntimeFailure) as caught:
        parse_image_reference(text)
    assert caught.value.reason is FailureReason.IMAGE_INVALID


def test_resolution(tmp_path: Path) -> None:
    resolver = ImageResolver()
    host = resolver.resolve("host")
    assert host.lower_dirs == ("/",) and host.is_host
    assert resolver.resolve(f"rootfs:{tmp_path}").lower_dirs == (str(tmp_path),)
    with pytest.raises(RuntimeFailure) as caught:
        resolver.resolve(f"rootfs:{tmp_path}/missing")
    assert caught.value.reason is FailureReason.IMAGE_NOT_FOUND
    odd = tmp_path / "a,b"
    odd.mkdir()
    with pytest.raises(RuntimeFailure) as caught:
        resolver.resolve(f"rootfs:{odd}")
    assert caught.value.reason is FailureReason.IMAGE_INVALID
    with pytest.raises(RuntimeFailure, match="image cache directory"):
        resolver.resolve(f"oci-archive:{tmp_path}/image.tar")
