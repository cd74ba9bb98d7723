"""The weight-version registry in etcd: the trainer publishes, inference engines follow.

Keys, under the store's namespace:

- ``weights/<model>/versions/<version>``: one JSON record per published version;
- ``weights/<model>/latest``: the record of the newest version.

Both are written in one transaction that also checks `latest` has not moved, so concurrent
publishers get consecutive numbers and `latest` never goes back. Numbers count publications
from 1; a rollout's staleness is `latest().number - version.number`.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from orchard.core.etcd import Compare, CompareOp, EtcdStore, EventType, KeyValue, PutOp

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_PUBLISH_ATTEMPTS = 16


class WeightVersionError(Exception):
    """Base class of the registry's errors."""


class WeightVersionConflict(WeightVersionError):
    """The version name is already published with another location."""


class InvalidWeightVersion(WeightVersionError, ValueError):
    """A version or model name that cannot be a key, or a location that is not a URL."""


@dataclass(frozen=True, slots=True)
class WeightVersion:
    """One published set of weights."""

    version: str
    """The publisher's name for it, e.g. "step-000120"; recorded with every sampled call."""
    number: int
    """Publication order within the model, from 1."""
    location: str
    """The model folder's artifact URL (``file:///...`` on a volume the engines share,
    ``s3://...``); engines read it through `orchard.core.artifacts`, never as a local path."""
    published_at: float
    """Wall-clock time of publication, seconds since the epoch."""
    metadata: Mapping[str, str] = field(default_factory=dict)
    """Free-form labels (training step, run id, checkpoint format...)."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "number": self.number,
                "location": self.location,
                "published_at": self.published_at,
                "metadata": dict(self.metadata),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> WeightVersion:
        raw: dict[str, Any] = json.loads(data)
        return cls(
            version=str(raw["version"]),
            number=int(raw["number"]),
            location=str(raw["location"]),
            published_at=float(raw["published_at"]),
            metadata={str(k): str(v) for k, v in raw.get("metadata", {}).items()},
        )


def _check_name(kind: str, name: str) -> None:
    if not _NAME.match(name):
        raise InvalidWeightVersion(
            f"{kind} {name!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )


def _check_location(version: str, location: str) -> None:
    """A location must be a URL: engines on other machines cannot read this host's paths."""
    if not location:
        raise InvalidWeightVersion(f"version {version!r} needs a location (the model folder's URL)")
    scheme, sep, rest = location.partition("://")
    if not sep or not scheme or not rest or not scheme.replace("+", "").isalnum():
        hint = f" (file://{location})" if location.startswith("/") else ""
        raise InvalidWeightVersion(
            f"version {version!r}: location {location!r} is not a URL; publish the model "
            f"folder's artifact URL{hint}, which every engine can read"
        )


def check_model_name(name: str) -> None:
    """Raise `InvalidWeightVersion` when `name` cannot name a model in the registry."""
    _check_name("model name", name)


class WeightRegistry:
    """Published weight versions of one model, on an `EtcdStore` the caller owns."""

    def __init__(self, store: EtcdStore, model: str = "policy") -> None:
        _check_name("model name", model)
        self._store = store
        self.model = model
        self._prefix = f"weights/{model}/"
        self._latest_key = f"{self._prefix}latest"
        self._versions = f"{self._prefix}versions/"

    def for_model(self, model: str) -> WeightRegistry:
        """The registry of another model on the same store (this one when `model` is its
        own name)."""
        return self if model == self.model else WeightRegistry(self._store, model)

    async def publish(
        self, version: str, location: str, metadata: Mapping[str, str] | None = None
    ) -> WeightVersion:
        """Publish `version` at `location` and make it the latest.

        Publishing the same version at the same location again returns the existing record (a
        retried publish is harmless); at another location it raises `WeightVersionConflict`.
        The model folder must be complete before this is called: engines may load it at once.
        """
        _check_name("version", version)
        _check_location(version, location)
        key = f"{self._versions}{version}"
        for _ in range(_PUBLISH_ATTEMPTS):
            existing = await self.get(version)
            if existing is not None:
                if existing.location != location:
                    raise WeightVersionConflict(
                        f"version {version!r} of {self.model!r} is already published at "
                        f"{existing.location!r}; publish new weights under a new version"
                    )
                return existing
            latest = await self._store.get(self._latest_key)
            number = WeightVersion.from_json(latest.value).number + 1 if latest else 1
            record = WeightVersion(
                version=version,
                number=number,
                location=location,
                published_at=time.time(),
                metadata={str(k): str(v) for k, v in (metadata or {}).items()},
            )
            result = await self._store.txn(
                [
                    Compare.create_revision(key, CompareOp.EQUAL, 0),
                    Compare.mod_revision(
                        self._latest_key, CompareOp.EQUAL, latest.mod_revision if latest else 0
                    ),
                ],
                [PutOp.of(key, record.to_json()), PutOp.of(self._latest_key, record.to_json())],
            )
            if result.succeeded:
                return record
        raise WeightVersionError(
            f"could not publish {version!r}: `latest` of {self.model!r} kept moving "
            f"({_PUBLISH_ATTEMPTS} attempts)"
        )

    async def latest(self) -> WeightVersion | None:
        """The newest published version, or None before the first publication."""
        kv = await self._store.get(self._latest_key)
        return WeightVersion.from_json(kv.value) if kv else None

    async def get(self, version: str) -> WeightVersion | None:
        """The record of `version`, or None if it was never published."""
        _check_name("version", version)
        kv = await self._store.get(f"{self._versions}{version}")
        return WeightVersion.from_json(kv.value) if kv else None

    async def versions(self) -> list[WeightVersion]:
        """Every published version, oldest first."""
        result = await self._store.list_prefix(self._versions)
        return sorted((WeightVersion.from_json(kv.value) for kv in result.kvs), key=_number)

    @contextlib.asynccontextmanager
    async def watch(self) -> AsyncIterator[AsyncIterator[WeightVersion]]:
        """Follow the latest version: ``async with registry.watch() as updates: async for
        version in updates``.

        The first item is the latest version at the time of entering (if there is one), then
        every newer one as it is published, in order; a version is never repeated and never
        older than one already yielded. The stream raises `EtcdUnavailable` when etcd goes away;
        enter again to resume (the latest version is yielded first again).
        """
        async with self._store.list_and_watch(self._latest_key) as (snapshot, watch):

            async def updates() -> AsyncIterator[WeightVersion]:
                newest = 0
                for kv in snapshot.kvs:
                    if kv.key_str == self._latest_key:
                        record = _decode(kv)
                        newest = record.number
                        yield record
                async for event in watch:
                    if event.type != EventType.PUT or event.kv.key_str != self._latest_key:
                        continue
                    record = _decode(event.kv)
                    if record.number > newest:
                        newest = record.number
                        yield record

            yield updates()


def _decode(kv: KeyValue) -> WeightVersion:
    return WeightVersion.from_json(kv.value)


def _number(version: WeightVersion) -> int:
    return version.number
